"""8-bit metadata (``meta_bits: 8``): each group's scale and offset as one byte each.

A packed block row normally stores one scale and one offset per group in the model dtype: for
groups of 64 that is 0.5 bits per element in bf16 (1 in fp32), a fifth of an int2 row. Here
they are bytes on two linear 256-point grids of the row's own (one block of one head), each
held as a base and a step in the model dtype:

- offsets ``o0 + w * o_step``: each the last grid point *at or below* the group's minimum, so
  the minimum stays inside its range;
- scales ``s0 + u * s_step``: each the first grid point *at or above* what the group needs from
  its offset to its maximum, so the maximum stays inside too.

So nothing is clipped by the rounding: a group's range only widens, by at most one offset step
and ``levels`` scale steps (1/255 of the row's spread of offsets, and of scales). "At or below"
and "at or above" hold for the points as decoding rebuilds them (rounded to the model dtype: one
grid point further where that rounding crossed; where a grid step is finer than the dtype
resolves, within the dtype's rounding, as dtype metadata is). ``cover`` takes the points from
``expand``, the function decoding runs, so the codes fit what decoding rebuilds exactly.

Why linear scales, not log-spaced: on SmolLM2-135M's keys and values (1024 tokens of prose,
groups of 64) the two grids cost the same (+0.9% / +0.4% RMS error for keys / values over dtype
metadata, at 2 and 4 bits), and a linear grid rebuilds both halves in one fused multiply-add
over the bytes, which runs at every decode step (no ``exp2``); a constant group's scale of 0 also
needs no special case.

Interface
    RANGES (from ``codec``)                     grid numbers per row (``codec.row_layout`` counts them)
    cover(lo, hi, bits, dtype) -> (scale, offset, ranges, codes)
        ``lo`` / ``hi`` ``[..., groups]`` float32: each group's wanted range (min/max, or a
        searched one). ``scale`` / ``offset`` ``[..., groups]`` float32, the points as decoding
        rebuilds them (compute the element codes with these; a scale may be 0 where the group
        is constant); ``ranges`` ``[..., 4]`` in ``dtype`` (``o0, o_step, s0, s_step``);
        ``codes`` ``[..., 2 * groups]`` uint8 (offset bytes, then scale bytes).
    expand(ranges, codes) -> (scale, offset)    the inverse, ``[..., groups]`` in the dtype of
        ``ranges``: ``rebuild(operands(ranges, codes, (groups,)))``, the decoder's very arithmetic
    operands(ranges, codes, shape) -> (base, codes, step, axis)
        views of a row's parts shaped so that ``rebuild`` yields ``[..., *shape]`` directly
        (``shape``: how a decoder broadcasts one block's groups); made once per rows and kept
    rebuild(operands) -> (scale, offset)        ``expand``'s very arithmetic on those views: one
        ``addcmul`` and two ``select`` per decode, no reshapes
"""

from __future__ import annotations

import torch

from tiercache.quantize.codec import RANGES

STEPS = 255  # grid points 0..255


def _round_dtype(x: torch.Tensor, dtype: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) rounded to ``dtype``, toward +inf (``up``) or -inf, back as float32."""
    r = x.to(dtype)
    wrong = r.float() < x if up else r.float() > x
    step = torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf")))
    return torch.where(wrong, step, r).float()


def _grid(values: torch.Tensor, dtype: torch.dtype, up: bool):
    """A grid spanning ``values`` ``[..., groups]``: base and step ``[..., 1]`` exact in ``dtype``,
    and each value's point index (the first at or above it if ``up``, else the last at or below)."""
    base = _round_dtype(values.amin(-1, keepdim=True), dtype, up=up)
    step = _round_dtype((values.amax(-1, keepdim=True) - base).clamp_min(0) / STEPS, dtype, up=True)
    step = torch.where(step > 0, step, torch.ones_like(step))  # all values equal: one point
    k = (values - base) / step
    return base, step, (k.ceil_() if up else k.floor_()).clamp_(0, STEPS)


def cover(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype: torch.dtype):
    lo, hi = lo.float(), hi.float()
    levels = 2**bits - 1
    o0, o_step, w = _grid(lo, dtype, up=False)
    zeros = torch.zeros_like(w)  # the offsets alone first: a placeholder scale grid, its half unused
    offset = _points(o0, o_step, w, o0, o_step, zeros, dtype)[1]
    w = torch.where((offset > lo) & (w > 0), w - 1, w)  # the dtype rounded a point above lo: one lower
    offset = _points(o0, o_step, w, o0, o_step, zeros, dtype)[1]
    need = (hi - offset) / levels  # the scale that reaches the group's max from its offset
    s0, s_step, u = _grid(need, dtype, up=True)
    scale = _points(o0, o_step, w, s0, s_step, u, dtype)[0]
    u = torch.where((offset + scale * levels < hi) & (u < STEPS), u + 1, u)  # rounded below: one higher
    ranges = torch.cat([o0, o_step, s0, s_step], -1).to(dtype)  # [..., 4]: exact (rounded above)
    codes = torch.cat([w, u], -1).to(torch.uint8)  # [..., 2 * groups]: offset bytes, then scale bytes
    scale, offset = expand(ranges, codes)
    return scale.float(), offset.float(), ranges, codes


def _points(o0, o_step, w, s0, s_step, u, dtype):
    """(scale, offset) float32 as ``expand`` rebuilds them from these grid numbers and indices."""
    scale, offset = expand(torch.cat([o0, o_step, s0, s_step], -1).to(dtype), torch.cat([w, u], -1).to(torch.uint8))
    return scale.float(), offset.float()


def operands(ranges: torch.Tensor, codes: torch.Tensor, shape: tuple[int, ...]):
    lead = ranges.shape[:-1]
    r = ranges.view(*lead, 2, *[1] * (len(shape) - 1), RANGES // 2)  # [..., 2, 1.., 2]: (base, step) of each grid
    return r[..., :1], codes.view(*lead, 2, *shape), r[..., 1:], -1 - len(shape)  # base, bytes, step, the "2" axis


def rebuild(operands):
    base, codes, step, axis = operands
    points = torch.addcmul(base, codes, step)  # [..., 2, *shape] in the dtype: offsets, then scales
    return points.select(axis, 1), points.select(axis, 0)


def expand(ranges: torch.Tensor, codes: torch.Tensor):
    return rebuild(operands(ranges, codes, (codes.shape[-1] // 2,)))  # [..., groups] each
