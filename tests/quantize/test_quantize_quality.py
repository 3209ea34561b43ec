"""Reconstruction quality per backend and bits, per-channel vs per-token keys, and packed bytes."""

from __future__ import annotations

import pytest
import torch

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import backends
from tiercache.quantize.blocks import BlockCodec
from tests.quantize.quantized import quantized

# (backend, bits, format, minimum SQNR in dB on Gaussian data, group 64); measured about 0.5 dB above.
# 1 bit keeps only two levels per group: worse than zero on Gaussian data, usable only for outlier-free data.
SQNR = [
    ("native", 2, "int", 6.5), ("native", 4, "int", 20.0), ("native", 8, "int", 45.0), ("native", 8, "fp8", 31.5),
    ("quanto", 2, "int", 6.5), ("quanto", 4, "int", 20.0),
    ("hqq", 1, "int", -4.0), ("hqq", 2, "int", 7.0), ("hqq", 3, "int", 14.0), ("hqq", 4, "int", 20.5), ("hqq", 8, "int", 45.0),
]


def sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.float(), y.float()
    return float(10 * torch.log10(x.pow(2).mean() / (x - y).pow(2).mean()))


def codec(backend, bits, fmt="int", axis="channel", dtype=torch.float32, group=64, head_dim=64):
    config = QuantizePolicy(backend=backend, bits=bits, format=fmt, group_size=group)
    return BlockCodec(backends.get(config), group, head_dim, axis, dtype)


@pytest.mark.parametrize("axis", ["channel", "token"])
@pytest.mark.parametrize("backend,bits,fmt,floor", [pytest.param(*s, id=f"{s[0]}-{s[2]}{s[1]}") for s in SQNR])
def test_sqnr(backend, bits, fmt, floor, axis):
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(0))
    y = codec(backend, bits, fmt, axis).roundtrip(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert sqnr(x, y) > floor


def test_more_bits_is_better():
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(1))
    values = [sqnr(x, codec("hqq", b).roundtrip(x)) for b in (1, 2, 3, 4, 8)]
    assert values == sorted(values)


def test_hqq_beats_min_max_at_2_bits():
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(2))
    assert sqnr(x, codec("hqq", 2).roundtrip(x)) > sqnr(x, codec("native", 2).roundtrip(x))


def outlier_keys(seed=0, tokens=256, heads=2, dim=64):
    """Keys like real LLM keys: a few channels with large, token-independent magnitude."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, heads, tokens, dim, generator=g)
    k[..., [3, 17, 40]] = k[..., [3, 17, 40]] * 0.3 + torch.tensor([20.0, -15.0, 12.0])
    q = torch.randn(1, heads, 16, dim, generator=g)
    v = torch.randn(1, heads, tokens, dim, generator=g)
    return q, k, v


def attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / k.shape[-1] ** 0.5, dim=-1) @ v


@pytest.mark.parametrize("backend,bits", [("native", 2), ("native", 4), ("quanto", 2), ("hqq", 2)], ids=lambda x: str(x))
def test_per_channel_keys_beat_per_token(backend, bits):
    q, k, v = outlier_keys()
    exact = attention(q, k, v)
    err = {axis: (attention(q, codec(backend, bits, axis=axis).roundtrip(k), v) - exact).pow(2).mean().item()
           for axis in ("channel", "token")}
    assert err["channel"] * 3 < err["token"], err


# (bits, fmt, dtype, group, key_axis, value_axis)
NBYTES = [
    (4, "int", torch.float16, 64, "channel", "token"), (4, "int", torch.bfloat16, 64, "channel", "token"),
    (2, "int", torch.float16, 64, "channel", "token"), (8, "int", torch.float16, 64, "channel", "token"),
    (4, "int", torch.float32, 64, "channel", "token"), (4, "int", torch.float16, 32, "token", "token"),
    (2, "int", torch.float16, 128, "channel", "channel"), (8, "fp8", torch.float16, 64, "channel", "token"),
]


@pytest.mark.parametrize("bits,fmt,dtype,group,kax,vax", [pytest.param(*n, id=f"{n[1]}{n[0]}-{str(n[2])[6:]}-g{n[3]}-{n[4]}-{n[5]}") for n in NBYTES])
def test_packed_nbytes_within_3_percent(bits, fmt, dtype, group, kax, vax):
    batch, heads, dim, tokens = 1, 4, 128, 1088
    config = QuantizePolicy(bits=bits, format=fmt, group_size=group, residual_length=64, key_axis=kax, value_axis=vax)
    layer = quantized(config)
    layer.update(torch.randn(batch, heads, tokens, dim).to(dtype), torch.randn(batch, heads, tokens, dim).to(dtype))
    packed_tokens = layer.store.seq_length() * group
    # KIVI flush: every time the residual reaches 64 tokens (one block of 128 for group 128)
    assert packed_tokens == {32: 1088, 64: 1088, 128: 1024}[group]
    size = torch.empty((), dtype=dtype).element_size()
    meta = 1 if fmt == "fp8" else 2  # scale (+ zero point) per group, model dtype
    elements = batch * heads * packed_tokens * dim
    ideal = 2 * (elements * bits / 8 + elements / min(group, dim) * meta * size)  # keys and values
    store = sum(layer.store.nbytes().values())
    assert abs(store - ideal) / ideal < 0.03, (store, ideal)
    residual = sum(layer.residual.nbytes().values())
    assert sum(layer.nbytes().values()) == store + residual
    assert residual == 2 * batch * heads * (tokens - packed_tokens) * dim * size  # exactly what it holds
