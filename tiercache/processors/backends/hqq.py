"""``hqq`` backend: Half-Quadratic Quantization (1, 2, 3, 4 and 8 bits).

HQQ refines the min-max zero point per group with its proximal solver (``Quantizer.quantize``,
``optimize=True``); it reconstructs ``(codes - zero) * scale``, i.e. ``offset = -zero * scale``
(computed in float32, then stored in the model dtype like every backend's metadata). Groups are
laid out as rows (HQQ's ``axis=1``) so any axis and group size work; tiercache packs the codes
itself. hqq is imported on first use only.
"""

from __future__ import annotations

import torch

PACKAGE = "hqq"
PIP = "hqq"
BITS = (1, 2, 3, 4, 8)


def check(config) -> str | None:
    if config.format != "int":
        return f"supports only format 'int' (fp8 is native only); got format {config.format!r}"
    if config.bits not in BITS:
        return f"supports bits {', '.join(map(str, BITS))}; got bits {config.bits}"
    return None


class HQQ:
    has_offset = True
    code_dtype = torch.uint8

    def __init__(self, bits: int):
        from hqq.core.quantize import Quantizer

        self.bits = bits
        self.quantizer = Quantizer

    def quantize(self, x: torch.Tensor, dim: int):
        moved = x.movedim(dim, -1)  # [..., group]
        group = moved.shape[-1]
        rows = moved.reshape(-1, group)  # [R, group]
        codes, meta = self.quantizer.quantize(
            rows, nbits=self.bits, group_size=group, axis=1, optimize=True, bitpack=False,
            compute_dtype=x.dtype, device=str(x.device),
        )
        scale = meta["scale"].float().to(x.dtype).float()  # [R, 1]
        offset = (-meta["zero"].float() * meta["scale"].float()).to(x.dtype).float()  # [R, 1]
        codes = codes.reshape(rows.shape).round().clamp(0, 2**self.bits - 1).to(torch.uint8)

        def back(t):  # [R, k] -> x's layout with the group dim of size k
            return t.reshape(*moved.shape[:-1], t.shape[-1]).movedim(-1, dim)

        return back(codes), back(scale), back(offset)


def make(config) -> HQQ:
    return HQQ(config.bits)
