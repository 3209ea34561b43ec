"""Clipping search (``clip: mse``): never worse than min/max on the measured error, per group and
after the packed round trip; better where outliers stretch a group; only for native integers."""

from __future__ import annotations

import pytest
import torch

import tiercache
from tiercache.errors import PolicyError
from tiercache.policy import QuantizePolicy
from tiercache.processors import backends
from tiercache.processors.backends.clip import group_error, search_affine
from tiercache.processors.backends.native import minmax_affine
from tiercache.processors.blocks import BlockCodec

DATA = ["gaussian", "outliers", "skewed", "constant"]


def sample(kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 4, 64, 16, generator=g)  # [B, H, N, G, D]
    if kind == "outliers":
        mask = torch.rand(x.shape, generator=g) < 0.02
        x = torch.where(mask, x * 25, x)
    elif kind == "skewed":
        x = x.exp()
    elif kind == "constant":
        x[..., :8] = 1.5
    return x


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [-2, -1], ids=["channel", "token"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_search_never_worse_than_minmax_per_group(kind, bits, dim, dtype):
    x = sample(kind, bits).to(dtype)
    searched = group_error(x, dim, bits, *search_affine(x, dim, bits, dtype))
    minmax = group_error(x, dim, bits, *minmax_affine(x, dim, bits, dtype))
    assert (searched <= minmax).all()
    if kind == "outliers" and bits < 8:
        assert searched.sum() < 0.9 * minmax.sum()  # the search buys something where ranges are stretched


@pytest.mark.parametrize("kind", DATA)
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_packed_round_trip_never_worse(kind, bits, axis):
    x = sample(kind, 7).reshape(2, 3, 4 * 64, 16)  # [B, H, T, D]
    err = {}
    for clip in ("minmax", "mse"):
        q = QuantizePolicy(bits=bits, group_size=64, clip=clip)
        codec = BlockCodec(backends.get(q), 64, 16, axis, torch.float32)
        y = codec.roundtrip(x)
        assert y.shape == x.shape and torch.isfinite(y).all()
        err[clip] = float((y - x).square().sum())
    assert err["mse"] <= err["minmax"] * (1 + 1e-6)


def test_clip_is_a_native_integer_option():
    ok = tiercache.Policy.from_dict({"quantize": {"bits": 2, "clip": "mse"}})
    assert ok.quantize.clip == "mse"
    with pytest.raises(PolicyError, match=r"policy.quantize.clip: 'best' is not allowed; allowed: 'minmax' \| 'mse'"):
        tiercache.Policy.from_dict({"quantize": {"clip": "best"}})
    with pytest.raises(PolicyError, match=r"policy.quantize.clip: 'mse' is a native integer-format option"):
        tiercache.Policy.from_dict({"quantize": {"bits": 8, "format": "fp8", "clip": "mse"}})
    with pytest.raises(PolicyError, match=r"policy.overrides\[0\].quantize.clip"):
        tiercache.Policy.from_dict({"quantize": {"bits": 4}, "overrides": [
            {"layers": [0], "quantize": {"backend": "quanto", "clip": "mse"}}]})
