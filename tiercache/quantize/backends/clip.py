"""Clipping search: a per-group range chosen to minimise the squared reconstruction error.

Interface
    search_affine(x, dim, bits, dtype) -> (scale, offset)
        like ``native.minmax_affine`` (groups run along ``dim``; both float32 with ``dim`` of
        size 1, rounded to ``dtype`` first, so codes fit the stored metadata exactly), but each
        group's range is the best of a fixed set of candidates.
    group_error(x, dim, bits, scale, offset) -> err
        squared error of ``x`` reconstructed from its codes, per group (``dim`` of size 1).

Candidates: the min/max range itself (always first), the range shrunk toward its middle (90% ...
50%), shrunk from the low or the high end alone (10% ... 40%: one-sided outliers), and a
least-squares refit of ``(scale, offset)`` to the codes of the best so far (the affine fit
``x ~ codes * scale + offset``, then codes recomputed). A candidate replaces the current one
only where its error is strictly smaller, so a group's error is never above min/max's (the
invariant the tests check). Codes beyond a shrunk range saturate at ``0`` or ``2**bits - 1``.

Cost: one pass over the group per candidate (15), paid once per block when it is packed (the
incremental rule: a block is quantized once); decoding is unchanged (same row format).
"""

from __future__ import annotations

import torch

SYMMETRIC = (0.9, 0.8, 0.7, 0.6, 0.5)  # range kept, shrunk toward its middle
ONE_SIDED = (0.1, 0.2, 0.3, 0.4)  # fraction of the range cut from one end


def rounded(scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype):
    """``(scale, offset)`` rounded to ``dtype``, in float32; a zero scale (a constant group) becomes 1."""
    scale = scale.to(dtype).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: codes 0, exact
    return scale, offset.to(dtype).float()


def group_error(x: torch.Tensor, dim: int, bits: int, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    codes = ((xf - offset) / scale).round_().clamp_(0, 2**bits - 1)
    return (codes.mul_(scale).add_(offset).sub_(xf)).square_().sum(dim=dim, keepdim=True)


def search_affine(x: torch.Tensor, dim: int, bits: int, dtype: torch.dtype):
    xf = x.float()
    top = 2**bits - 1
    lo, hi = xf.amin(dim=dim, keepdim=True), xf.amax(dim=dim, keepdim=True)
    span = hi - lo
    best = rounded(span / top, lo, dtype)  # min/max first: never worse than it
    err = group_error(xf, dim, bits, *best)
    mid = (lo + hi) / 2
    ranges = [(mid - c * span / 2, mid + c * span / 2) for c in SYMMETRIC]
    ranges += [(lo + f * span, hi) for f in ONE_SIDED] + [(lo, hi - f * span) for f in ONE_SIDED]
    for a, b in ranges:
        cand = rounded((b - a) / top, a, dtype)
        best, err = _keep_better(xf, dim, bits, best, err, cand)
    return _keep_better(xf, dim, bits, best, err, _refit(xf, dim, bits, *best, dtype))[0]


def _keep_better(xf, dim, bits, best, err, cand):
    cand_err = group_error(xf, dim, bits, *cand)
    better = cand_err < err
    return tuple(torch.where(better, c, b) for c, b in zip(cand, best)), torch.where(better, cand_err, err)


def _refit(xf, dim, bits, scale, offset, dtype):
    """Least-squares ``(scale, offset)`` for the codes of ``(scale, offset)``: x ~ q * s + o."""
    q = ((xf - offset) / scale).round_().clamp_(0, 2**bits - 1)
    n = xf.shape[dim]
    sq, sx = q.sum(dim, keepdim=True), xf.sum(dim, keepdim=True)
    sqq, sqx = (q * q).sum(dim, keepdim=True), (q * xf).sum(dim, keepdim=True)
    det = n * sqq - sq * sq
    ok = det > 0
    s = torch.where(ok, (n * sqx - sq * sx) / torch.where(ok, det, torch.ones_like(det)), scale)
    o = torch.where(ok, (sx - s * sq) / n, offset)
    s = torch.where(s > 0, s, scale)
    return rounded(s, o, dtype)
