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
- ``upgrade_gains(model, items, base, upgrades, tick=None, layers=None, nll_of=one_pass_nll) -> {name: [gain per layer]}``: ``base``
  (a ``QuantizePolicy`` mapping) on every layer, and layer ``i`` alone given the upgrade
  (``upgrades[name]``, merged over ``base``, e.g. ``{"keys": {"key_bits": 4}, "values":
  {"value_bits": 4}}``): the gain is ``ppl_base / ppl_i - 1``, what that upgrade buys where every
  other layer is quantized too (unlike ``layer_costs``, which quantizes one layer alone).
  ``items``: ``(prefilled, continuation, mask)`` triples (texts ``[N, ...]`` in a batch, or one
  retrieval sample each), scored by ``one_pass_nll``; ``mask`` (bool like the continuation, or
  None for all) picks the tokens that count, e.g. only a pass key's digits. The perplexity is
  over every counted token of every item. ``layers``: measure only these (0 elsewhere);
  ``nll_of``: how an item is scored (``one_pass_nll``; ``decode_gains`` passes step decoding).
- ``mixed_upgrades(base, gains, upgrades, k, name) -> dict``: a policy dict: ``base`` everywhere,
  and the ``k`` (layer, upgrade) pairs of the largest gain applied, merged per layer into one
  override each (a layer given keys and values upgrades gets both).
- ``greedy_upgrades(model, objectives, base, upgrades, k, candidates=None, tick=None, start=()) -> list[dict]``:
  ``k`` (layer, upgrade) picks made one at a time, each the candidate that, added to the picks
  so far, scores best, measured again after every pick (so it sees how layers interact, which
  the one-shot ``upgrade_gains`` ranking cannot). ``objectives``: name -> items (as
  ``upgrade_gains`` takes them), e.g. train text and retrieval samples. The score of a policy is
  the sum over objectives of the share of the base's loss it keeps,
  ``(log ppl - log ppl_fp) / (log ppl_base - log ppl_fp)`` (per objective 1 for the base, 0 for
  full precision), so objectives of different scales weigh the same; an objective the base does not
  lose on (gap <= 0) is refused. ``candidates``: ``(layer, upgrade name)`` pairs to choose from
  (default every layer with every upgrade). Returns the picks in order, each
  ``{"layer", "upgrade", "score", "ppl": {objective: ppl}}``, after a first entry for the base
  (``layer`` None) with the full-precision perplexities under ``"fp"``; ``tick(entry)`` after
  the base and after each pick. ``start``: pairs taken as picked already (an earlier search's
  picks, to go on from them): listed after the base with ``"given": True`` (score and ppl
  None), then up to ``k`` new picks.
- ``decode_gains(model, items, base, upgrades, layers, tick=None) -> {name: [gain per layer]}``: as
  ``upgrade_gains``, for the given ``layers`` only (0 elsewhere), but each text scored by
  teacher-forced *step* decoding through the cache (``multitext.teacher_forced``: ``upgrade_gains``
  with ``nll_of=_decode_nll``), so the tokens
  quantized while decoding count too: where int4 loses (its one-pass loss on train text is within
  the noise). ``items``: ``(prefilled, continuation)`` pairs (texts ``[N, ...]`` in a batch).
  Costs a decode step per token per candidate (~100x ``upgrade_gains``): give it a short list.
- ``policy_of(base, picks, upgrades, name, description="") -> dict``: the policy dict of
  ``(layer, upgrade name)`` pairs (what ``mixed_upgrades`` and the greedy picks become).

