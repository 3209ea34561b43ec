"""``quanto`` backend: optimum-quanto's group-wise affine quantization (2 and 4 bits).

Scale and shift come from quanto's ``MaxOptimizer`` (min-max, as transformers' quanto
``QuantizedCache`` uses), codes from ``torch.ops.quanto.quantize_affine``; quanto reconstructs
``codes * scale - shift``, i.e. ``offset = -shift``. Groups are laid out as rows (quanto's
``axis=0``) so any axis and group size work. The packing into bytes is tiercache's own (the
block rows of ``tiercache.quantize.blocks``), so no quanto C++ extension is needed.
optimum-quanto is imported on first use only.
"""

from __future__ import annotations

import torch

from tiercache.quantize.backends.grouping import as_rows


class Quanto:
    has_offset = True
    code_dtype = torch.uint8

    def __init__(self, bits: int):
        from optimum.quanto import MaxOptimizer, qint2, qint4

        self.bits = bits
        self.qtype = qint4 if bits == 4 else qint2
        self.optimizer = MaxOptimizer()

    def quantize(self, x: torch.Tensor, dim: int):
        rows, back = as_rows(x, dim)  # [R, group]
        scale, shift = self.optimizer(rows, self.qtype, 0, None)  # [R, 1] each, per row
        scale = scale.to(x.dtype)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant rows: codes 0
        shift = shift.to(x.dtype)
        codes = torch.ops.quanto.quantize_affine(rows, bits=self.bits, axis=0, group_size=None, scale=scale, shift=shift)
        return back(codes), back(scale.float()), back(-shift.float())


def make(config) -> Quanto:
    return Quanto(config.bits)
