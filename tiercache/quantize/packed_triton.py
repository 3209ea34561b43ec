"""The CUDA kernel of packed attention: Triton, split-K over the packed blocks (flash-decoding).

    available() -> bool                     triton imports and ``TIERCACHE_PACKED_KERNEL`` is not ``torch``
                                            (the kernel is compiled on its first launch)
    handles(codec, rows, which) -> bool     this kernel has the layout and the device
    attend(q, keys, values, exact, at_blocks, skip, mask, splits=None) -> [B, H, M, Dv]
        ``packed_cpu.attend``'s interface: ``q`` ``[B, H, M, D]`` float32 (softmax scale applied,
        query heads grouped onto the K/V heads), ``keys`` / ``values`` ``(codes, scale, offset,
        codec)`` as ``packed_attention._parts`` gives them, ``exact`` the exact segments ``[(k,
        v)]`` float32 in token order with the packed blocks before ``exact[at_blocks]``, ``skip``
        the hidden leading tokens of the first block, ``mask`` None or float32 ``[B, H, M, S]``
        over every token. ``splits``: how many parts the packed tokens are cut into (default:
        enough programs to fill the GPU, each part a whole number of blocks).

How. One program per (batch x head, split): it walks its split's packed blocks, unpacks each
block's codes in registers (planar ``blocks.pack`` bytes, centred ``code - mid`` as the torch
reference does) and keeps a running max, sum and weighted value sum of its tokens (online
softmax). Keys per channel fold the scale into the query and the offset into one ``q . o`` term
per block: ``(q * s) . code + q . o``; values per channel likewise ``(p . code) * s + sum(p) * o``.
Per token (a scale per token and group of channels) the block's codes are scaled in registers,
``code * s + o``, before the dot. Nothing but the three partials per split is written; torch then
merges them with the exact parts (sinks, residual, new tokens) under one softmax, like
flash-decoding's reduce. The per-block scales and offsets are made float32 and contiguous in
torch first (a few bytes per block: ``meta_bits: 8`` is rebuilt there, small), and the mask, if
any, is read per token. Split boundaries are token positions: a split may end inside a block.

Selection: ``packed_attention._fast(device)`` picks this module for CUDA tensors when
``available()``; ``handles`` then says per layout, the torch reference taking the rest.

Layouts: integer codes of 2, 4 or 8 bits with an offset, keys and values each per channel or
per token, any metadata dtype, ``meta_bits: 8``, ``key_gain`` (in the scale and offset), sinks,
a sliding window's partly visible first block. Not fp8 (no offset, float codes) nor 3-bit
codes: those take the torch reference (``packed_attention``), as on any device without Triton.
Products are IEEE float32 (``input_precision="ieee"``, no TF32) so the result stays within
1e-5 of dequantize-then-SDPA. Tested on the CPU under ``TRITON_INTERPRET=1``
(``tests/quantize/test_packed_triton.py``), where ``handles`` also takes CPU tensors.
"""

from __future__ import annotations

import os

import torch

try:  # an optional dependency (the ``triton`` extra): without it this module imports and declines
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = tl = None

__all__ = ["attend", "available", "handles"]


def available() -> bool:
    return triton is not None and os.environ.get("TIERCACHE_PACKED_KERNEL", "") != "torch"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def handles(codec, rows: torch.Tensor, which: str) -> bool:
    backend = codec.backend
    on = rows.device.type == "cuda" or (rows.device.type == "cpu" and _interpreting())
    return on and backend.has_offset and backend.bits in (2, 4, 8) and available()


