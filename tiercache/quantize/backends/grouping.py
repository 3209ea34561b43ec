"""What the integer backends built on other packages (quanto, hqq) share.

``as_rows(x, dim) -> (rows, back)`` groups laid out as rows ``[R, group]`` (groups run along
                                 ``dim``), and ``back(t)`` that puts a ``[R, k]`` result back into
                                 ``x``'s layout with the group dim of size ``k``
"""

from __future__ import annotations

import torch


def as_rows(x: torch.Tensor, dim: int):
    moved = x.movedim(dim, -1)  # [..., group]
    rows = moved.reshape(-1, moved.shape[-1])  # [R, group]

    def back(t: torch.Tensor) -> torch.Tensor:  # [R, k] -> x's layout, group dim of size k
        return t.reshape(*moved.shape[:-1], t.shape[-1]).movedim(-1, dim)

    return rows, back