Measure on text that the evaluation does not read (``texts`` split ``"train"``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from research import forced, seeded
from tiercache.bench import quality
from tiercache.cache.compat import cache_arg


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
    rest = model(input_ids=x[:, :-1], **cache_arg(cache), use_cache=True).logits.float()  # [N, M-1, V]
    logits = torch.cat([first[:, None], rest], 1)  # [N, M, V]
    nll = F.cross_entropy(logits.flatten(0, 1), x.flatten(), reduction="none").view(x.shape)  # [N, M]
    return nll if continuation.dim() > 1 else nll[0]


def _ppl(model, items, policy, nll_of=one_pass_nll) -> float:
    """Perplexity over every counted token of every item, each scored by ``nll_of`` (``one_pass_nll``,
    or ``_decode_nll``) through a cache of ``policy`` seeded with the item's prompt."""
    from tiercache import TieredCache

    total, count = 0.0, 0
    for prefilled, continuation, mask in items:
        cache = seeded.seed(TieredCache.from_policy(policy, model.config), prefilled)
        nll = nll_of(model, cache, prefilled, continuation)
        cache.close()
        nll = nll if mask is None else nll[mask]
        total, count = total + nll.sum().item(), count + nll.numel()
    return math.exp(total / count)


def upgrade_gains(model, items, base: dict, upgrades: dict, tick=None, layers=None, nll_of=one_pass_nll) -> dict:
    """(``layers``: measure only these, 0 elsewhere; ``nll_of``: how each item is scored, see ``_ppl``.)"""
    n = len(items[0][0].kv)
    ref = _ppl(model, items, {"name": "base", "quantize": dict(base)}, nll_of)
    gains = {name: [0.0] * n for name in upgrades}
    for i in range(n) if layers is None else layers:
        for name in upgrades:
            policy = policy_of(base, [(i, name)], upgrades, f"{name}-{i}")
            gains[name][i] = ref / _ppl(model, items, policy, nll_of) - 1
            if tick:
                tick(i, name, gains[name][i])
    return gains


def _decode_nll(model, cache, prefilled, continuation: torch.Tensor) -> torch.Tensor:
    """Teacher-forced step decoding through ``cache``: ``[N, M]`` as ``one_pass_nll`` gives it."""
    from research import multitext

    return multitext.teacher_forced(model, cache, prefilled, continuation).nll


def decode_gains(model, items, base: dict, upgrades: dict, layers, tick=None) -> dict:
    return upgrade_gains(model, [(p, c, None) for p, c in items], base, upgrades, tick, layers, _decode_nll)


def policy_of(base: dict, picks, upgrades: dict, name: str, description: str = "") -> dict:
    per_layer: dict[int, dict] = {}
    for i, n in picks:
        per_layer.setdefault(i, {}).update(upgrades[n])
    policy = {"name": name, "description": description, "quantize": dict(base)}
    groups: dict[tuple, list[int]] = {}
    for i, up in sorted(per_layer.items()):
        groups.setdefault(tuple(sorted(up.items())), []).append(i)
    if groups:
        policy["overrides"] = [{"layers": layers, "quantize": dict(up)} for up, layers in groups.items()]
    return policy


def mixed_upgrades(base: dict, gains: dict, upgrades: dict, k: int, name: str, description: str = "") -> dict:
    pairs = sorted(((g, i, n) for n, per in gains.items() for i, g in enumerate(per)), key=lambda p: -p[0])[:k]
    return policy_of(base, [(i, n) for _, i, n in pairs], upgrades, name, description)


def greedy_upgrades(model, objectives: dict, base: dict, upgrades: dict, k: int, candidates=None,
                    tick=None, start=()) -> list[dict]:
    layers = len(next(iter(objectives.values()))[0][0].kv)
    pool = [(i, n) for i in range(layers) for n in upgrades] if candidates is None else [tuple(c) for c in candidates]
    pool = list(dict.fromkeys(pool))  # each candidate once
    bad = [c for c in [*pool, *map(tuple, start)] if c[1] not in upgrades or not 0 <= c[0] < layers]
    if bad:
        raise ValueError(f"candidates {bad}: a candidate is (layer in 0..{layers - 1}, one of {sorted(upgrades)})")
    fp = {o: _ppl(model, items, {"name": "fp"}) for o, items in objectives.items()}
    at_base = {o: _ppl(model, items, {"name": "base", "quantize": dict(base)}) for o, items in objectives.items()}
    flat = [o for o in objectives if at_base[o] <= fp[o]]
    if flat:
        raise ValueError(f"objectives {flat}: the base policy loses nothing there (ppl {[at_base[o] for o in flat]} "
                         f"<= full precision {[fp[o] for o in flat]}), so no upgrade can be scored on them")

    def score(ppl: dict) -> float:
        return sum(math.log(ppl[o] / fp[o]) / math.log(at_base[o] / fp[o]) for o in objectives)

    picks = [{"layer": None, "upgrade": None, "score": score(at_base), "ppl": at_base, "fp": fp}]
    if tick:
        tick(picks[0])
    chosen: list[tuple] = []
    for c in map(tuple, start):
        if c not in chosen:
            chosen.append(c)
            picks.append({"layer": c[0], "upgrade": c[1], "score": None, "ppl": None, "given": True})
    for _ in range(min(k, len([c for c in pool if c not in chosen]))):
        best = None
        for c in pool:
            if c in chosen:
                continue
            policy = policy_of(base, chosen + [c], upgrades, f"greedy-{len(chosen)}")
            ppl = {o: _ppl(model, items, policy) for o, items in objectives.items()}
            s = score(ppl)
            if best is None or s < best[0]:
                best = (s, c, ppl)
        chosen.append(best[1])
        picks.append({"layer": best[1][0], "upgrade": best[1][1], "score": best[0], "ppl": best[2]})
        if tick:
            tick(picks[-1])
    return picks
