"""The CUDA kernel of packed attention: Triton, split-K over the packed blocks (flash-decoding).

    available() -> bool                     triton imports and ``TIERCACHE_PACKED_KERNEL`` is not ``torch``
                                            (the kernel is compiled on its first launch)
    handles(codec, rows, which) -> bool     this kernel has the layout and the device
    attend(query, scale, keys, values, exact, at_blocks, skip, mask, splits=None) -> [B, Hq, L, Dv]
        ``packed_cpu.attend``'s interface: ``query`` ``[B, Hq, L, D]`` in its own dtype and strides
        (scaled by ``scale`` in the kernel, query heads grouped onto the K/V heads as ``repeat_kv``
        does), ``keys`` / ``values`` ``(codes, scale, offset, codec)`` as
        ``packed_attention.raw_parts`` gives them (views of the rows, the model's dtype), ``exact``
        the exact segments ``[(k, v)]`` (at most three: sinks, residual, new tokens) in the model's
        dtype in token order with the packed blocks before ``exact[at_blocks]``, ``skip`` the hidden
        leading tokens of the first block, ``mask`` None or float32 ``[B, H, M, S]`` over every
        token. ``splits``: how many parts the packed tokens are cut into (default: enough programs
        to fill the GPU, each part a whole number of blocks). The output is in the query's dtype.

How. One program per (batch x head, split): it walks its split's packed blocks, unpacks each
block's codes in registers (planar ``blocks.pack`` bytes, centred ``code - mid`` as the torch
reference does) and keeps a running max, sum and weighted value sum of its tokens (online
softmax). Keys per channel fold the scale into the query and the offset into one ``q . o`` term
per block: ``(q * s) . code + q . o``; values per channel likewise ``(p . code) * s + sum(p) * o``.
Per token (a scale per token and group of channels) the block's codes are scaled in registers,
``code * s + o``, before the dot. Nothing but the three partials per split is written (one
``[B, H, S, M, Dv + 2]`` buffer); a second kernel (``_merge_kernel``, one program per batch x
K/V head) folds them and the exact parts (sinks, residual, new tokens) under one online softmax,
like flash-decoding's reduce, and writes the output. The scales and offsets are read in the
model's dtype where they lie in the rows (their strides passed; centred in registers; ``meta_bits:
8`` is rebuilt in torch first, small), the query in its own dtype and strides, and the mask, if
any, per token: a decode step is two allocations and two launches, with no torch op between.
Split boundaries are token positions: a split may end inside a block.

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
    def _meta(s_ptr, o_ptr, base, offs_t, offs_d, live, D: tl.constexpr, NG: tl.constexpr, MID: tl.constexpr):
        """A per-token block's scale and centred offset as ``[T, D]`` float32 (group ``c // (D / NG)`` of
        token ``t``; ``base`` the block's first element of the ``[B, H, N, G * NG]`` metadata)."""
        at = base + offs_t[:, None] * NG + offs_d[None, :] // (D // NG)
        ok = live[:, None] & (offs_d[None, :] < D)
        sc = tl.load(s_ptr + at, mask=ok, other=0.0).to(tl.float32)
        return sc, tl.load(o_ptr + at, mask=ok, other=0.0).to(tl.float32) + MID * sc

    @triton.jit
    def _query(q_ptr, b, h, offs_m, offs_d, M, L, REP, D: tl.constexpr, qs_b, qs_h, qs_l, qs_d, sm_scale):
        """The query rows of K/V head ``h`` ``[M, D]`` float32, scaled: row ``m`` is query head
        ``h * REP + m // L``, token ``m % L`` (``repeat_kv``'s grouping), read in its dtype and strides."""
        ptr = q_ptr + b * qs_b + (h * REP + offs_m[:, None] // L) * qs_h + (offs_m[:, None] % L) * qs_l + offs_d[None, :] * qs_d
        q = tl.load(ptr, mask=(offs_m[:, None] < M) & (offs_d[None, :] < D), other=0.0)
        return q.to(tl.float32) * sm_scale

    # Integers that change from step to step (token counts, split sizes, strides of exactly sized
    # tensors) are not specialized on (Triton keys a compiled variant on each int's == 1 and % 16):
    # otherwise a decode compiles new variants as the context grows.
    @triton.jit(do_not_specialize=["N", "n_vis", "skip", "chunk", "splits", "kc_sb", "kc_sh", "ks_sb", "ks_sh",
                                   "vc_sb", "vc_sh", "vs_sb", "vs_sh", "mk_sb", "mk_sh", "mk_sm"])
    def _split_kernel(q_ptr, kc_ptr, ks_ptr, ko_ptr, vc_ptr, vs_ptr, vo_ptr, mask_ptr, part_out,
                      H, M, L, REP, N, n_vis, skip, chunk, splits, sm_scale,
                      qs_b, qs_h, qs_l, qs_d, kc_sb, kc_sh, kc_sn, ks_sb, ks_sh, ks_sn, vc_sb, vc_sh, vc_sn,
                      vs_sb, vs_sh, vs_sn, mk_sb, mk_sh, mk_sm, K_EP, V_EP,
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
        K_MID: tl.constexpr = ((1 << K_BITS) - 1) * 0.5
        V_MID: tl.constexpr = ((1 << V_BITS) - 1) * 0.5
        q = _query(q_ptr, b, h, offs_m, offs_dk, M, L, REP, DK, qs_b, qs_h, qs_l, qs_d, sm_scale)  # [M, DK]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        n_lo = (lo + skip) // G
        n_hi = tl.where(hi > lo, (hi + skip - 1) // G + 1, n_lo)
        for n in range(n_lo, n_hi):
            v = n * G + offs_t - skip  # visible token index of each row of the block
            live = (offs_t < G) & (v >= lo) & (v < hi)
            kc = _codes(kc_ptr + b * kc_sb + h * kc_sh + n * kc_sn, offs_t, offs_dk, live, DK, K_EP, K_BITS)
            k_meta = b * ks_sb + h * ks_sh + n * ks_sn  # scale and offset: views of the rows, the model's dtype
            if K_CHANNEL:  # scale folded into the query, offset one q . o term
                dk_ok = offs_dk < DK
                ks = tl.load(ks_ptr + k_meta + offs_dk, mask=dk_ok, other=0.0).to(tl.float32)
                ko = tl.load(ko_ptr + k_meta + offs_dk, mask=dk_ok, other=0.0).to(tl.float32) + K_MID * ks
                s = tl.dot(q * ks[None, :], tl.trans(kc), input_precision="ieee")
                s += tl.sum(q * ko[None, :], axis=1)[:, None]
            else:  # a scale per token and group: scaled in registers
                ks, ko = _meta(ks_ptr, ko_ptr, k_meta, offs_t, offs_dk, live, DK, K_NG, K_MID)
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
            v_meta = b * vs_sb + h * vs_sh + n * vs_sn
            if V_CHANNEL:
                dv_ok = offs_dv < DV
                vs = tl.load(vs_ptr + v_meta + offs_dv, mask=dv_ok, other=0.0).to(tl.float32)
                vo = tl.load(vo_ptr + v_meta + offs_dv, mask=dv_ok, other=0.0).to(tl.float32) + V_MID * vs
                term = tl.dot(p, vc, input_precision="ieee") * vs[None, :] + tl.sum(p, axis=1)[:, None] * vo[None, :]
            else:
                vs, vo = _meta(vs_ptr, vo_ptr, v_meta, offs_t, offs_dv, live, DV, V_NG, V_MID)
                term = tl.dot(p, vc * vs + vo, input_precision="ieee")  # [M, DV]
            acc = acc * alpha[:, None] + term
            m_i = m_new
        row = ((bh * splits + sp) * M + offs_m) * (DV + 2)  # part [B, H, S, M, DV + 2]: values, max, sum
        tl.store(part_out + row[:, None] + offs_dv[None, :], acc, mask=m_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(part_out + row + DV, m_i, mask=m_ok)
        tl.store(part_out + row + DV + 1, l_i, mask=m_ok)

    @triton.jit
    def _exact(q, m_i, l_i, acc, k_ptr, v_ptr, n, col, sb, sh, st, vsb, vsh, vst, b, h, mask_ptr, mk_sb, mk_sh, mk_sm,
               offs_m, M,
               offs_dk, offs_dv, DK: tl.constexpr, DV: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_E: tl.constexpr):
        """One exact segment (``n`` tokens ``[B, H, n, D]`` in the model's dtype, its first column ``col``
        of the mask) folded into the running max, sum and values, ``BLOCK_E`` tokens at a time."""
        offs_e = tl.arange(0, BLOCK_E)
        for e0 in range(0, n, BLOCK_E):
            e_ok = (e0 + offs_e) < n
            at = b * sb + h * sh + (e0 + offs_e[:, None]) * st
            k = tl.load(k_ptr + at + offs_dk[None, :], mask=e_ok[:, None] & (offs_dk[None, :] < DK), other=0.0)
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")  # [M, E]
            if HAS_MASK:
                s += tl.load(mask_ptr + b * mk_sb + h * mk_sh + offs_m[:, None] * mk_sm + col + e0 + offs_e[None, :],
                             mask=(offs_m[:, None] < M) & e_ok[None, :], other=0.0)
            s = tl.where(e_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - base)
            p = tl.exp(s - base[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + b * vsb + h * vsh + (e0 + offs_e[:, None]) * vst + offs_dv[None, :], mask=e_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit(do_not_specialize=["L", "splits", "mk_sb", "mk_sh", "mk_sm",
                                   "n0", "c0", "s0b", "s0h", "s0t", "v0b", "v0h", "v0t",
                                   "n1", "c1", "s1b", "s1h", "s1t", "v1b", "v1h", "v1t",
                                   "n2", "c2", "s2b", "s2h", "s2t", "v2b", "v2h", "v2t"])
    def _merge_kernel(q_ptr, part_ptr, mask_ptr, out_ptr,
                      e0k_ptr, e0v_ptr, e1k_ptr, e1v_ptr, e2k_ptr, e2v_ptr,
                      H, M, L, REP, splits, sm_scale, qs_b, qs_h, qs_l, qs_d, os_b, os_h, os_l, mk_sb, mk_sh, mk_sm,
                      n0, c0, s0b, s0h, s0t, v0b, v0h, v0t, n1, c1, s1b, s1h, s1t, v1b, v1h, v1t,
                      n2, c2, s2b, s2h, s2t, v2b, v2h, v2t,
                      DK: tl.constexpr, DV: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
        """flash-decoding's reduce and the exact tokens in one program per (batch x K/V head): the
        splits' partials (max, sum, values), then up to three exact segments (sinks, residual, new
        tokens; ``n_i = 0`` for an absent one) under one online softmax; writes ``[B, Hq, L, Dv]``."""
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        offs_m = tl.arange(0, BLOCK_M)
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        m_ok = offs_m < M
        dv_ok = offs_dv < DV
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for sp in range(0, splits):
            row = ((bh * splits + sp) * M + offs_m) * (DV + 2)
            m_s = tl.load(part_ptr + row + DV, mask=m_ok, other=float("-inf"))
            l_s = tl.load(part_ptr + row + DV + 1, mask=m_ok, other=0.0)
            a_s = tl.load(part_ptr + row[:, None] + offs_dv[None, :], mask=m_ok[:, None] & dv_ok[None, :], other=0.0)
            m_new = tl.maximum(m_i, m_s)
            base = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - base)
            beta = tl.exp(m_s - base)
            l_i = l_i * alpha + l_s * beta
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            m_i = m_new
        q = _query(q_ptr, b, h, offs_m, offs_dk, M, L, REP, DK, qs_b, qs_h, qs_l, qs_d, sm_scale)
        m_i, l_i, acc = _exact(q, m_i, l_i, acc, e0k_ptr, e0v_ptr, n0, c0, s0b, s0h, s0t, v0b, v0h, v0t, b, h, mask_ptr, mk_sb, mk_sh,
                               mk_sm, offs_m, M, offs_dk, offs_dv, DK, DV, HAS_MASK, BLOCK_E)
        m_i, l_i, acc = _exact(q, m_i, l_i, acc, e1k_ptr, e1v_ptr, n1, c1, s1b, s1h, s1t, v1b, v1h, v1t, b, h, mask_ptr, mk_sb, mk_sh,
                               mk_sm, offs_m, M, offs_dk, offs_dv, DK, DV, HAS_MASK, BLOCK_E)
        m_i, l_i, acc = _exact(q, m_i, l_i, acc, e2k_ptr, e2v_ptr, n2, c2, s2b, s2h, s2t, v2b, v2h, v2t, b, h, mask_ptr, mk_sb, mk_sh,
                               mk_sm, offs_m, M, offs_dk, offs_dv, DK, DV, HAS_MASK, BLOCK_E)
        out = acc / l_i[:, None]
        ptr = out_ptr + b * os_b + (h * REP + offs_m[:, None] // L) * os_h + (offs_m[:, None] % L) * os_l + offs_dv[None, :]
        tl.store(ptr, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & dv_ok[None, :])


# One software-pipeline stage: the default three buffer every load in shared memory, about 180 KB a
# program at head dim 128 and 64-token blocks (over an A100's 164 KB); one needs about 45 KB
# (checked by compiling for sm_80 / sm_90 in the tests). FP fusion: triton's default, said (3.9
# warns when it is left unset). Swept on an H200 (bench/tune_packed_triton.py: 2-16 programs per SM,
# 2-8 warps, 1-3 stages at 4k and 32k): every setting within 3% of this one, so it stays.
LAUNCH = {"num_warps": 4, "num_stages": 1, "enable_fp_fusion": True}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(x: int) -> int:
    return max(16, triton.next_power_of_2(x))


def _default_splits(bh: int, n_vis: int, g: int, device: torch.device) -> int:
    """About two programs per SM over the GPU (four SMs assumed elsewhere), each split at least
    four blocks (a program's step is one block); the caller rounds splits to whole blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(_cdiv(2 * sms, bh), _cdiv(n_vis, 4 * g)))


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def attend(query, scale: float, keys, values, exact, at_blocks: int, skip: int, mask,
           splits: int | None = None) -> torch.Tensor:
    """Two launches and two allocations: the split kernel writes each split's partials, the merge
    kernel folds them and the exact segments into the output (``packed_cpu.attend``'s interface;
    ``splits`` as in the module docstring)."""
    (kc, ks, ko, kcodec), (vc, vs, vo, vcodec) = keys, values
    b, h, n, _ = kc.shape
    hq, length = query.shape[1], query.shape[2]
    rep = hq // h
    g, m, dk, dv = kcodec.g, rep * length, kcodec.d, vcodec.d
    n_vis = n * g - skip
    if kc.stride(-1) != 1:
        kc = kc.contiguous()
    if vc.stride(-1) != 1:
        vc = vc.contiguous()
    if len(exact) > 3:
        raise ValueError(f"packed attention (Triton): at most 3 exact segments (sinks, residual, new), got {len(exact)}")
    if splits is None:
        chunk = _cdiv(_cdiv(n_vis, _default_splits(b * h, n_vis, g, query.device)), g) * g  # whole blocks
    else:
        chunk = _cdiv(n_vis, splits)  # a boundary may fall inside a block
    splits = _cdiv(n_vis, chunk)  # [lo, hi) = [i * chunk, min((i + 1) * chunk, n_vis)): none empty
    before = sum(k.shape[2] for k, _ in exact[:at_blocks])  # the packed tokens' first column in the mask
    part = torch.empty((b, h, splits, m, dv + 2), dtype=torch.float32, device=query.device)  # values, max, sum
    out = torch.empty((b, hq, length, dv), dtype=query.dtype, device=query.device)  # [B, Hq, L, Dv]
    part_mask, mk_strides = (part, (0, 0, 0)) if mask is None else (mask[..., before:], mask.stride()[:3])
    qs = query.stride()
    _split_kernel[(b * h, splits)](
        query, kc, ks, ko, vc, vs, vo, part_mask, part,
        h, m, length, rep, n, n_vis, skip, chunk, splits, scale, *qs,
        *_strides3(kc), *_strides3(ks), *_strides3(vc), *_strides3(vs), *mk_strides,
        _cdiv(g * dk, 8 // kcodec.backend.bits), _cdiv(g * dv, 8 // vcodec.backend.bits),  # bytes a plane
        G=g, DK=dk, DV=dv, K_BITS=kcodec.backend.bits, V_BITS=vcodec.backend.bits,
        K_NG=1 if kcodec.axis == "channel" else kcodec.shape[1], V_NG=1 if vcodec.axis == "channel" else vcodec.shape[1],
        K_CHANNEL=kcodec.axis == "channel", V_CHANNEL=vcodec.axis == "channel", HAS_MASK=mask is not None,
        BLOCK_M=_pow2(m), BLOCK_T=_pow2(g), BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), **LAUNCH)
    ptrs, ints, col = [], [], 0  # each exact segment's (k, v) and (tokens, first mask column, k / v strides)
    for i, (k, v) in enumerate(exact):
        col += n_vis if i == at_blocks else 0
        ptrs += [k, v]
        ints += [k.shape[2], col, *_strides3(k), *_strides3(v)]
        col += k.shape[2]
    while len(ptrs) < 6:  # three slots (sinks, residual, new tokens): an absent one has no tokens, never read
        ptrs += [part, part]
        ints += [0] * 8
    longest = max((k.shape[2] for k, _ in exact), default=1)
    _merge_kernel[(b * h,)](
        query, part, part if mask is None else mask, out, *ptrs,
        h, m, length, rep, splits, scale, *qs, *out.stride()[:3], *((0, 0, 0) if mask is None else mask.stride()[:3]),
        *ints,
        DK=dk, DV=dv, HAS_MASK=mask is not None, BLOCK_M=_pow2(m), BLOCK_E=min(64, _pow2(longest)),
        BLOCK_DK=_pow2(dk), BLOCK_DV=_pow2(dv), **LAUNCH)
    return out
