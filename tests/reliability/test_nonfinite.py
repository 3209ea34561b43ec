"""Non-finite keys and values (NaN, +Inf, -Inf).

- Full-precision chains (any storage, resident or offloaded) store and return them bit for bit,
  exactly like transformers' ``DynamicLayer`` / ``DynamicSlidingWindowLayer``: a cache is not a
  validator, and attention treats them as the model made them.
- Quantized chains refuse them with ``CacheError`` and change nothing: one NaN would turn the
  scale of its whole quantization group into NaN (and an Inf makes every other value of the
  group round to the same code), silently poisoning tokens that were finite.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from kvmodel import CHAINS, LAYER_KINDS, MAX_LENGTH, Chain, same_snapshot, snapshot, tokens
from tiercache.errors import CacheError

B = 2
POISON = [pytest.param(float("nan"), id="nan"), pytest.param(float("inf"), id="inf"), pytest.param(float("-inf"), id="-inf")]
FULL_PRECISION = [pytest.param(c, id=c.id) for c in CHAINS if not c.quantized]
QUANTIZED = [pytest.param(c, id=c.id) for c in CHAINS if c.quantized and c.offload in ("resident", "disk-p1")]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern: equality that also holds for NaN."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def poisoned(t: int, value: float, seed: int, dtype=torch.float32):
    k, v = tokens(B, t, dtype, seed)
    k[0, 1, t // 2, 3] = value
    v[1, 0, t - 1, 0] = value
    return k, v


def transformers_layer(kind: str, window: int):
    return DynamicSlidingWindowLayer(window) if kind == "sliding_attention" else DynamicLayer()


@pytest.mark.parametrize("value", POISON)
@pytest.mark.parametrize("chain", FULL_PRECISION)
def test_full_precision_passes_them_through_like_dynamic_cache(chain: Chain, value):
    with tempfile.TemporaryDirectory() as path:
        cache = chain.build(path)
        theirs = [transformers_layer(kind, chain.window) for kind in LAYER_KINDS]
        for step, t in enumerate([6, 1, 3, 1]):
            for i, ref in enumerate(theirs):
                k, v = poisoned(t, value, 10 * step + i, chain.dtype) if step in (0, 2) else tokens(B, t, chain.dtype, 10 * step + i)
                out, want = cache.update(k, v, i), ref.update(k, v)
                for o, w in zip(out, want):
                    n = w.shape[2]
                    assert o.shape[2] == (MAX_LENGTH if chain.storage == "static" and cache.is_compileable else n)
                    assert torch.equal(bits(o[:, :, :n]), bits(w))
        cache.close()


@pytest.mark.parametrize("where", ["residual", "packed-now"])
@pytest.mark.parametrize("value", POISON)
@pytest.mark.parametrize("chain", QUANTIZED)
def test_quantized_chains_refuse_them_and_change_nothing(chain: Chain, value, where):
    with tempfile.TemporaryDirectory() as path:
        cache = chain.build(path)
        refs = chain.refs(cache)
        for i, ref in enumerate(refs):
            k, v = tokens(B, 9, chain.dtype, i)
            cache.update(k, v, i)
            ref.update(k, v)
            ref.sync_packed()
        before = snapshot(cache)
        t = 1 if where == "residual" else 12  # a long update packs some of its own tokens
        for i in range(len(cache.layers)):
            with pytest.raises(CacheError, match=f"^layer {i}: .*(NaN|Inf|finite)"):
                cache.update(*poisoned(t, value, 50 + i, chain.dtype), i)
            assert same_snapshot(before, snapshot(cache))
        for i, ref in enumerate(refs):  # still usable, same answers as the reference
            k, v = tokens(B, 2, chain.dtype, 70 + i)
            want, out = ref.update(k, v), cache.update(k, v, i)
            assert all(torch.equal(o[:, :, : w.shape[2]], w) for o, w in zip(out, want))
        cache.close()


def test_one_nan_would_poison_a_whole_group():
    """Why quantized chains refuse: min-max quantization of a group holding one NaN loses every value."""
    from tiercache.policy.schema import QuantizePolicy
    from tiercache.quantize import backends
    from tiercache.quantize.blocks import BlockCodec

    codec = BlockCodec(backends.get(QuantizePolicy(bits=4, group_size=4)), 4, 8, "channel", torch.float32)
    x = torch.randn(1, 1, 4, 8)
    x[0, 0, 0, 0] = float("nan")
    y = codec.roundtrip(x)
    assert y[0, 0, :, 0].isnan().all()  # the whole channel group (4 tokens), not just the NaN
