"""The Triton packed-attention kernel on CPU tensors under ``TRITON_INTERPRET=1``.

Not collected on its own (no ``test_`` prefix): ``test_packed_triton.py`` runs it in a fresh
process with ``TRITON_INTERPRET=1`` set before triton is imported, so the interpreter never leaks
into the rest of the suite. Each case sends a decode step's SDPA through ``packed_attention.attend``
with the Triton kernel selected (as on CUDA) and a chosen split count, and compares it with SDPA
over the same step's dequantized K/V (float32, within 1e-5). Tiny shapes: the interpreter runs
each program in Python.
"""

from __future__ import annotations

import functools
import os
import types

import pytest
import torch
import torch.nn.functional as F

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/quantize/test_packed_triton.py with TRITON_INTERPRET=1", allow_module_level=True)
triton = pytest.importorskip("triton")
from triton.runtime import interpreter as _interpreter  # noqa: E402

_patch_lang = getattr(_interpreter, "_patch_lang", None)  # an interpreter internal (triton 3.x)


def _patch_lang_once(fn):
    """The interpreter patches the language modules a function sees (``triton.language``, its
    ``core``) for a launch, and again on each call of a ``@triton.jit`` helper inside it
    (``inspect.getmembers`` over four modules, never undone): the kernels call their helpers once
    per block, so the repeats were a sixth of the interpreter's time. A call whose modules are all
    patched already (their ``load`` replaced) patches nothing: the same modules stay patched, the
    same programs run."""
    langs = [v for v in fn.__globals__.values() if v is triton.language or v is triton.language.core]
    if langs and not any(triton.language.core.is_builtin(lang.load) for lang in langs):
        return _interpreter._LangPatchScope()
    return _patch_lang(fn)


if _patch_lang is not None and hasattr(_interpreter, "_LangPatchScope"):
    _interpreter._patch_lang = _patch_lang_once

from tiercache.cache.chain import Shared  # noqa: E402
from tiercache.policy.schema import QuantizePolicy  # noqa: E402
from tiercache.quantize import packed_attention, packed_triton  # noqa: E402
from tiercache.quantize.packed_kv import PackedKV  # noqa: E402
from tests.quantize.quantized import PACKED_LAYOUTS, quantized  # noqa: E402

B, H, D = 2, 2, 32
G, R = 16, 16
TOL = 1e-5

LAYOUTS = [p for p in PACKED_LAYOUTS if p.id != "fp8"]  # fp8 is declined: test_packed_triton.py
STORAGE = [
    pytest.param({}, id="full"),
    pytest.param(dict(max_length=256), id="static"),
    pytest.param(dict(window=40), id="sliding"),  # a partly visible first block
]
SPLITS = [3, None, 7]  # None: the default (whole blocks); 3 and 7 cut blocks, the last split shorter (1: below)


@pytest.fixture
def calls(monkeypatch):
    """Selects the Triton kernel for CPU tensors (as ``_fast`` does on CUDA) with ``calls['splits']``
    parts; counts its launches so a silent fallback fails the test."""
    seen = {"n": 0, "splits": None}

    def attend(*args, **kwargs):
        seen["n"] += 1
        return packed_triton.attend(*args, splits=seen["splits"], **kwargs)

    kernel = types.SimpleNamespace(handles=packed_triton.handles, attend=attend)
    monkeypatch.setattr(packed_attention, "_fast", lambda device=None: kernel)
    return seen


def _gen(seed: int) -> torch.Generator:
    """A fixed stream per call site: the figures a test compares are the same on every run."""
    return torch.Generator().manual_seed(seed)


def tokens(t, seed, d=D, dv=D):
    g = _gen(seed)
    k = torch.randn(B, H, t, d, generator=g)
    k[..., :3] *= 6  # a few large channels, as real keys have
    return k, torch.randn(B, H, t, dv, generator=g)  # [B, H, t, D]


def layer(form, storage=None):
    return quantized(QuantizePolicy(group_size=G, residual_length=R, **form), Shared(), **(storage or {}))


def check(query, k, v, calls, **sdpa):
    before, fresh = calls["n"], k.pair.plain is None
    got = F.scaled_dot_product_attention(query, k, v, **sdpa)
    assert calls["n"] == before + 1, "the Triton kernel did not run"
    assert k.pair.plain is None or not fresh  # no dequantized K/V were made for it
    want = F.scaled_dot_product_attention(query, k.plain(), v.plain(), **sdpa)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


@pytest.mark.parametrize("storage", STORAGE)
@pytest.mark.parametrize("form", LAYOUTS)
def test_layouts_match_dequantize_then_sdpa(form, storage, calls):
    lay = layer(form, storage)
    lay.append(*tokens(75, 0))
    for step in range(len(SPLITS)):  # across a flush: the residual fills, a block is appended
        calls["splits"] = SPLITS[step]
        k, v = lay.append(*tokens(4, 10 + step))
        assert isinstance(k, PackedKV)
        query = torch.randn(B, 2 * H, 1, D, generator=torch.Generator().manual_seed(step))  # GQA: 2 per K/V head
        check(query, k, v, calls, enable_gqa=True)


