"""Packed decode attention: SDPA over a decode step's ``PackedKV`` equals dequantize-then-SDPA.

The reference is the layer's own dequantized K/V for the same step (``PackedKV.plain``: the
workspace path that ``packed_attention: false`` returns, checked equal to it too) fed to
``scaled_dot_product_attention`` in float32. Every quantized layout, every storage kind
(full, static, sliding: a chunked layer is a sliding one with a chunk mask), with and without
GQA and masks, through both kernels (the C++ one where it has the layout, and the torch
reference forced): within 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tiercache.cache.chain import Shared
from tiercache.quantize import packed_attention, packed_cpu
from tiercache.quantize.packed_kv import PackedKV
from tiercache.policy.schema import QuantizePolicy
from tests.quantize.quantized import PACKED_LAYOUTS, quantized

B, H, D = 2, 2, 32
G, R = 16, 16
TOL = 1e-5

LAYOUTS = PACKED_LAYOUTS
STORAGE = [
    pytest.param({}, id="full"),
    pytest.param(dict(max_length=512), id="static"),
    pytest.param(dict(window=40), id="sliding"),
]
KERNELS = [pytest.param("auto", id="kernel-auto"), pytest.param("torch", id="kernel-torch")]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(packed_cpu, "handles", lambda *a: False)
    else:
        request.getfixturevalue("packed_kernel")  # built and loaded: "auto" runs the C++ kernel
    return request.param


def tokens(t, seed, d=D):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, t, d, generator=g)
    k[..., :3] *= 6  # a few large channels, as real keys have
    return k, torch.randn(B, H, t, d, generator=g)  # [B, H, t, D]


def layer(form, storage, packed=True):
    q = QuantizePolicy(group_size=G, residual_length=R, packed_attention=packed, **form)
    return quantized(q, Shared(), **storage)


def reference(query, k, v, mask=None, scale=None):
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("form", LAYOUTS)
def test_decode_attention_matches_dequantize_then_sdpa(form, storage, kernel):
    packed, plain = layer(form, storage), layer(form, storage, packed=False)
    prompt = tokens(150, 0)
    for lay in (packed, plain):
        lay.append(*prompt)
    checked = 0
    for step in range(20):  # across flushes: the residual fills and empties, blocks are appended
        new = tokens(1, 100 + step)
        k, v = packed.append(*new)
        pk, pv = plain.append(*new)
        assert isinstance(k, PackedKV) and isinstance(v, PackedKV)
        assert not isinstance(pk, PackedKV)
        assert k.shape == pk.shape and v.shape == pv.shape
        torch.testing.assert_close(k.plain(), pk, rtol=0, atol=0)
        torch.testing.assert_close(v.plain(), pv, rtol=0, atol=0)
        query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(step))  # GQA: 2 queries per head
        got = F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
        want = reference(query, pk, pv)
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)
        checked += 1
    assert checked == 20


@pytest.mark.parametrize("form", LAYOUTS[:3] + LAYOUTS[9:11])
def test_masks_and_folded_queries(form, kernel):
    """A padding mask (bool), a chunk mask hiding a prefix (float), and transformers' folded GQA
    query (``pack_gqa``: ``[B, Hkv, rep, D]`` against the K/V heads, the mask broadcast)."""
    lay = layer(form, {})
    lay.append(*tokens(200, 1))
    k, v = lay.append(*tokens(1, 2))
    pk, pv = k.plain(), v.plain()
    s = k.shape[2]
    bool_mask = torch.ones(B, 1, 1, s, dtype=torch.bool)
    bool_mask[0, ..., :37] = False  # the first sequence is left-padded
    float_mask = torch.zeros(1, 1, 1, s)
    float_mask[..., : s - 70] = float("-inf")  # a chunk of 70: earlier tokens hidden
    query = torch.randn(B, 3 * H, 1, D)
    for mask in (bool_mask, float_mask):
        got = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, enable_gqa=True, scale=0.3)
        torch.testing.assert_close(got, reference(query, pk, pv, mask, 0.3), rtol=0, atol=TOL)
    folded = torch.randn(B, H, 3, D)  # [B, Hkv, rep, D]
    got = F.scaled_dot_product_attention(folded, k, v, attn_mask=bool_mask)
    want = F.scaled_dot_product_attention(folded, pk, pv, attn_mask=bool_mask)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_anything_else_reads_the_dequantized_tensors():
    """Eager attention's ``repeat_kv`` and matmuls, slicing, ``cat``: on the workspace tensors."""
    lay = layer(dict(bits=4), {})
    lay.append(*tokens(100, 3))
    k, v = lay.append(*tokens(1, 4))
    pk = k.plain()
    assert torch.equal(k[:, :, 5:9], pk[:, :, 5:9])
    assert torch.equal(k * 2, pk * 2)
    assert torch.equal(torch.cat([k, k], 2), torch.cat([pk, pk], 2))
    assert k.shape == pk.shape and k.dtype == pk.dtype and k.device == pk.device and k.dim() == 4
    with pytest.raises(Exception):  # causal over several queries: SDPA's own check, on the plain tensors
        F.scaled_dot_product_attention(torch.randn(B, H, 2, D), k, v, is_causal=True, dropout_p=0.0, scale=-1.0,
                                       enable_gqa=True, attn_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool)[..., :0])


