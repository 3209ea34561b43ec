"""``hqq`` backend: Half-Quadratic Quantization (1, 2, 3, 4 and 8 bits).

HQQ refines the min-max zero point per group with its proximal solver (``Quantizer.quantize``,
``optimize=True``); it reconstructs ``(codes - zero) * scale``, i.e. ``offset = -zero * scale``
(computed in float32, then stored in the model dtype like every backend's metadata). Groups are
laid out as rows (HQQ's ``axis=1``) so any axis and group size work; tiercache packs the codes
itself. hqq is imported on first use only.
"""

from __future__ import annotations

import torch

from tiercache.quantize.backends.grouping import as_rows


class HQQ:
    has_offset = True
    code_dtype = torch.uint8

    def __init__(self, bits: int):
        from hqq.core.quantize import Quantizer

        self.bits = bits
        self.quantizer = Quantizer

    def quantize(self, x: torch.Tensor, dim: int):
        rows, back = as_rows(x, dim)  # [R, group]
        group = rows.shape[-1]
        codes, meta = self.quantizer.quantize(
            rows, nbits=self.bits, group_size=group, axis=1, optimize=True, bitpack=False,
            compute_dtype=x.dtype, device=str(x.device),
        )
        scale = meta["scale"].float().to(x.dtype).float()  # [R, 1]
        offset = (-meta["zero"].float() * meta["scale"].float()).to(x.dtype).float()  # [R, 1]
        codes = codes.reshape(rows.shape).round().clamp(0, 2**self.bits - 1).to(torch.uint8)

        return back(codes), back(scale), back(offset)


def make(config) -> HQQ:
    return HQQ(config.bits)
