"""Packed blocks: ``group_size`` tokens of one K (or V) head quantized into one row of bytes.

Interface
    Codec(spec: CodecSpec)     a layer's block format (``quantize/codec.py``) and its backends
        for_kv(key_dim, value_dim, dtype) -> (BlockCodec, BlockCodec)   made at the first update
        spec.row_bytes(head_dim, which, dtype_bytes)                    the row layout's size
        backends               {"keys": backend, "values": backend} (their bits may differ: ``key_bits``)
        equal when the specs are (the same block format)
    BlockCodec(backend, group_size, head_dim, axis, dtype, meta_bits=None, gain=1.0)
    encode(x) -> rows          x ``[B, H, N*G, D]`` float -> rows ``[B, H, N, row_bytes]`` uint8
    decode(rows, out, remember=True)
                               rows ``[B, H, N, row_bytes]`` -> writes ``out`` ``[B, H, N*G, D]``
                               (a view into a larger tensor is fine: no temporary of the output;
                               ``remember=False`` keeps no views of ``rows`` for the next call)
    decode_plain(rows, out, remember=True)
                               the same without the gain: the tokens as given, for a crop's
                               residual and an export (equal to ``decode`` when ``gain`` is 1)
    roundtrip(x)               ``decode(encode(x))``: what attention sees for quantized tokens
    row_bytes / groups         bytes of one block row, quantization groups per block

Gain (``key_gain`` of the policy, keys only): ``encode`` packs ``gain * x``. The native
backend's ranges scale with the data (min/max, the clipping search, fp8's absmax), so its codes
are those of ``x`` and the scale and offset carry the gain (another backend quantizes ``gain *
x`` as its input): ``decode`` returns the gained tokens at no cost per step, and
``decode_plain`` divides the gain out again on the rare paths that hand tokens back.

Row layout: ``[codes | pad | scale | offset]`` (``codec.row_layout``, which the planner counts by
too; ``meta_bits: 8``: ``[codes | pad | ranges | offset bytes | scale bytes]``, ``metacodes.py``). Codes are packed ``8 // bits`` per byte, planar
(byte ``j`` holds elements ``j``, ``j + E/per``, ... of the token-major ``[G, D]`` block, so each
bit plane is a contiguous run of tokens; 3-bit codes as a bit stream); scale and
offset are in the model dtype, viewed as bytes (``pad`` aligns them). ``axis`` says what a
group spans: ``channel`` (KIVI keys) one channel over the block's ``G`` tokens, ``token`` a run
of ``g`` channels of one token, ``g = D / ceil(D / G)`` (the whole head when ``G >= D``; if
``D`` does not split evenly, the next group count that divides it).

Dequantization runs over all blocks at once, straight into the caller's output slice: the codes
are unpacked all planes at once (one broadcast shift and one mask over the bytes, then one
casting copy into the planes' tokens; plane by plane when the output is strided), then
``out * scale + offset`` in place, so a step costs one pass over the packed history and two
over its dequantized output, with no temporary of the output's size (the unpacked codes' one
is a byte per element: half of a bf16 output, a quarter of fp32).
"""

from __future__ import annotations

import torch

from tiercache import runtime
from tiercache.errors import CacheError
from tiercache.quantize import backends, metacodes
from tiercache.quantize.codec import CodecSpec, row_layout, token_groups

__all__ = ["BlockCodec", "Codec", "pack", "unpack", "plane", "token_groups"]

