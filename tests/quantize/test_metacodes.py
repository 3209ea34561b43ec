"""8-bit metadata (``meta_bits: 8``): each group's scale and offset as a byte on its row's grids.

What must hold: decoding rebuilds exactly the scale and offset the codes were computed with (in
every dtype); rounding only widens a group's range, so no element is clipped by it and every
element is within half a (widened) step of its value; the step widens by little; constant groups
and all-zero rows stay exact; the rows are the planner's size and smaller than with dtype
metadata; a cache with it reads back what a full-precision cache holds within the format's error;
and the policy refuses what it cannot do, saying what is allowed.
"""

from __future__ import annotations

import pytest
import torch

import tiercache
from tiercache.errors import PolicyError
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import metacodes
from tiercache.quantize.backends.native import Native
from tiercache.quantize.blocks import BlockCodec
from tiercache.quantize.codec import CodecSpec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def keys_like(seed: int, shape=(2, 3, 4, 64, 64)) -> torch.Tensor:
    """Per-channel magnitudes from 0.05 to 6 and channel means up to ~10: the spread of real keys."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-1.3, 0.8, shape[-1])
    return torch.randn(shape, generator=g) * scale + torch.randn(shape[-1], generator=g) * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_cover_widens_never_clips_and_expand_is_exact(dtype, bits):
    x = keys_like(bits)
    lo, hi = x.amin(-2), x.amax(-2)  # [B, H, N, D]: one group per channel
    scale, offset, ranges, codes = metacodes.cover(lo, hi, bits, dtype)
    assert ranges.dtype == dtype and ranges.shape == (*lo.shape[:-1], 4)
    assert codes.dtype == torch.uint8 and codes.shape == (*lo.shape[:-1], 2 * lo.shape[-1])
    back = metacodes.expand(ranges, codes)
    assert torch.equal(back[0].float(), scale) and torch.equal(back[1].float(), offset) and back[0].dtype == dtype
    top = 2**bits - 1
    # float32 arithmetic, and where a grid step is finer than the dtype, the dtype's own rounding
    slack = (1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps) * (lo.abs() + hi.abs())
    assert (offset <= lo + slack).all() and (offset + scale * top >= hi - slack).all()
    widened = scale / ((hi - lo) / top).clamp_min(1e-30)
    assert widened.min() >= 1 - (1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps)  # never narrower
    ref = (hi - lo) / top
    rms = (scale.square().mean() / ref.square().mean()).sqrt()  # what the RMS error grows with
    assert rms < 1.03  # measured 0.7-0.9% on this wide spread of ranges and means


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_constant_groups_and_zero_rows_stay_exact(dtype):
    x = keys_like(0, (1, 2, 3, 64, 16)).to(dtype)
    x[0, 0, 0] = 0.0  # a whole row of zeros
    x[0, 1, 1, :, 3] = 1.5  # one constant channel among varied ones
    codec = BlockCodec(Native(4), 64, 16, "channel", dtype, meta_bits=8)
    y = codec.roundtrip(x.reshape(1, 2, 3 * 64, 16)).reshape(x.shape)
    assert torch.equal(y[0, 0, 0], x[0, 0, 0])
    assert torch.isfinite(y).all()
    step = (x[0, 1, 1].float().amax(0) - x[0, 1, 1].float().amin(0)).max() / 15
    assert (y[0, 1, 1, :, 3].float() - 1.5).abs().max() <= step  # within a step of the row's widest group


def test_rebuild_from_shaped_operands_is_expand_exactly():
    """The decoder's path (``operands`` made once per rows, ``rebuild`` per step) gives expand's
    very numbers, already in the decoder's broadcast shape, for either axis's shape."""
    g = torch.Generator().manual_seed(3)
    lo = torch.randn(2, 3, 5, 64, generator=g)
    hi = lo + torch.rand(2, 3, 5, 64, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        _, _, ranges, codes = metacodes.cover(lo, hi, 4, dtype)
        for shape in ((1, 64), (64, 1, 1), (16, 4, 1)):
            got = metacodes.rebuild(metacodes.operands(ranges, codes, shape))
            for a, b in zip(got, metacodes.expand(ranges, codes)):
                assert a.shape == (2, 3, 5, *shape) and a.dtype == dtype
                assert torch.equal(a, b.reshape(a.shape))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("clip", ["minmax", "mse"])
def test_packed_round_trip_within_half_a_widened_step(dtype, axis, bits, clip):
    x = keys_like(7, (2, 3, 3, 64, 64)).to(dtype).reshape(2, 3, 192, 64)  # [B, H, T, D]
    plain = BlockCodec(Native(bits, clip=clip), 64, 64, axis, dtype)
    meta8 = BlockCodec(Native(bits, clip=clip), 64, 64, axis, dtype, meta_bits=8)
    rows = meta8.encode(x)
    assert rows.shape[-1] == CodecSpec.of(QuantizePolicy(bits=bits, key_axis=axis, meta_bits=8)).row_bytes(
        64, "keys", x.element_size()) < plain.row_bytes
    out = torch.empty_like(x)
    meta8.decode(rows, out)
    err = (out.float() - x.float()).pow(2).mean().sqrt()
    ref = (plain.roundtrip(x).float() - x.float()).pow(2).mean().sqrt()
    assert err <= ref * 1.1  # the bytes cost under 10% of the error (measured: 0-5%)
    if clip == "minmax":  # nothing clipped: every element within half its group's step (+ the dtype's rounding)
        scale, offset = (t.float() for t in metacodes.rebuild(meta8._parts(rows, remember=False)[1]))  # [B, H, N, *meta]
        x5 = x.float().reshape(2, 3, 3, *meta8.shape)  # [B, H, N, G, D] (token axis: [.., G, 1, D])
        dev = (out.float().reshape(x5.shape) - x5).abs()
        rounding = 2 * torch.finfo(dtype).eps * (x5.abs() + offset.abs()) + 1e-6
        assert (dev <= scale / 2 * (1 + 1e-5) + rounding).all()


def test_cache_with_byte_metadata_reads_back_close_to_full_precision():
    """Through ``TieredCache.update`` on a model's layers: packed blocks (beyond the residual)
    decoded close to what was written, sinks exact, and the same tokens as a dtype-metadata cache."""
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    q = {"bits": 4, "group_size": 16, "residual_length": 16, "sink_tokens": 2}
    caches = [tiercache.TieredCache.from_policy({"name": n, "quantize": {**q, **extra}}, config)
              for n, extra in (("plain", {}), ("meta8", {"meta_bits": 8}))]
    g = torch.Generator().manual_seed(3)
    k, v = keys_like(5, (1, 2, 1, 81, 16)).reshape(1, 2, 81, 16), torch.randn(1, 2, 81, 16, generator=g)
    for c in caches:
        c.update(k[:, :, :80], v[:, :, :80], 0)  # the prefill: 2 sinks, 64 tokens packed, 14 in the residual
    (kp, vp), (km, vm) = (c.update(k[:, :, 80:], v[:, :, 80:], 0) for c in caches)  # a decode step reads them
    assert km.shape == k.shape
    assert torch.equal(km[:, :, :2], k[:, :, :2]) and torch.equal(vm[:, :, :2], v[:, :, :2])  # sinks
    assert torch.equal(km[:, :, -15:], k[:, :, -15:])  # the residual: 80 - 2 sinks - 64 packed, and the new token
    for got, plain, ref in ((km, kp, k), (vm, vp, v)):
        err, base = (got - ref).pow(2).mean().sqrt(), (plain - ref).pow(2).mean().sqrt()
        assert 0 < err <= base * 1.1
    assert sum(caches[1].nbytes().values()) < sum(caches[0].nbytes().values())


@pytest.mark.parametrize("bad, says", [
    ({"meta_bits": 4}, "allowed values are null"),
    ({"meta_bits": 8, "backend": "quanto"}, "backend native"),
    ({"meta_bits": 8, "format": "fp8", "bits": 8}, "format int"),
])
def test_policy_refuses_what_byte_metadata_cannot_do(bad, says):
    with pytest.raises(PolicyError, match=says):
        tiercache.load_policy({"name": "x", "quantize": {"bits": 4, **bad}})
