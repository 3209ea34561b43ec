"""Clipping search (``clip: mse``): never worse than min/max on the measured error, per group and
after the packed round trip; better where outliers stretch a group; only for native integers.
Per tensor (``mse-values`` / ``mse-keys``): that tensor's blocks are exactly ``mse``'s, the other's
exactly min/max's, in a layer fed through the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import tiercache
from tiercache.errors import PolicyError
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import backends
from tiercache.quantize.backends.clip import group_error, search_affine
from tiercache.quantize.backends.native import minmax_affine
from tiercache.quantize.blocks import BlockCodec

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
    with pytest.raises(PolicyError, match=r"policy.quantize.clip: 'best' is not allowed; allowed: 'minmax' \| 'mse' \| 'mse-values' \| 'mse-keys'"):
        tiercache.Policy.from_dict({"quantize": {"clip": "best"}})
    with pytest.raises(PolicyError, match=r"policy.quantize.clip: 'mse' is a native integer-format option"):
        tiercache.Policy.from_dict({"quantize": {"bits": 8, "format": "fp8", "clip": "mse"}})
    with pytest.raises(PolicyError, match=r"policy.overrides\[0\].quantize.clip"):
        tiercache.Policy.from_dict({"quantize": {"bits": 4}, "overrides": [
            {"layers": [0], "quantize": {"backend": "quanto", "clip": "mse"}}]})


def _layer_outputs(clip: str, bits: int = 2):
    """K/V a one-layer cache returns for a decode step after 3 flushed blocks (group 16)."""
    cache = tiercache.TieredCache.from_policy(
        {"quantize": {"bits": bits, "group_size": 16, "residual_length": 16, "sink_tokens": 2, "clip": clip}},
        LlamaConfig(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, hidden_size=32))
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 60, 16, generator=g), torch.randn(1, 2, 60, 16, generator=g)  # [B, H, T, D]
    k[..., 3] *= 20  # an outlier channel
    cache.update(k, v, 0)
    keys, values = cache.update(k[:, :, :1], v[:, :, :1], 0)
    return k, v, keys[:, :, :60].clone(), values[:, :, :60].clone()


@pytest.mark.parametrize("bits", [2, 4])
def test_per_tensor_clip_is_min_max_on_the_other_tensor(bits):
    k, v, k_mm, v_mm = _layer_outputs("minmax", bits)
    _, _, k_all, v_all = _layer_outputs("mse", bits)
    _, _, k_val, v_val = _layer_outputs("mse-values", bits)
    _, _, k_key, v_key = _layer_outputs("mse-keys", bits)
    assert torch.equal(k_val, k_mm) and torch.equal(v_val, v_all)  # keys min/max, values searched
    assert torch.equal(k_key, k_all) and torch.equal(v_key, v_mm)  # keys searched, values min/max
    assert (v_val - v).square().sum() <= (v_mm - v).square().sum() * (1 + 1e-6)
    assert (k_key - k).square().sum() <= (k_mm - k).square().sum() * (1 + 1e-6)
    assert not torch.equal(v_val, v_mm)  # the search changed something at these bits


def test_for_tensor_resolves_the_clip_per_tensor():
    base = backends.get(QuantizePolicy(bits=2, clip="mse-values"))
    assert backends.for_tensor(base, "keys").clip == "minmax" and backends.for_tensor(base, "values").clip == "mse"
    both = backends.get(QuantizePolicy(bits=2, clip="mse"))
    assert backends.for_tensor(both, "keys") is both and backends.for_tensor(both, "values") is both
