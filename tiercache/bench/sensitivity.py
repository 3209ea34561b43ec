"""Per-layer sensitivity to KV quantization, measured on the model, and the mixed-precision policy it implies.

Interface
- ``layer_costs(model, prefilled, continuation, quantize, tick=None) -> list[float]``: for each
  layer ``i``, the relative perplexity increase (``ppl_i / ppl_fp - 1``) when only layer ``i``
  is quantized with ``quantize`` (a ``QuantizePolicy`` mapping) and every other layer is exact,
  teacher-forced over ``continuation`` after a seeded ``prefilled`` prompt.
- ``mixed(base, costs, upgrade, k, name) -> dict``: a policy dict: ``base`` everywhere, and the
  ``k`` costliest layers overridden with ``upgrade`` (a ``QuantizePolicy`` mapping merged over
  ``base``, e.g. ``{"bits": 4}``; ``None`` keeps them in full precision).
- ``one_pass_nll(model, cache, prefilled, continuation [M]) -> nll [M]``: the continuation scored
  in one forward over the seeded cache (``M - 1`` tokens in one update). It attends over itself
  exactly and over the prompt as the cache keeps it: the same as ``M`` decode steps while the
  continuation stays in the residual (e.g. residual 128, group 64, a prompt of a multiple of 128
  tokens and no sinks: the prompt is all packed, the continuation all residual); otherwise a
  close proxy. ~M times cheaper, which is what makes the per-layer, per-tensor search affordable.
- ``upgrade_gains(model, items, base, upgrades, tick=None) -> {name: [gain per layer]}``: ``base``
  (a ``QuantizePolicy`` mapping) on every layer, and layer ``i`` alone given the upgrade
  (``upgrades[name]``, merged over ``base``, e.g. ``{"keys": {"key_bits": 4}, "values":
  {"value_bits": 4}}``): the gain is ``ppl_base / ppl_i - 1``, what that upgrade buys where every
  other layer is quantized too (unlike ``layer_costs``, which quantizes one layer alone).
  ``items``: ``(prefilled, continuation, mask)`` triples (texts ``[N, ...]`` in a batch, or one
  retrieval sample each), scored by ``one_pass_nll``; ``mask`` (bool like the continuation, or
  None for all) picks the tokens that count, e.g. only a pass key's digits. The perplexity is
  over every counted token of every item.
- ``mixed_upgrades(base, gains, upgrades, k, name) -> dict``: a policy dict: ``base`` everywhere,
  and the ``k`` (layer, upgrade) pairs of the largest gain applied, merged per layer into one
  override each (a layer given keys and values upgrades gets both).

Measure on text that the evaluation does not read (``texts`` split ``"train"``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

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


@torch.no_grad()
def one_pass_nll(model, cache, prefilled, continuation: torch.Tensor) -> torch.Tensor:
    x = continuation.to(model.device).reshape(len(prefilled.logits) if prefilled.logits.dim() > 1 else 1, -1)
    first = prefilled.logits.reshape(x.shape[0], -1).float()  # [N, V]: predicts token 0
    rest = model(input_ids=x[:, :-1], past_key_values=cache, use_cache=True).logits.float()  # [N, M-1, V]
    logits = torch.cat([first[:, None], rest], 1)  # [N, M, V]
    nll = F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction="none").view(x.shape)  # [N, M]
    return nll if continuation.dim() > 1 else nll[0]


def upgrade_gains(model, items, base: dict, upgrades: dict, tick=None) -> dict:
    from tiercache import TieredCache

    def ppl(policy) -> float:
        total, count = 0.0, 0
        for prefilled, continuation, mask in items:
            cache = seeded.seed(TieredCache.from_policy(policy, model.config), prefilled)
            nll = one_pass_nll(model, cache, prefilled, continuation)
            cache.close()
            nll = nll if mask is None else nll[mask]
            total, count = total + nll.sum().item(), count + nll.numel()
        return math.exp(total / count)

    ref = ppl({"name": "base", "quantize": dict(base)})
    gains = {name: [] for name in upgrades}
    for i in range(len(items[0][0].kv)):
        for name, upgrade in upgrades.items():
            policy = {"name": f"{name}-{i}", "quantize": dict(base),
                      "overrides": [{"layers": [i], "quantize": {**base, **upgrade}}]}
            gains[name].append(ref / ppl(policy) - 1)
            if tick:
                tick(i, name, gains[name][-1])
    return gains


def mixed_upgrades(base: dict, gains: dict, upgrades: dict, k: int, name: str, description: str = "") -> dict:
    pairs = sorted(((g, i, n) for n, per in gains.items() for i, g in enumerate(per)), key=lambda p: -p[0])[:k]
    per_layer: dict[int, dict] = {}
    for _, i, n in pairs:
        per_layer.setdefault(i, {}).update(upgrades[n])
    policy = {"name": name, "description": description, "quantize": dict(base)}
    groups: dict[tuple, list[int]] = {}
    for i, up in sorted(per_layer.items()):
        groups.setdefault(tuple(sorted(up.items())), []).append(i)
    if groups:
        policy["overrides"] = [{"layers": layers, "quantize": dict(up)} for up, layers in groups.items()]
    return policy