@pytest.mark.parametrize("form", [LAYOUTS[0], LAYOUTS[3], LAYOUTS[4]])
def test_every_split_count(form, calls):
    """From one split to more splits than blocks: boundaries inside blocks, a short last split."""
    lay = layer(form, dict(window=70))
    lay.append(*tokens(120, 1))
    k, v = lay.append(*tokens(1, 2))
    n_vis = k.pair.packed.blocks[0].shape[2] * G - k.pair.packed.skip
    assert k.pair.packed.skip and n_vis % G  # the first block partly hidden
    query = torch.randn(B, 3 * H, 1, D, generator=_gen(100))
    for splits in range(1, n_vis // G + 3):
        calls["splits"] = splits
        check(query, k, v, calls, enable_gqa=True)


@pytest.mark.parametrize("form", [LAYOUTS[0], LAYOUTS[5], LAYOUTS[9]])
def test_masks_scale_and_several_queries(form, calls):
    """A bool padding mask, a float chunk mask hiding a prefix (a chunked layer), a chosen scale,
    several new tokens with a causal mask, transformers' folded GQA query (``[B, Hkv, rep, D]``)."""
    lay = layer(form)
    lay.append(*tokens(150, 3))
    k, v = lay.append(*tokens(1, 4))
    s = k.shape[2]
    pad = torch.ones(B, 1, 1, s, dtype=torch.bool)
    pad[0, ..., :37] = False  # the first sequence is left-padded: a split wholly hidden for it
    chunk = torch.zeros(1, 1, 1, s)
    chunk[..., : s - 40] = float("-inf")  # a chunk of 40: the packed part mostly hidden
    query = torch.randn(B, 3 * H, 1, D, generator=_gen(118))
    for splits, mask in ((3, pad), (5, chunk)):
        calls["splits"] = splits
        check(query, k, v, calls, attn_mask=mask, enable_gqa=True, scale=0.3)
    calls["splits"] = 2
    check(torch.randn(B, H, 3, D, generator=_gen(123)), k, v, calls, attn_mask=pad)
    k, v = lay.append(*tokens(3, 5))  # three new tokens: a causal mask over the last three columns
    s = k.shape[2]
    causal = torch.ones(1, 1, 3, s, dtype=torch.bool).tril(diagonal=s - 3)
    check(torch.randn(B, 2 * H, 3, D, generator=_gen(127)), k, v, calls, attn_mask=causal, enable_gqa=True)


def test_other_head_dims(calls):
    """Keys of 48 channels (not a power of two: masked lanes), values of 16, 24-token blocks."""
    lay = quantized(QuantizePolicy(group_size=24, residual_length=8, bits=4), Shared())
    lay.append(*tokens(100, 6, d=48, dv=16))
    k, v = lay.append(*tokens(1, 7, d=48, dv=16))
    assert v.shape[-1] == 16 and k.shape[-1] == 48
    for splits in (1, 4):
        calls["splits"] = splits
        check(torch.randn(B, H, 1, 48, generator=_gen(138)), k, v, calls)


@pytest.mark.parametrize("form", [LAYOUTS[0], LAYOUTS[7]])
def test_bf16_model(form, calls, monkeypatch):
    """bf16 K/V (the scales and offsets in bf16 on the rows): from the same codes, the Triton kernel
    and the CPU path (the C++ kernel or the torch reference) agree in float32 (a float32 query)."""
    lay = layer(dict(form, sink_tokens=2))
    k0, v0 = tokens(90, 8)
    lay.append(k0.bfloat16(), v0.bfloat16())
    k, v = lay.append(*(t.bfloat16() for t in tokens(1, 9)))
    query = torch.randn(B, 2 * H, 1, D, generator=_gen(149))
    got = []
    for splits in (1, 3):
        calls["splits"] = splits
        got.append(packed_attention.attend(query, k.pair.packed))
    assert calls["n"] == 2
    monkeypatch.undo()  # the ``calls`` fixture's patch too: the device's own choice again, the CPU kernel
    want = packed_attention.attend(query, k.pair.packed)
    for out in got:
        torch.testing.assert_close(out, want, rtol=0, atol=TOL)
    ref = F.scaled_dot_product_attention(query, k.plain().float(), v.plain().float(), enable_gqa=True)
    # the reference rounds K/V to bf16, the kernels do not (as test_packed_attention's bf16 bound: 3e-2)
    torch.testing.assert_close(want, ref, rtol=0, atol=3e-2)