def test_prefill_and_packed_off_return_plain_tensors():
    lay = layer(dict(bits=4), {})
    k, _ = lay.append(*tokens(300, 5))
    assert type(k) is torch.Tensor  # prefill: today's path
    off = layer(dict(bits=4), {}, packed=False)
    off.append(*tokens(300, 5))
    assert type(off.append(*tokens(1, 6))[0]) is torch.Tensor
    assert off.config.packed_attention is False and lay.config.packed_attention is True


def test_bf16_close_to_the_reference():
    """bf16 models: packed attention runs in float32 over the exact codes; the reference rounds
    the dequantized K/V to bf16 first, so they agree to bf16's resolution, not 1e-5."""
    lay = layer(dict(bits=4), {})
    k0, v0 = tokens(200, 7)
    lay.append(k0.bfloat16(), v0.bfloat16())
    k1, v1 = tokens(1, 8)
    k, v = lay.append(k1.bfloat16(), v1.bfloat16())
    query = torch.randn(B, H, 1, D).bfloat16()
    got = F.scaled_dot_product_attention(query, k, v)
    want = reference(query.float(), k.plain().float(), v.plain().float())
    torch.testing.assert_close(got.float(), want, rtol=0, atol=2e-2)


def test_the_kernel_takes_the_common_layouts(packed_kernel):
    """On a machine with g++ the CPU kernel is built (skipped without one); it takes the common layouts."""
    lay = layer(dict(bits=4), {})
    lay.append(*tokens(100, 9))
    k, v = lay.append(*tokens(1, 10))
    kc, vc = k.pair.packed.codecs
    assert packed_cpu.handles(kc, k.pair.packed.blocks[0], "keys")
    assert packed_cpu.handles(vc, k.pair.packed.blocks[1], "values")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_decode_step_issues_few_ops(dtype, packed_kernel):
    """One int4 layer's decode step (update + SDPA over the ``PackedKV``) through the C++ kernel, as
    the torch profiler on the CPU counts it: the finite check (2 max-abs, their maximum, one read),
    the residual's append (2 cat), the kernel's one allocation; no float32 copies of the scales,
    offsets, exact tokens or query, no ops merging partials. (``bench/count_packed_ops.py`` prints
    the same count at an 8B shape.)"""
    from torch.profiler import ProfilerActivity, profile

    lay = layer(dict(bits=4), {})
    lay.append(*(t.to(dtype) for t in tokens(300, 0)))
    query = torch.randn(B, 2 * H, 1, D).to(dtype)
    F.scaled_dot_product_attention(query, *lay.append(*(t.to(dtype) for t in tokens(1, 1))), enable_gqa=True)
    new = [t.to(dtype) for t in tokens(1, 2)]  # a step like the one before: the rows' views are remembered
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        k, v = lay.append(*new)
        out = F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
    ops = [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert len(ops) <= 16, ops  # 93 (bf16) and 75 (fp32) before: casts, reshapes, the kernel's temporaries
    assert not any(name in ("aten::to", "aten::_to_copy", "aten::reshape", "aten::contiguous") for name in ops), ops
    # (bf16: the reference's dequantized K/V are rounded to bf16, the kernel's products are not)
    torch.testing.assert_close(out.float(), reference(query.float(), k.plain().float(), v.plain().float()),
                               rtol=0, atol=3e-2 if dtype == torch.bfloat16 else TOL)
