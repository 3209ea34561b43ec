"""Decode attention read straight from a quantized layer's packed blocks (no dequantized K/V).

    Packed(sinks, blocks, skip, tail, codecs)
        what one decode step of a ``Quantize`` layer attends over, its tokens in order: the
        attention sinks ``(k, v)`` ``[B, H, s, D]`` or None, the packed rows ``(keys, values)``
        ``[B, H, N, row]`` or None (the first ``skip`` tokens of the first block not visible: a
        sliding window's tail), then the exact tail, a list of ``(k, v)`` ``[B, H, r, D]`` (the
        residual, then the update's new tokens). ``length``: the tokens it stands for.
    attend(query, packed, mask=None, scale=None) -> [B, Hq, L, Dv]
        ``scaled_dot_product_attention(query, K, V, mask, scale=scale, enable_gqa=True)`` over
        the K/V the layer would have dequantized, computed from the codes: ``query`` ``[B, Hq,
        L, D]`` (``Hq`` a multiple of the layer's heads, grouped as ``repeat_kv`` does), ``mask``
        broadcastable to ``[B, Hq, L, S]`` (bool: True attends; float: added). Float32 inside.
    key_scores(q, rows, codec, out, skip) / value_mix(p, rows, codec, skip)
        the packed part alone (the fast kernel where it has the layout, else the torch reference)

The math (KIVI's). A key block quantized per channel is ``K[t, c] = code[t, c] *
s[c] + o[c]``, so ``q . K[t] = (q * s) . code[t] + q . o``: the scale is folded into the query
and the offset into one term per block. Per token (``axis: token``, groups of ``g`` channels):
``q . K[t] = sum_j s[t, j] (q_j . code[t, j]) + sum_j o[t, j] sum(q_j)``. Values per token:
``sum_t p[t] V[t] = sum_t (p[t] s[t, j]) code[t, j] + sum_t p[t] o[t, j]`` (per channel the
same with ``s[c]``, ``o[c]`` per block). The scores of the sinks, the packed blocks and the exact
tail are softmaxed together, then each part's values are mixed by its weights. ``key_gain`` is
in the keys' scale and offset already (``blocks.BlockCodec``); fp8 has no offset term;
``meta_bits: 8`` rebuilds the scale and offset per group first (``metacodes.rebuild``: small).

Kernels. ``key_scores`` / ``value_mix`` here are pure torch over all blocks at once: the
reference, any layout (int2/4/8, fp8, either axis, meta8). On CUDA, ``packed_triton`` (a
Triton split-K kernel, when triton imports) takes integer codes of any axis. ``packed_cpu`` is a small C++
extension (built ahead by ``tiercache build-kernels``, ``kernel_build``) for the common CPU layouts (integer codes, keys
per channel, values per token): it reads each packed byte once and never writes the codes out
as floats. Where it is missing (not built, ``TIERCACHE_PACKED_KERNEL=torch``, another layout
or device) the torch reference runs: the same results within float rounding.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from tiercache.quantize import metacodes

__all__ = ["Packed", "attend", "key_scores", "value_mix"]


@dataclass
class Packed:
    sinks: tuple[torch.Tensor, torch.Tensor] | None  # [B, H, s, D] each, exact
    blocks: tuple[torch.Tensor, torch.Tensor] | None  # [B, H, N, row] uint8 each, on the compute device
    skip: int  # leading tokens of the first block not visible (sliding)
    tail: list  # [(k, v)] [B, H, r, D], exact: the residual, then the new tokens
    codecs: tuple  # (BlockCodec, BlockCodec)

    @property
    def length(self) -> int:
        n = 0 if self.blocks is None else self.blocks[0].shape[2] * self.codecs[0].g - self.skip
        exact = [*([self.sinks] if self.sinks is not None else []), *self.tail]
        return n + sum(k.shape[2] for k, _ in exact)


def _parts(rows: torch.Tensor, codec):
    """(codes, scale, offset) of ``rows``: scale / offset float32 in the codec's ``meta_shape``
    (``[B, H, N, 1, D]`` per channel, ``[B, H, N, G, n, 1]`` per token); offset None for fp8."""
    codes, scale, offset = raw_parts(rows, codec)
    return codes, scale.float(), None if offset is None else offset.float()


def raw_parts(rows: torch.Tensor, codec):
    """(codes, scale, offset) of ``rows`` as the fast kernels read them: views of the rows in the
    model's dtype (``codec._parts``, remembered across steps: no op when the rows did not move), the
    ``meta_bits: 8`` grids rebuilt (in the model's dtype). No float32 copy: the kernels convert."""
    codes, scale, offset = codec._parts(rows)
    if codec.meta8:
        scale, offset = metacodes.rebuild(scale)
    return codes, scale, offset


def _centred(rows: torch.Tensor, codec):
    """(codes, scale, offset) with the codes centred, ``code - mid`` (``mid = (2**bits - 1) / 2``)
    as float32 ``[B, H, N, *codec.shape]`` (the reference's one temporary), the offset taking the
    rest (``offset + mid * scale``): the two terms of a score or a value then do not cancel, which
    keeps float32 sums over long contexts as exact as dequantize-then-SDPA's."""
    codes, scale, offset = _parts(rows, codec)
    b, h, n, _ = codes.shape
    out = torch.empty((b, h, n, *codec.shape), dtype=torch.float32, device=codes.device)
    codec._unpack_into(codes, out)
    if offset is not None:
        mid = (2**codec.backend.bits - 1) / 2
        out.sub_(mid)
        offset = offset + mid * scale
    return out, scale, offset


def key_scores_torch(q: torch.Tensor, rows: torch.Tensor, codec) -> torch.Tensor:
    """``q`` ``[B, H, M, D]`` float32 (softmax scale applied) . every packed key: ``[B, H, M, N*G]``."""
    b, h, m, _ = q.shape
    n = rows.shape[2]
    c, scale, offset = _centred(rows, codec)
    if codec.axis == "channel":  # c [B, H, N, G, D]; scale, offset [B, H, N, 1, D]
        qn = q.unsqueeze(2)  # [B, H, 1, M, D]
        s = torch.matmul(c, (qn * scale).transpose(-1, -2))  # [B, H, N, G, M]
        if offset is not None:
            s = s + (qn * offset).sum(-1).unsqueeze(-2)  # + q . o per block
    else:  # c [B, H, N, G, ng, g]; scale, offset [B, H, N, G, ng, 1]
        ng, g = c.shape[-2], c.shape[-1]
        qg = q.view(b, h, m, ng, g)
        part = torch.einsum("bhntjc,bhmjc->bhntmj", c, qg)  # [B, H, N, G, M, ng]
        s = (part * scale.squeeze(-1).unsqueeze(-2)).sum(-1)  # [B, H, N, G, M]
        if offset is not None:
            s = s + torch.einsum("bhntj,bhmj->bhntm", offset.squeeze(-1), qg.sum(-1))
    return s.permute(0, 1, 4, 2, 3).reshape(b, h, m, n * codec.g)


def value_mix_torch(p: torch.Tensor, rows: torch.Tensor, codec) -> torch.Tensor:
    """Softmax weights ``p`` ``[B, H, M, N*G]`` float32 over every packed value: ``[B, H, M, Dv]``."""
    b, h, m, _ = p.shape
    n = rows.shape[2]
    c, scale, offset = _centred(rows, codec)
    pb = p.view(b, h, m, n, codec.g)  # [B, H, M, N, G]
    if codec.axis == "channel":  # c [B, H, N, G, D]; scale, offset [B, H, N, 1, D]
        part = torch.einsum("bhmnt,bhntd->bhnmd", pb, c)  # [B, H, N, M, D]
        out = (part * scale).sum(2)
        if offset is not None:
            out = out + torch.einsum("bhmn,bhnd->bhmd", pb.sum(-1), offset.squeeze(-2))
        return out
    ng, g = c.shape[-2], c.shape[-1]  # c [B, H, N, G, ng, g]; scale, offset [B, H, N, G, ng, 1]
    w = pb.unsqueeze(-1) * scale.squeeze(-1).unsqueeze(2)  # [B, H, M, N, G, ng]
    out = torch.einsum("bhmntj,bhntjc->bhmjc", w, c)  # [B, H, M, ng, g]
    if offset is not None:
        out = out + torch.einsum("bhmnt,bhntj->bhmj", pb, offset.squeeze(-1)).unsqueeze(-1)
    return out.reshape(b, h, m, ng * g)


def _fast(device: torch.device | None = None):
    """The whole-attention kernel for ``device`` (the one place it is chosen): Triton on CUDA
    where it imports (``packed_triton``), else the C++ CPU one (``packed_cpu``); each says by
    ``handles`` which layouts it takes, and the torch reference does the rest."""
    if device is not None and device.type == "cuda":
        from tiercache.quantize import packed_triton

        if packed_triton.available():
            return packed_triton
    from tiercache.quantize import packed_cpu

    return packed_cpu


def key_scores(q: torch.Tensor, rows: torch.Tensor, codec, out: torch.Tensor, skip: int = 0) -> None:
    """Writes ``out`` ``[B, H, M, N*G - skip]``: the scores of the visible packed keys."""
    fast = _fast()
    if fast.handles(codec, rows, "keys"):
        fast.key_scores(q, *raw_parts(rows, codec), codec, out, skip)
    else:
        out.copy_(key_scores_torch(q, rows, codec)[..., skip:])


def value_mix(p: torch.Tensor, rows: torch.Tensor, codec, skip: int = 0) -> torch.Tensor:
    """``p`` ``[B, H, M, N*G - skip]``: the weights of the visible packed tokens -> ``[B, H, M, Dv]``."""
    fast = _fast()
    if fast.handles(codec, rows, "values"):
        return fast.value_mix(p, *raw_parts(rows, codec), codec, skip)
    return value_mix_torch(torch.nn.functional.pad(p, (skip, 0)), rows, codec)  # hidden tokens weigh 0


def _unit(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last stride (what the kernels index by): itself, almost always."""
    return t if t.stride(-1) == 1 else t.contiguous()


_SCRATCH = threading.local()


def _scratch(shape, device: torch.device) -> torch.Tensor:
    """A float32 buffer of ``shape``, reused across calls (per thread and device): the scores of
    a long context are a few hundred KB, and a fresh allocation of that size is a fresh mapping
    whose page faults cost more than the softmax."""
    need = math.prod(shape)
    bufs = getattr(_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _SCRATCH.bufs = {}
    buf = bufs.get(device)
    if buf is None or buf.numel() < need:
        buf = bufs[device] = torch.empty(max(need, 2 * (0 if buf is None else buf.numel())), device=device)
    return buf[:need].view(shape)


@torch.no_grad()
def attend(query: torch.Tensor, packed: Packed, mask: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    b, hq, length, d = query.shape
    segments = [*([packed.sinks] if packed.sinks is not None else []),  # token order: sinks, blocks, tail
                *([None] if packed.blocks is not None else []), *packed.tail]  # None: the packed blocks
    hkv = (packed.blocks[0] if packed.blocks is not None else segments[0][0]).shape[1]
    if hq % hkv:
        raise ValueError(f"packed attention: query heads {hq} are not a multiple of the layer's {hkv} heads")
    rep = hq // hkv
    scale = d**-0.5 if scale is None else scale
    fast = _fast(query.device)
    if packed.blocks is not None and all(fast.handles(c, r, w) for c, r, w in zip(packed.codecs, packed.blocks,
                                                                                     ("keys", "values"))):
        # the fast path issues as few ops as it can (each one a launch on a GPU): the kernel reads the
        # query, the rows' scales and offsets and the exact K/V in their own dtype and strides
        exact = [(_unit(seg[0]), _unit(seg[1])) for seg in segments if seg is not None]
        if mask is not None:
            mask = mask.expand(b, hq, length, packed.length).reshape(b, hkv, rep * length, packed.length)
            mask = (torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool
                    else mask.float().contiguous())
        parts = [(*raw_parts(r if r.device == query.device else r.to(query.device), c), c)
                 for r, c in zip(packed.blocks, packed.codecs)]
        return fast.attend(query, scale, parts[0], parts[1], exact, segments.index(None), packed.skip, mask)
    q = (query.float() * scale).reshape(b, hkv, rep * length, d)  # [B, Hkv, M, D], heads grouped as repeat_kv
    sizes = [packed.blocks[0].shape[2] * packed.codecs[0].g - packed.skip if seg is None else seg[0].shape[2]
             for seg in segments]
    scores = _scratch((b, hkv, rep * length, sum(sizes)), query.device)  # [B, Hkv, M, S]
    at = 0
    for seg, n in zip(segments, sizes):
        part = scores.narrow(-1, at, n)
        if seg is None:
            key_scores(q, packed.blocks[0].to(query.device), packed.codecs[0], part, packed.skip)
        else:
            part.copy_(torch.matmul(q, seg[0].float().transpose(-1, -2)))
        at += n
    if mask is not None:
        mask = mask.expand(b, hq, length, scores.shape[-1]).reshape(b, hkv, rep * length, -1)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # the softmax, in place
    scores.div_(scores.sum(-1, keepdim=True))
    out, at = None, 0
    for seg, n in zip(segments, sizes):
        w = scores.narrow(-1, at, n)
        if seg is None:
            term = value_mix(w, packed.blocks[1].to(query.device), packed.codecs[1], packed.skip)
        else:
            term = torch.matmul(w, seg[1].float())  # [B, Hkv, M, Dv]
        out = term if out is None else out.add_(term)
        at += n
    dv = out.shape[-1]
    return out.view(b, hkv, rep, length, dv).reshape(b, hq, length, dv).to(query.dtype)
