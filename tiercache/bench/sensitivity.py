"""Per-layer sensitivity to KV quantization, measured on the model, and the mixed-precision policy it implies.

Interface
- ``layer_costs(model, prefilled, continuation, quantize, tick=None) -> list[float]``: for each
  layer ``i``, the relative perplexity increase (``ppl_i / ppl_fp - 1``) when only layer ``i``
  is quantized with ``quantize`` (a ``QuantizePolicy`` mapping) and every other layer is exact,
  teacher-forced over ``continuation`` after a seeded ``prefilled`` prompt.
- ``mixed(base, costs, upgrade, k, name) -> dict``: a policy dict: ``base`` everywhere, and the
  ``k`` costliest layers overridden with ``upgrade`` (a ``QuantizePolicy`` mapping merged over
  ``base``, e.g. ``{"bits": 4}``; ``None`` keeps them in full precision).

Measure on text that the evaluation does not read (``texts`` split ``"train"``).
"""

from __future__ import annotations

from tiercache.bench import forced, quality, seeded


def layer_costs(model, prefilled, continuation, quantize: dict, tick=None) -> list[float]:
    from transformers import DynamicCache

    from tiercache import TieredCache

    n = len(prefilled.kv)
    ref = quality.perplexity(forced.teacher_forced(
        model, seeded.seed(DynamicCache(config=model.config), prefilled), prefilled, continuation).nll)
    costs = []
    for i in range(n):
        policy = {"name": f"only-layer-{i}", "overrides": [{"layers": [i], "quantize": dict(quantize)}]}
        cache = seeded.seed(TieredCache.from_policy(policy, model.config), prefilled)
        ppl = quality.perplexity(forced.teacher_forced(model, cache, prefilled, continuation).nll)
        costs.append(ppl / ref - 1)
        cache.close()
        if tick:
            tick(i, costs[-1])
    return costs


def mixed(base: dict, costs: list[float], upgrade: dict | None, k: int, name: str, description: str = "") -> dict:
    top = sorted(sorted(range(len(costs)), key=lambda i: -costs[i])[:k])
    policy = {"name": name, "description": description, "quantize": dict(base)}
    if top:
        policy["overrides"] = [{"layers": top, "quantize": None if upgrade is None else dict(upgrade)}]
    return policy