_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _shifts(bits: int, count: int, device: torch.device) -> torch.Tensor:
    key = (bits * 100 + count, runtime.device_key(device))
    if key not in _SHIFTS:
        _SHIFTS[key] = (torch.arange(count, dtype=torch.uint8) * bits).to(device)
    return _SHIFTS[key]


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., E]`` uint8 codes < 2**bits -> ``[..., ceil(E * bits / 8)]`` bytes.

    1, 2, 4 bits are planar: byte ``j`` holds codes ``j + i * E / per`` (``per = 8 // bits``) at
    bit ``i * bits``, so unpacking is ``per`` contiguous scalar shift-and-mask passes.
    """
    if bits == 8:
        return codes
    e = codes.shape[-1]
    if 8 % bits == 0:
        per = 8 // bits
        codes = torch.nn.functional.pad(codes, (0, -e % per))
        planes = codes.view(*codes.shape[:-1], per, -1)  # [..., per, bytes]
        out = planes[..., 0, :].clone()
        for i in range(1, per):
            out |= planes[..., i, :] << (i * bits)
        return out
    stream = (codes.unsqueeze(-1) >> _shifts(1, bits, codes.device)) & 1  # [..., E, bits]
    stream = torch.nn.functional.pad(stream.flatten(-2), (0, -(e * bits) % 8))
    stream = stream.view(*codes.shape[:-1], -1, 8)  # [..., bytes, 8]
    return (stream << _shifts(1, 8, codes.device)).sum(-1, dtype=torch.uint8)


def plane(packed: torch.Tensor, bits: int, i: int, top: bool = False) -> torch.Tensor:
    """Codes ``i * E / per ...`` of planar bytes: one contiguous ``[..., bytes]`` uint8 pass
    (``top``: the highest plane, where the shift alone suffices)."""
    if top:
        return packed >> (i * bits)
    return (packed >> (i * bits)) & (2**bits - 1) if i else packed & (2**bits - 1)


def unpack(packed: torch.Tensor, bits: int, e: int) -> torch.Tensor:
    """Inverse of ``pack``: ``[..., bytes]`` -> ``[..., e]`` uint8 codes."""
    if bits == 8:
        return packed
    if 8 % bits == 0:
        codes = torch.cat([plane(packed, bits, i) for i in range(8 // bits)], dim=-1)
        return codes if codes.shape[-1] == e else codes[..., :e]
    stream = (packed.unsqueeze(-1) >> _shifts(1, 8, packed.device)).bitwise_and_(1).flatten(-2)
    stream = stream[..., : e * bits].reshape(*packed.shape[:-1], e, bits)  # [..., e, bits]
    return (stream << _shifts(1, bits, packed.device)).sum(-1, dtype=torch.uint8)


def _planes_of(view: torch.Tensor, per: int) -> torch.Tensor | None:
    """``view`` ``[B, H, N, G, ...]`` as ``[B, H, N, per, G * ... / per]`` (one row per plane), or
    None when a block's elements are not one contiguous run (then no such view exists)."""
    packed = 1  # the stride a packed block has at the dim being checked, innermost first
    for dim in range(view.dim() - 1, 2, -1):
        if view.shape[dim] != 1 and view.stride(dim) != packed:
            return None
        packed *= view.shape[dim]
    return view.view(*view.shape[:3], per, packed // per)


class Codec:
    """A quantized layer's block format (a ``CodecSpec``) with its backend; ``Quantize`` gets one
    from the chain builder and asks it for the two ``BlockCodec`` at its first update, when the
    head dims and dtype are known."""

    def __init__(self, spec: CodecSpec):
        self.spec = spec
        # validated here: a bad backend fails when the chain is built; one per tensor (their bits may differ)
        self.backends = {which: backends.get(spec.for_tensor(which)) for which in ("keys", "values")}
        self.group_size = spec.group_size

    def for_kv(self, key_dim: int, value_dim: int, dtype: torch.dtype) -> tuple["BlockCodec", "BlockCodec"]:
        """Fresh codecs for the keys and the values (each remembers the views it last decoded)."""
        return tuple(BlockCodec(backends.for_tensor(self.backends[which], which), self.group_size, dim,
                                self.spec.axis_of(which), dtype, self.spec.meta_bits,
                                self.spec.key_gain if which == "keys" else 1.0)
                     for which, dim in (("keys", key_dim), ("values", value_dim)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Codec) and other.spec == self.spec

    def __hash__(self) -> int:
        return hash(self.spec)

    def __repr__(self) -> str:
        return f"Codec({self.spec})"


class BlockCodec:
    def __init__(self, backend, group_size: int, head_dim: int, axis: str, dtype: torch.dtype,
                 meta_bits: int | None = None, gain: float = 1.0):
        if not dtype.is_floating_point:
            raise CacheError(f"quantize: keys and values must be floating point, got {dtype}")
        self.gain = float(gain)  # what attention sees of a packed token: gain * the token (module docstring)
        self.backend, self.g, self.d, self.axis, self.dtype = backend, group_size, head_dim, axis, dtype
        if axis == "channel":
            self.shape, self.dim, self.meta_shape = (group_size, head_dim), -2, (1, head_dim)
        else:
            n = token_groups(head_dim, group_size)
            self.shape, self.dim, self.meta_shape = (group_size, n, head_dim // n), -1, (group_size, n, 1)
        self.elements = group_size * head_dim
        self.size = torch.empty((), dtype=dtype).element_size()
        layout = row_layout(backend.bits, backend.has_offset, group_size, head_dim, axis, self.size, meta_bits)
        self.code_bytes, self.meta_at, self.groups, self.meta_bytes, self.row_bytes, self.ranges_bytes = layout
        self.meta8 = meta_bits == 8  # scales and offsets as bytes on the row's grids (quantize/metacodes.py)
        self._last = None  # (rows key, (codes, scale, offset)): see _parts

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        b, h, t, _ = x.shape
        n = t // self.g
        if self.gain != 1.0:
            x = x * self.gain  # one block run, packed once: the scale and offset carry the gain
        blocks = x.reshape(b, h, n, *self.shape)  # [B, H, N, G, D] (token axis: [.., G, n, g])
        rows = torch.zeros((b, h, n, self.row_bytes), dtype=torch.uint8, device=x.device)  # [B, H, N, row]
        if self.meta8:
            return self._encode_meta8(blocks, rows)
        codes, scale, offset = self.backend.quantize(blocks, self.dim)
        codes = codes.reshape(b, h, n, self.elements)
        if codes.dtype != torch.uint8:
            codes = codes.view(torch.uint8)  # fp8 codes, one byte each
        rows[..., : self.code_bytes] = pack(codes, self.backend.bits)
        for i, meta in enumerate((scale, offset) if self.backend.has_offset else (scale,)):
            at = self.meta_at + i * self.meta_bytes
            meta = meta.to(self.dtype).reshape(b, h, n, self.groups).contiguous()
            rows[..., at : at + self.meta_bytes] = meta.view(torch.uint8)
        return rows

    def _encode_meta8(self, blocks: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Each group's range (the backend's), widened onto the row's byte grids, then the codes."""
        b, h, n = rows.shape[:3]
        lo, hi = (t.reshape(b, h, n, self.groups) for t in self.backend.bounds(blocks, self.dim))  # [B, H, N, groups]
        scale, offset, ranges, meta = metacodes.cover(lo, hi, self.backend.bits, self.dtype)
        codes = self.backend.codes(blocks, *(t.reshape(b, h, n, *self.meta_shape) for t in (scale, offset)))
        rows[..., : self.code_bytes] = pack(codes.reshape(b, h, n, self.elements), self.backend.bits)
        at = self.meta_at + self.ranges_bytes
        rows[..., self.meta_at : at] = ranges.contiguous().view(torch.uint8)
        rows[..., at : at + 2 * self.groups] = meta
        return rows

    def decode(self, rows: torch.Tensor, out: torch.Tensor, remember: bool = True) -> None:
        """Two vectorized passes over ``out``: codes as floats, then ``* scale + offset`` in place.

        On CPU this beats the alternatives measured: a 256-entry byte -> floats lookup
        (``index_select`` / ``embedding``: gathers are not vectorized, 5-10x slower), and a mixed
        uint8-float ``addcmul`` (it makes a float copy of the codes first).
        """
        b, h, n, _ = rows.shape
        view = out.view(b, h, n, *self.shape)  # [B, H, N, G, D] over the caller's output
        codes, scale, offset = self._parts(rows, remember)
        if self.meta8:  # rebuilt at every decode (small: one pair per group), never remembered stale
            scale, offset = metacodes.rebuild(scale)
        self._unpack_into(codes, view)
        if offset is None:  # fp8
            view.mul_(scale)
        elif self.axis == "channel":  # scale, offset [.., 1, D] broadcast over tokens: one fused pass
            torch.addcmul(offset, view, scale, out=view)
        else:  # [.., G, n, 1] broadcast along channels: mul_ + add_ vectorize, addcmul does not
            view.mul_(scale).add_(offset)

    def _parts(self, rows: torch.Tensor, remember: bool = True):
        """(codes, scale, offset) views of ``rows``; remembered for the last rows seen (a decode
        step reads the same store views again: a cached view keeps its storage alive, so an equal
        data pointer is the same memory). ``remember=False``: a one-off read (``kv()``)."""
        key = (rows.data_ptr(), rows.shape, rows.stride())
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        codes = rows.narrow(-1, 0, self.code_bytes)
        if self.meta8:  # (codes, the operands of metacodes.rebuild: views of the grid numbers and bytes, None)
            at = self.meta_at + self.ranges_bytes
            ranges, meta = self._dtype_view(rows[..., self.meta_at : at]), rows[..., at : at + 2 * self.groups]
            parts = (codes, metacodes.operands(ranges, meta, self.meta_shape), None)
        else:
            parts = (codes, self._meta(rows, 0), self._meta(rows, 1) if self.backend.has_offset else None)
        if remember:
            self._last = (key, parts)
        return parts

    def forget(self) -> None:
        """Drop the remembered views (and with them any storage they keep alive)."""
        self._last = None

    def _unpack_into(self, codes: torch.Tensor, view: torch.Tensor) -> None:
        """Codes ``[B, H, N, code_bytes]`` -> their values as floats in ``view`` ``[B, H, N, G, ...]``."""
        bits = self.backend.bits
        if not self.backend.has_offset:
            view.copy_(codes.view(self.backend.code_dtype).view(view.shape))
            return
        per = 8 // bits if 8 % bits == 0 else 0
        if bits == 8 or not per or self.g % per:
            view.copy_(unpack(codes, bits, self.elements).view(view.shape))
            return
        # plane i is tokens [i*t, (i+1)*t) of every block (t = G / per): when a block's [G, ...] is
        # one contiguous run of the output, all planes are one broadcast shift, one mask and one
        # casting copy (3 passes for any bits: int2 then costs what int4 does, not 2.5x the launches)
        planes = _planes_of(view, per)
        if planes is not None:
            shifts = _shifts(bits, per, codes.device).view(per, 1)
            planes.copy_((codes.unsqueeze(-2) >> shifts).bitwise_and_(2**bits - 1))  # [B, H, N, per, bytes]
            return
        t = self.g // per
        shape = (*view.shape[:3], t, *view.shape[4:])
        for i in range(per):  # a strided output: one small uint8 pass, then a casting copy, per plane
            view.narrow(3, i * t, t).copy_(plane(codes, bits, i, top=i == per - 1).view(shape))

    def decode_plain(self, rows: torch.Tensor, out: torch.Tensor, remember: bool = True) -> None:
        """``decode`` with the gain divided out: the tokens as they were given, quantized."""
        self.decode(rows, out, remember)
        if self.gain != 1.0:
            out.div_(self.gain)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=self.dtype, device=x.device)
        self.decode(self.encode(x), out)
        return out

    def _meta(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        at = self.meta_at + i * self.meta_bytes
        return self._dtype_view(rows[..., at : at + self.meta_bytes]).reshape(*rows.shape[:-1], *self.meta_shape)

    def _dtype_view(self, meta: torch.Tensor) -> torch.Tensor:
        """Row bytes ``[..., k * size]`` as ``[..., k]`` of the model dtype."""
        if meta.storage_offset() % self.size or any(s % self.size for s in meta.stride()[:-1]):
            meta = meta.contiguous()  # bytes not aligned for a dtype view (never for block stores)
        return meta.view(self.dtype)
