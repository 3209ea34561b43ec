"""What the integer backends built on other packages (quanto, hqq) share.

``check_int_bits(config, bits)`` the unsupported-combination message (or None) for a backend that
                                 does integer formats at the given bit widths
``as_rows(x, dim) -> (rows, back)`` groups laid out as rows ``[R, group]`` (groups run along
                                 ``dim``), and ``back(t)`` that puts a ``[R, k]`` result back into
                                 ``x``'s layout with the group dim of size ``k``
"""

from __future__ import annotations

import torch


def check_int_bits(config, bits: tuple[int, ...]) -> str | None:
    if config.format != "int":
        return f"supports only format 'int' (fp8 is native only); got format {config.format!r}"
    if config.bits not in bits:
        return f"supports bits {', '.join(map(str, bits))}; got bits {config.bits}"
    return None


def as_rows(x: torch.Tensor, dim: int):
    moved = x.movedim(dim, -1)  # [..., group]
    rows = moved.reshape(-1, moved.shape[-1])  # [R, group]

    def back(t: torch.Tensor) -> torch.Tensor:  # [R, k] -> x's layout, group dim of size k
        return t.reshape(*moved.shape[:-1], t.shape[-1]).movedim(-1, dim)

    return rows, back
