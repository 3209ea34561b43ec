"""A quantized sliding layer's state is a function of the tokens (K/V) it was given (issue 31).

Gemma 2 (sliding + full layers) and Mistral (all sliding), window 8, through ``TieredCache``:
windows smaller than the residual (not quantized, ``Policy.resolve``) and larger (quantized),
int4 and int2, prompts shorter and longer than the window. Every way of reaching the same tokens
gives the same layer state, compared bit for bit (packed codes and scales, residual, counters)
and the next logits with ``torch.equal``:
- fed the same K/V in one update, in chunks, or a prefill then one token at a time;
- a model prefill, then ``load_state_dict`` / ``fork``, ``save`` + ``load``, retier from another
  quantized policy of the same block format;
- retier / ingest (``from_legacy``) from full precision: bit for bit whenever the full-precision
  layer still holds every token the quantized one was built from (the window fits in the
  residual, or nothing has slid out yet). When tokens have slid out of a quantized window, the
  oldest block a fresh layer holds was packed from tokens a full-precision sliding layer no
  longer has (its head lies before the window): that one block row differs, every other row and
  the residual are the same bits, and the next logits stay within quantization error
  (``tiercache.quantize.state``, docs/compat.md: why no rule can make that row a function of
  the window's tokens while the window keeps every token the model attends to).
(The model's own K/V of one prefill and of chunked prefill differ in the last float bits, from
the matmul shapes, so the chunked / decode comparisons feed the cache identical K/V.)
"""

from __future__ import annotations

import pytest
import torch

import builders as models
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

FP = {"name": "fp"}
POLICIES = {  # window 8 (7 tokens held): under / over the residual
    "int4-window-under-r8": {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 8},
    "int4-window-over-r4": {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 4},
    "int2-window-over-r2": {"backend": "native", "bits": 2, "group_size": 2, "residual_length": 2},
    "int4-window-over-r4-g2": {"backend": "native", "bits": 4, "group_size": 2, "residual_length": 4},
}
FAMILIES = ["gemma2", "mistral"]
LENGTHS = [5, 30]  # shorter and longer than the window
GRID = [(f, p, n) for f in FAMILIES for p in POLICIES for n in LENGTHS]
IDS = [f"{f}-{p}-len{n}" for f, p, n in GRID]


def policy(name: str) -> dict:
    return {"name": name, "quantize": POLICIES[name]}


def states(cache) -> list[dict]:
    return [layer.state_dict() for layer in cache.layers]


def differing(a: list[dict], b: list[dict]) -> list[tuple[int, str]]:
    """(layer, key) of every entry that differs; a buffer's ``capacity`` (the room allocated, which
    follows the update sizes: ``tiercache.layers.capacity``) is not state and is not compared."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        for key in sorted((set(x) | set(y)) - {k for k in set(x) | set(y) if k.endswith(".capacity")}):
            u, v = x.get(key), y.get(key)
            tensors = isinstance(u, torch.Tensor), isinstance(v, torch.Tensor)
            if any(tensors):
                if not (all(tensors) and u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v)):
                    out.append((i, key))
            elif u != v:
                out.append((i, key))
    return out


@torch.no_grad()
def next_logits(m, cache) -> torch.Tensor:
    return m(torch.tensor([[7]]), **cache_arg(cache), use_cache=True).logits


@torch.no_grad()
def prefilled(m, pol, ids):
    cache = TieredCache.from_policy(pol, m.config)
    m(ids, **cache_arg(cache), use_cache=True)
    return cache


def kv(cache, length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(len(cache.layers)):
        h, dk, dv = cache.model.kv_shape(i)
        out.append((torch.randn(1, h, length, dk, generator=g), torch.randn(1, h, length, dv, generator=g)))
    return out


def fed(config, pol, tensors, steps):
    cache = TieredCache.from_policy(pol, config)
    at = 0
    for s in steps:
        for i, (k, v) in enumerate(tensors):
            cache.update(k[:, :, at:at + s], v[:, :, at:at + s], i)
        at += s
    return cache


@pytest.mark.parametrize("family,name,length", GRID, ids=IDS)
def test_one_update_chunks_or_decode_give_the_same_state(family, name, length):
    m = models.build(family)
    pol = policy(name)
    tensors = kv(TieredCache.from_policy(pol, m.config), length)
    once = fed(m.config, pol, tensors, [length])
    want, logits = states(once), next_logits(m, once)
    for steps in ([3] * (length // 3) + ([length % 3] if length % 3 else []), [2] + [1] * (length - 2)):
        cache = fed(m.config, pol, tensors, steps)
        assert differing(states(cache), want) == [], steps
        assert torch.equal(next_logits(m, cache), logits), steps


@pytest.mark.parametrize("family,name,length", GRID, ids=IDS)
def test_lifecycle_paths_give_the_state_of_a_fresh_cache(family, name, length, tmp_path):
    m = models.build(family)
    pol, ids = policy(name), models.prompt(1, length)
    fresh = prefilled(m, pol, ids)
    want = states(fresh)
    loaded_sd = TieredCache.from_policy(pol, m.config)
    for layer, sd in zip(loaded_sd.layers, want):
        layer.load_state_dict(sd)
    fresh.save(tmp_path / "c.safetensors")
    other = {**pol, "name": "other", "offload": {"device": "cpu"}}  # the same block format, another tier
    moved = prefilled(m, other, ids)
    moved.retier(pol)
    exact = {"load_state_dict": loaded_sd, "fork": fresh.fork(),
             "save+load": TieredCache.load(tmp_path / "c.safetensors", m.config), "retier-same-format": moved}
    logits = next_logits(m, fresh.fork())
    for path, cache in exact.items():
        assert differing(states(cache), want) == [], path
        assert torch.equal(next_logits(m, cache), logits), path
    retiered = prefilled(m, FP, ids)
    ingested = TieredCache.from_legacy(retiered.to_legacy(), pol, m.config, seq_length=length)
    retiered.retier(pol)
    window = m.config.sliding_window
    slid_out = length > window - 1 and window - 1 > POLICIES[name]["residual_length"]
    for path, cache in (("retier-from-fp", retiered), ("ingest-from-fp", ingested)):
        diff = differing(states(cache), want)
        if not slid_out:  # the full-precision layer holds every token the fresh one was built from
            assert diff == [], path
            assert torch.equal(next_logits(m, cache), logits), path
            continue
        g = POLICIES[name]["group_size"]
        for i, key in diff:  # only packed blocks that began before the window (the oldest held)
            assert cache.layers[i].is_sliding and key.startswith("store.") and key.endswith(("keys", "values")), key
            got, ref = states(cache)[i][key], want[i][key]
            residual = want[i]["residual.keys"]
            rows, held = got.shape[2], 0 if residual is None else residual.shape[2]
            begins = [length - held - (rows - j) * g for j in range(rows)]  # each row's first position
            before = sum(b < length - (window - 1) for b in begins)
            assert 1 <= before <= 2 and got.shape == ref.shape, (path, key, begins)
            assert torch.equal(got[:, :, before:], ref[:, :, before:]), (path, key)
        assert torch.allclose(next_logits(m, cache), logits, atol=0.05), path
