"""``native`` backend: pure torch, no compiled extension, deterministic.

Integer formats (``bits`` 2, 4, 8): asymmetric min-max per group, ``scale = (max - min) /
(2**bits - 1)``, ``offset = min``, codes ``round((x - offset) / scale)`` in ``[0, 2**bits)``.
Scale and offset are rounded to the model dtype *before* the codes are computed, so the codes
fit the stored metadata exactly. ``clip: mse`` chooses each group's range by a search for the
least squared error instead (``backends/clip.py``; never worse than min/max); ``mse-values`` /
``mse-keys`` search for that tensor only (``for_tensor``), the other keeping min/max. ``format: fp8`` (``bits: 8``): e4m3 codes with a symmetric
per-group scale ``absmax / 448`` and no offset.

``bounds(x, dim)`` (each group's wanted range) and ``codes(x, scale, offset)`` are the two halves
of ``quantize`` for ``meta_bits: 8``, where ``quantize/metacodes.py`` widens the range onto the
row's byte grids between them.
"""

from __future__ import annotations

import torch

from tiercache.quantize.backends.clip import rounded, search_affine

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def minmax_affine(x: torch.Tensor, dim: int, bits: int, dtype: torch.dtype):
    """Min-max ``(scale, offset)`` per group along ``dim``, rounded to ``dtype``, returned in float32."""
    lo = x.amin(dim=dim, keepdim=True).float()
    hi = x.amax(dim=dim, keepdim=True).float()
    return rounded((hi - lo) / (2**bits - 1), lo, dtype)


class Native:
    code_dtype = torch.uint8

    def __init__(self, bits: int, fp8: bool = False, clip: str = "minmax"):
        self.bits, self.clip = bits, clip
        self.fp8 = fp8
        self.has_offset = not fp8
        if fp8:
            self.code_dtype = torch.float8_e4m3fn

    def for_tensor(self, which: str) -> "Native":
        """The backend for ``"keys"`` or ``"values"``: ``clip`` resolved to ``mse`` or ``minmax``."""
        clip = "mse" if self.clip in ("mse", f"mse-{which}") else "minmax"
        return self if clip == self.clip else Native(self.bits, self.fp8, clip)

    def bounds(self, x: torch.Tensor, dim: int):
        """Each group's wanted range ``(lo, hi)``, float32 with ``dim`` of size 1 (integer formats):
        min/max, or the clipping search's range. For metadata stored on coarser grids
        (``quantize/metacodes.py``), which then widen it and give the codes their scale."""
        lo, hi = x.amin(dim=dim, keepdim=True).float(), x.amax(dim=dim, keepdim=True).float()
        if self.clip == "mse":  # the searched range, never past the data (a constant group: lo == hi)
            scale, offset = search_affine(x, dim, self.bits, torch.float32)
            return offset.maximum(lo), (offset + scale * (2**self.bits - 1)).minimum(hi)
        return lo, hi

    def codes(self, x: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        """Integer codes of ``x`` for a given ``(scale, offset)`` (broadcast over the groups; a scale
        of 0, a constant group's, gives codes 0)."""
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return ((x.float() - offset) / scale).round_().clamp_(0, 2**self.bits - 1).to(torch.uint8)

    def quantize(self, x: torch.Tensor, dim: int):
        if self.fp8:
            amax = x.abs().amax(dim=dim, keepdim=True).float()
            scale = (amax / FP8_MAX).to(x.dtype).float()
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            codes = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            return codes, scale, None
        if self.clip == "mse":
            scale, offset = search_affine(x, dim, self.bits, x.dtype)
        else:
            scale, offset = minmax_affine(x, dim, self.bits, x.dtype)
        return self.codes(x, scale, offset), scale, offset


def make(config) -> Native:
    return Native(config.bits, fp8=config.format == "fp8", clip=getattr(config, "clip", "minmax"))
