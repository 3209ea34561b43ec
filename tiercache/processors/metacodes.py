"""8-bit metadata (``meta_bits: 8``): each group's scale and offset as one byte each.

A packed block row normally stores one scale and one offset per group in the model dtype: for
groups of 64 that is 0.5 bits per element in bf16 (1 in fp32), a fifth of an int2 row. Here
they are bytes on grids of the row's own (one block of one head):

- offsets on a linear grid ``o0 + w * o_step`` (``w`` in 0..255), each rounded *down*, so the
  group's minimum stays inside its range;
- scales on a log grid ``2 ** (l0 + u * l_step)``, each the first grid point *at or above* what
  the group needs from its rounded offset to its maximum, so the maximum stays inside too.

Nothing is clipped by the rounding: a group's range only widens, its step by at most one log
step (``l_step`` = the row's spread of log2 scales / 255: 0.3% for 1 octave, 2.7% for 10) plus
the offset's rounding (``o_step`` over the group's span). The four grid numbers ``(o0, o_step,
l0, l_step)`` are stored in the model dtype, rounded in the safe direction before the bytes are
computed, so decoding rebuilds exactly the scales and offsets the codes were computed with.

Interface
    RANGES (from ``codec``)                     grid numbers per row (``codec.row_layout`` counts them)
    cover(lo, hi, bits, dtype) -> (scale, offset, ranges, codes)
        ``lo`` / ``hi`` ``[..., groups]`` float32: each group's wanted range (min/max, or a
        searched one). ``scale`` / ``offset`` ``[..., groups]`` float32, on the grids and rounded
        to ``dtype`` (scales up, offsets down: compute the element codes with these); ``ranges`` ``[..., 4]`` in
        ``dtype``; ``codes`` ``[..., 2 * groups]`` uint8 (scale bytes, then offset bytes).
    expand(ranges, codes) -> (scale, offset)    the inverse, ``[..., groups]`` float32
"""

from __future__ import annotations

import torch

from tiercache.processors.codec import RANGES

STEPS = 255  # grid points 0..255
SPAN_OCTAVES = 12  # a group's scale is at least the row's largest / 2**12 (constant groups: no log of 0)


def _round_dtype(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype``, toward +inf (``up``) or -inf, back as float32."""
    r = x.to(dtype)
    wrong = r.float() < x if up else r.float() > x
    step = torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf")))
    return torch.where(wrong, step, r).float()


def _offsets(lo: torch.Tensor, dtype: torch.dtype):
    o0 = _round_dtype(lo.amin(-1, keepdim=True), dtype, up=False)  # [..., 1]
    step = _round_dtype((lo.amax(-1, keepdim=True) - o0) / STEPS, dtype, up=True)
    step = torch.where(step > 0, step, torch.ones_like(step))  # one offset for the whole row
    w = ((lo - o0) / step).floor_().clamp_(0, STEPS)
    return o0, step, w


def _scales(need: torch.Tensor, dtype: torch.dtype):
    top = need.amax(-1, keepdim=True)
    floor = torch.where(top > 0, top * 2.0**-SPAN_OCTAVES, torch.ones_like(top))
    logs = need.maximum(floor).log2()  # [..., groups]
    l0 = _round_dtype(logs.amin(-1, keepdim=True), dtype, up=True)
    step = _round_dtype((logs.amax(-1, keepdim=True) - l0).clamp_min(0) / STEPS, dtype, up=True)
    step = torch.where(step > 0, step, torch.ones_like(step))
    u = ((logs - l0) / step).ceil_().clamp_(0, STEPS)
    return l0, step, u


def _values(o0, o_step, w, l0, l_step, u, dtype):
    """The grids' points in ``dtype``: offsets rounded down and scales up (the range only widens)."""
    return _round_dtype(torch.exp2(l0 + u * l_step), dtype, up=True), _round_dtype(o0 + w * o_step, dtype, up=False)


def cover(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype: torch.dtype):
    lo, hi = lo.float(), hi.float()
    o0, o_step, w = _offsets(lo, dtype)
    offset = _round_dtype(o0 + w * o_step, dtype, up=False)
    need = (hi - offset) / (2**bits - 1)  # the scale that reaches the group's max from its rounded offset
    l0, l_step, u = _scales(need, dtype)
    scale, offset = _values(o0, o_step, w, l0, l_step, u, dtype)
    ranges = torch.cat([o0, o_step, l0, l_step], -1).to(dtype)  # [..., 4]
    codes = torch.cat([u, w], -1).to(torch.uint8)  # [..., 2 * groups]
    return scale, offset, ranges, codes


def expand(ranges: torch.Tensor, codes: torch.Tensor):
    r = ranges.float()
    o0, o_step, l0, l_step = (r[..., i : i + 1] for i in range(RANGES))
    groups = codes.shape[-1] // 2
    u, w = codes[..., :groups].float(), codes[..., groups:].float()
    return _values(o0, o_step, w, l0, l_step, u, ranges.dtype)