if triton is not None:

    @triton.jit
    def _codes(ptr, offs_t, offs_d, live, D: tl.constexpr, EP, BITS: tl.constexpr):
        """One block's centred codes ``[T, D]`` float32 (planar bytes: element ``e`` of the
        token-major block is in byte ``e % EP`` at bit ``(e // EP) * BITS``)."""
        e = offs_t[:, None] * D + offs_d[None, :]
        ok = live[:, None] & (offs_d[None, :] < D)
        byte = tl.load(ptr + e % EP, mask=ok, other=0).to(tl.int32)
        code = (byte >> ((e // EP) * BITS)) & ((1 << BITS) - 1)
        return code.to(tl.float32) - ((1 << BITS) - 1) * 0.5

    @triton.jit
    def _meta(s_ptr, o_ptr, bh, n, N, offs_t, offs_d, live, D: tl.constexpr, G: tl.constexpr, NG: tl.constexpr):
        """A per-token block's scale and offset as ``[T, D]`` (group ``c // (D / NG)`` of token ``t``)."""
        at = ((bh * N + n) * G + offs_t[:, None]) * NG + offs_d[None, :] // (D // NG)
        ok = live[:, None] & (offs_d[None, :] < D)
        return tl.load(s_ptr + at, mask=ok, other=0.0), tl.load(o_ptr + at, mask=ok, other=0.0)

    @triton.jit
    def _split_kernel(q_ptr, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, mask_ptr, m_out, l_out, acc_out,
                      H, M, N, n_vis, skip, chunk, splits,
                      kc_sb, kc_sh, kc_sn, vc_sb, vc_sh, vc_sn, mk_sb, mk_sh, mk_sm, K_EP, V_EP,
                      G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K_BITS: tl.constexpr,
                      V_BITS: tl.constexpr, K_NG: tl.constexpr, V_NG: tl.constexpr,
                      K_CHANNEL: tl.constexpr, V_CHANNEL: tl.constexpr, HAS_MASK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr,
                      BLOCK_DV: tl.constexpr):
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // H
        h = bh % H
        lo = sp * chunk
        hi = tl.minimum(lo + chunk, n_vis)
        offs_m = tl.arange(0, BLOCK_M)
        offs_t = tl.arange(0, BLOCK_T)
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok = offs_m < M
        q = tl.load(q_ptr + (bh * M + offs_m[:, None]) * DK + offs_dk[None, :],
                    mask=m_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)  # [M, DK]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        n_lo = (lo + skip) // G
        n_hi = tl.where(hi > lo, (hi + skip - 1) // G + 1, n_lo)
        for n in range(n_lo, n_hi):
            v = n * G + offs_t - skip  # visible token index of each row of the block
            live = (offs_t < G) & (v >= lo) & (v < hi)
            kc = _codes(kc_ptr + b * kc_sb + h * kc_sh + n * kc_sn, offs_t, offs_dk, live, DK, K_EP, K_BITS)
            if K_CHANNEL:  # scale folded into the query, offset one q . o term
                dk_ok = offs_dk < DK
                ks = tl.load(ks_ptr + (bh * N + n) * DK + offs_dk, mask=dk_ok, other=0.0)
                ko = tl.load(ko_ptr + (bh * N + n) * DK + offs_dk, mask=dk_ok, other=0.0)
                s = tl.dot(q * ks[None, :], tl.trans(kc), input_precision="ieee")
                s += tl.sum(q * ko[None, :], axis=1)[:, None]
            else:  # a scale per token and group: scaled in registers
                ks, ko = _meta(ks_ptr, ko_ptr, bh, n, N, offs_t, offs_dk, live, DK, G, K_NG)
                s = tl.dot(q, tl.trans(kc * ks + ko), input_precision="ieee")  # [M, T]
            if HAS_MASK:
                s += tl.load(mask_ptr + b * mk_sb + h * mk_sh + offs_m[:, None] * mk_sm + v[None, :],
                             mask=m_ok[:, None] & live[None, :], other=0.0)
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row hidden so far: no nan
            alpha = tl.exp(m_i - base)
            p = tl.exp(s - base[:, None])  # [M, T]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vc = _codes(vc_ptr + b * vc_sb + h * vc_sh + n * vc_sn, offs_t, offs_dv, live, DV, V_EP, V_BITS)
            if V_CHANNEL:
                dv_ok = offs_dv < DV
                vs = tl.load(vs_ptr + (bh * N + n) * DV + offs_dv, mask=dv_ok, other=0.0)
                vo = tl.load(vo_ptr + (bh * N + n) * DV + offs_dv, mask=dv_ok, other=0.0)
                term = tl.dot(p, vc, input_precision="ieee") * vs[None, :] + tl.sum(p, axis=1)[:, None] * vo[None, :]
            else:
                vs, vo = _meta(vs_ptr, vo_ptr, bh, n, N, offs_t, offs_dv, live, DV, G, V_NG)
                term = tl.dot(p, vc * vs + vo, input_precision="ieee")  # [M, DV]
            acc = acc * alpha[:, None] + term
            m_i = m_new
        row = (bh * splits + sp) * M + offs_m
        tl.store(m_out + row, m_i, mask=m_ok)
        tl.store(l_out + row, l_i, mask=m_ok)
        tl.store(acc_out + row[:, None] * DV + offs_dv[None, :], acc, mask=m_ok[:, None] & (offs_dv[None, :] < DV))


# One software-pipeline stage: the default three buffer every load in shared memory, about 180 KB a
# program at head dim 128 and 64-token blocks (over an A100's 164 KB); one needs about 45 KB
# (checked by compiling for sm_80 / sm_90 in the tests). FP fusion: triton's default, said (3.9
# warns when it is left unset). Not tuned on a GPU yet.
LAUNCH = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": True}


def _flat(t: torch.Tensor, b: int, h: int, n: int) -> torch.Tensor:
    return t.float().reshape(b, h, n, -1).contiguous()  # [B, H, N, X]: a block's scales (or offsets)


def _prepared(parts, b: int, h: int, n: int):
    """(codes, scale, centred offset, codec): the offset takes ``mid * scale`` as the codes are centred."""
    codes, scale, offset, codec = parts
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    mid = (2**codec.backend.bits - 1) / 2
    scale = _flat(scale, b, h, n)
    return codes, scale, _flat(offset, b, h, n) + mid * scale, codec


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _default_splits(bh: int, n_vis: int, g: int, device: torch.device) -> int:
    """About two programs per SM over the GPU (four SMs assumed elsewhere), each split at least
    four blocks (a program's step is one block); the caller rounds splits to whole blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(_cdiv(2 * sms, bh), _cdiv(n_vis, 4 * g)))


def attend(q, keys, values, exact, at_blocks: int, skip: int, mask, splits: int | None = None) -> torch.Tensor:
    b, h, n, _ = keys[0].shape
    kc, ks, ko, kcodec = _prepared(keys, b, h, n)
    vc, vs, vo, vcodec = _prepared(values, b, h, n)
    g, m, dk, dv = kcodec.g, q.shape[2], kcodec.d, vcodec.d
    n_vis = n * g - skip
    q = q.contiguous()
    if splits is None:
        chunk = _cdiv(_cdiv(n_vis, _default_splits(b * h, n_vis, g, q.device)), g) * g  # whole blocks
    else:
        chunk = _cdiv(n_vis, splits)  # a boundary may fall inside a block
    splits = _cdiv(n_vis, chunk)  # [lo, hi) = [i * chunk, min((i + 1) * chunk, n_vis)): none empty
    before = sum(k.shape[2] for k, _ in exact[:at_blocks])  # the packed tokens' first column in the mask
    m_p = torch.empty((b, h, splits, m), dtype=torch.float32, device=q.device)  # [B, H, S, M] each split's max
    l_p = torch.empty_like(m_p)  # its sum of exp(score - max)
    acc_p = torch.empty((b, h, splits, m, dv), dtype=torch.float32, device=q.device)  # its weighted values
    part = None
    if mask is not None:
        part = mask[..., before : before + n_vis]  # [B, H, M, n_vis]: the packed tokens' columns
        part = part if part.stride(-1) == 1 else part.contiguous()
    mk, mk_strides = (m_p, (0, 0, 0)) if part is None else (part, part.stride()[:3])
    _split_kernel[(b * h, splits)](
        q, kc, ks, ko, vc, vs, vo, mk, m_p, l_p, acc_p,
        h, m, n, n_vis, skip, chunk, splits,
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2), *mk_strides,
        _cdiv(g * dk, 8 // kcodec.backend.bits), _cdiv(g * dv, 8 // vcodec.backend.bits),  # bytes a plane
        G=g, DK=dk, DV=dv, K_BITS=kcodec.backend.bits, V_BITS=vcodec.backend.bits,
        K_NG=1 if kcodec.axis == "channel" else kcodec.shape[1], V_NG=1 if vcodec.axis == "channel" else vcodec.shape[1],
        K_CHANNEL=kcodec.axis == "channel", V_CHANNEL=vcodec.axis == "channel", HAS_MASK=part is not None,
        BLOCK_M=_pow2(m), BLOCK_T=_pow2(g), BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), **LAUNCH)
    return _merge(q, m_p, l_p, acc_p, exact, at_blocks, n_vis, mask)


def _merge(q, m_p, l_p, acc_p, exact, at_blocks: int, n_vis: int, mask) -> torch.Tensor:
    """The split partials ``[B, H, S, M]`` (max, sum) and ``[B, H, S, M, Dv]`` (weighted values)
    and the exact segments under one softmax: ``[B, H, M, Dv]``."""
    scores, at = [], 0
    for i, (k, _) in enumerate(exact):
        at += n_vis if i == at_blocks else 0
        s = torch.matmul(q, k.transpose(-1, -2))  # [B, H, M, r]
        if mask is not None:
            s = s + mask[..., at : at + k.shape[2]]
        scores.append(s)
        at += k.shape[2]
    top = m_p.amax(2)  # [B, H, M]
    for s in scores:
        top = torch.maximum(top, s.amax(-1))
    top = top.masked_fill(top == float("-inf"), 0.0)
    w = torch.exp(m_p - top.unsqueeze(2))  # [B, H, S, M]
    num = (w.unsqueeze(-1) * acc_p).sum(2)  # [B, H, M, Dv]
    den = (w * l_p).sum(2)
    for s, (_, v) in zip(scores, exact):
        p = torch.exp(s - top.unsqueeze(-1))
        num = num + torch.matmul(p, v)
        den = den + p.sum(-1)
    return num / den.unsqueeze(-1)
