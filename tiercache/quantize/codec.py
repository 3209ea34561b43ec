"""The block format of a quantized layer, and the byte layout of its rows (no tensors, no torch).

Interface
    CodecSpec.of(q: QuantizePolicy) -> CodecSpec
        frozen, hashable: how a block of ``group_size`` tokens is encoded (backend, bits, format,
        clip, meta_bits, key_gain) and laid out (key / value axis). Two layers whose ``CodecSpec`` are equal hold
        interchangeable packed rows (``Quantize.can_adopt``); the residual rule and the attention
        sinks are not part of it. Canonical in the bits: ``bits`` are the values' bits and
        ``key_bits`` the keys' where they differ (else None), however the policy said it.
    spec.policy(residual_length, sink_tokens) -> QuantizePolicy
        the inverse of ``of``: the policy a layer of this format reports (its saved ``config``)
    spec.bits_of(which) -> int            bits of ``"keys"`` / ``"values"``
    spec.for_tensor(which) -> CodecSpec   that tensor's format alone (both bits its bits)
    spec.has_offset                       False for fp8 (symmetric: no zero point is stored)
    spec.layout(head_dim, which, dtype_bytes) -> RowLayout      ``which``: "keys" | "values"
    spec.row_bytes(head_dim, which, dtype_bytes) -> int
    row_layout(bits, has_offset, group_size, head_dim, axis, dtype_bytes) -> RowLayout
    token_groups(head_dim, group_size) -> int

Row layout (one block of one K or V head): ``[codes | pad | scale | offset]``. The codes of the
block's ``G * D`` elements packed ``bits`` each; ``pad`` aligns the metadata to the model dtype;
then one scale (and, with an offset, one offset) in the model dtype per group: per channel
(``channel`` axis: ``D`` groups) or per run of ``D / n`` channels of each token (``token`` axis:
``G * n`` groups, ``n = token_groups(D, G)``). With ``meta_bits: 8`` the metadata is ``[ranges |
offset bytes | scale bytes]`` instead: four numbers in the model dtype (the row's grids), then one
byte per group for each (``quantize/metacodes.py``). This is the one statement of the layout:
``tiercache.quantize.blocks.BlockCodec`` packs rows by it and the planner
(``tiercache.planner.footprint``) counts bytes by it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

from tiercache.policy.schema import QuantizePolicy

RANGES = 4  # meta_bits 8: the grid numbers of a row (quantize/metacodes.py: o0, o_step, s0, s_step)


def token_groups(head_dim: int, group_size: int) -> int:
    """Groups per token for ``axis: token``: ``ceil(D / G)``, raised until it divides ``D``."""
    n = -(-head_dim // min(group_size, head_dim))
    while head_dim % n:
        n += 1
    return n


class RowLayout(NamedTuple):
    code_bytes: int  # packed codes, at the start of the row
    meta_at: int  # where the metadata starts (code_bytes rounded up to the dtype's size)
    groups: int  # quantization groups per block: scales (and offsets) in the row
    meta_bytes: int  # bytes of the scales (and as many of the offsets), after the ranges
    row_bytes: int  # the whole row
    ranges_bytes: int = 0  # meta_bits 8: the row's four grid numbers in the dtype, before the offset and scale bytes


def row_layout(bits: int, has_offset: bool, group_size: int, head_dim: int, axis: str, dtype_bytes: int,
               meta_bits: int | None = None) -> RowLayout:
    """Where the parts of one packed block row lie (module docstring)."""
    code_bytes = -(-group_size * head_dim * bits // 8)
    meta_at = -(-code_bytes // dtype_bytes) * dtype_bytes
    groups = head_dim if axis == "channel" else group_size * token_groups(head_dim, group_size)
    if meta_bits == 8:  # [ranges: 4 dtype numbers | offset bytes | scale bytes] (quantize/metacodes.py)
        ranges = RANGES * dtype_bytes
        row = -(-(meta_at + ranges + 2 * groups) // dtype_bytes) * dtype_bytes  # padded: every row's ranges aligned
        return RowLayout(code_bytes, meta_at, groups, groups, row, ranges)
    meta_bytes = groups * dtype_bytes
    return RowLayout(code_bytes, meta_at, groups, meta_bytes, meta_at + meta_bytes * (2 if has_offset else 1))


@dataclass(frozen=True)
class CodecSpec:
    backend: str
    bits: int
    group_size: int
    key_axis: str
    value_axis: str
    format: str
    clip: str
    key_bits: int | None = None  # the keys' bits where they differ from ``bits`` (the values')
    meta_bits: int | None = None  # None: scales and offsets in the model dtype; 8: bytes on the row's grids
    key_gain: float = 1.0  # what attention reads of a packed key: key_gain * the key (blocks.BlockCodec)

    @classmethod
    def of(cls, q: QuantizePolicy) -> "CodecSpec":
        kb, vb = q.bits_of("keys"), q.bits_of("values")
        return cls(q.backend, vb, q.group_size, q.key_axis, q.value_axis, q.format, q.clip, None if kb == vb else kb,
                   q.meta_bits, float(q.key_gain))

    def policy(self, residual_length: int, sink_tokens: int = 0) -> QuantizePolicy:
        return QuantizePolicy(backend=self.backend, bits=self.bits, group_size=self.group_size,
                              residual_length=residual_length, key_axis=self.key_axis, value_axis=self.value_axis,
                              format=self.format, sink_tokens=sink_tokens, clip=self.clip, key_bits=self.key_bits,
                              meta_bits=self.meta_bits, key_gain=self.key_gain)

    def bits_of(self, which: str) -> int:
        return self.key_bits if which == "keys" and self.key_bits is not None else self.bits

    def for_tensor(self, which: str) -> "CodecSpec":
        return replace(self, bits=self.bits_of(which), key_bits=None)

    def axis_of(self, which: str) -> str:
        return self.key_axis if which == "keys" else self.value_axis

    @property
    def has_offset(self) -> bool:
        return self.format != "fp8"

    def layout(self, head_dim: int, which: str, dtype_bytes: int) -> RowLayout:
        return row_layout(self.bits_of(which), self.has_offset, self.group_size, head_dim, self.axis_of(which),
                          dtype_bytes, self.meta_bits)

    def row_bytes(self, head_dim: int, which: str, dtype_bytes: int) -> int:
        return self.layout(head_dim, which, dtype_bytes).row_bytes
