"""``StaticQuantized``: a quantized layer preallocated for ``max_length`` tokens, updated by index.

    StaticQuantized(codec, residual_length, max_length)
        a ``KVLayer`` (``tiercache.layers.base``) holding packed blocks and an exact residual ring in
        fixed buffers; ``is_compileable``: a one-token update is pure tensor code (no Python branch
        on a tensor value, no data-dependent shape), so ``torch.compile(fullgraph=True)`` of a
        model's decode step compiles once and does not recompile as the position advances

The buffers (allocated at the first update, addresses never change):
    krows, vrows   [B, H, L / G, row] uint8   packed blocks (``blocks.BlockCodec`` rows), L =
                   ceil(max_length / R) * R token slots, so a whole residual always has a home
    rk, rv         [B, H, R, D]               the residual ring: slot ``s`` holds position ``P + s``
    position       [] int64                   tokens seen (the next position), on the device
    overflow       [] bool                    a compiled step ran past ``max_length`` (surfaced eagerly)

The quantization points are those of the dynamic ``Quantize`` layer (``tiercache.quantize.processor``)
with ``residual_length`` ``R`` a multiple of ``group_size`` ``G``: the residual holds ``n mod R``
tokens, and the update that fills it attends over all ``R`` exactly, then packs them into ``R / G``
blocks, never re-quantized. So the packed rows are bit-identical to the dynamic layer's and the
attention inputs are the same numbers.

A one-token step (``_step``), all positions tensors: write the token into ring slot ``s = p mod R``;
dequantize every row (fixed shape ``[B, H, L, D]``) and lay the ring over positions ``P .. P + R - 1``
(``P = p - s``, the packed tokens); quantize the ring into the rows of positions ``P .. P + R - 1``
*unconditionally*: until the ring is full those rows sit under the ring's overlay (and past the
position, masked), so only the write of a full ring is ever read. The returned K/V are in position
order over ``L`` slots, as transformers' ``StaticLayer`` returns ``max_cache_len`` slots: the
causal mask (``mask_sizes``: ``(L, 0)``) hides the slots past the position. A multi-token update
(prefill) is eager (``_bulk``, host positions); under ``torch.compile`` it is refused.

Bounds: an eager update past ``max_length`` raises ``CacheError`` (``check_room``, before any write).
A compiled step cannot raise, so it clamps its indices (never writes out of bounds) and sets
``overflow``; the next eager use (``seq_length``, ``kv``, an update) raises ``CacheError``.

Host reads: eager updates keep a host count of the tokens (``_count``), so an eager update (the
prefill, a manual loop) reads nothing back from the device: no sync. A compiled step moves
``position`` on the device and only marks the host count stale (an attribute store dynamo
replays after the graph, no guard); the next eager use reads ``position`` and ``overflow`` once.
The preallocated buffers are marked static for dynamo (``layers.static.mark_static``), so a
``reduce-overhead`` compile captures CUDA graphs over them.

Layouts: the native backend, integer codes of 2, 4 or 8 bits, either axis for keys and values,
``key_gain``, ``clip``; not fp8, ``meta_bits: 8`` or sinks (``supported`` says why, the chain
builder raises it). The compiled step dequantizes in the graph (inductor fuses it): the packed
decode kernels of ``packed_attention`` are the dynamic cache's. It is a ``StaticLayer`` (``tiercache.layers.static``) with packed buffers: the host count, batch
operations (``reorder``, ``select``, ``repeat_interleave``, eager) and accounting are that layer's.
``crop`` reaches the residual only. Lifecycle: ``state_dict`` holds the packed rows and the
residual as they are (fork and save / load are bit-exact); ``export`` gives the dequantized
tokens and ``ingest`` quantizes what it is given as one update would (retier).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import check_crop
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import held_tensor
from tiercache.layers.static import StaticLayer, mark_static
from tiercache.quantize.blocks import BlockCodec, Codec

__all__ = ["StaticQuantized", "supported"]


def supported(q) -> str | None:
    """Why a ``QuantizePolicy`` cannot be a ``StaticQuantized`` layer, or None when it can."""
    bits = {q.bits_of("keys"), q.bits_of("values")}
    if q.backend != "native" or q.format != "int":
        return f"backend {q.backend!r} format {q.format!r} (allowed: backend native, format int)"
    if not bits <= {2, 4, 8}:
        return f"bits {sorted(bits)} (allowed: 2, 4, 8)"
    if q.meta_bits is not None:
        return f"meta_bits {q.meta_bits} (allowed: null)"
    if q.sink_tokens:
        return f"sink_tokens {q.sink_tokens} (allowed: 0)"
    if q.residual_length < q.group_size or q.residual_length % q.group_size:
        return (f"residual_length {q.residual_length} with group_size {q.group_size} (allowed: a multiple of "
                "group_size, at least one group)")
    return None


class StaticQuantized(StaticLayer):
    kind = "static_quantized"
    is_compileable = True

    def __init__(self, codec: Codec, residual_length: int, max_length: int):
        super().__init__(max_length)
        self.codec, self.g, self.r = codec, codec.group_size, residual_length
        if self.r < self.g or self.r % self.g:
            raise CacheError(f"static quantized layer: residual_length {self.r} must be a multiple of group_size {self.g}")
        self.slots = -(-max_length // self.r) * self.r  # L: token slots, whole residuals
        self.codecs: tuple[BlockCodec, BlockCodec] | None = None
        self.krows = self.vrows = self.rk = self.rv = self.overflow = None
        self._overflowed = False  # a compiled step ran past max_length (module docstring)

    # -- the write path ---------------------------------------------------------------------------
    @torch.no_grad()
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = key.shape[2]
        if self.spec is None:
            if torch.compiler.is_compiling():
                raise CacheError("static quantized layer: the first update (prefill) must run eagerly, "
                                 "outside torch.compile (transformers' generate does)")
            self._allocate(KVSpec.read(key, value))
        if t == 1:
            return self._step(key, value)
        if torch.compiler.is_compiling():
            raise CacheError(f"static quantized layer: an update of {t} tokens under torch.compile; only one-token "
                             "decode steps are compiled, multi-token updates (prefill) run eagerly")
        self.surface()
        return self._bulk(key, value)

    def _step(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token, tensor positions only (module docstring)."""
        r, g, dev = self.r, self.g, self.position.device
        self.overflow.logical_or_(self.position >= self.limit)
        p = self.position.clamp(max=self.limit - 1)  # [] never an index out of bounds
        s = torch.remainder(p, r)  # ring slot of this token
        base = p - s  # P: packed tokens before this residual
        self.rk.index_copy_(2, s.view(1), key)
        self.rv.index_copy_(2, s.view(1), value)
        ring = base + torch.arange(r, device=dev)  # [R] positions of the ring's slots
        keys, values = self._dequantize(self.krows, 0), self._dequantize(self.vrows, 1)  # [B, H, L, D]
        keys.index_copy_(2, ring, self.rk)
        values.index_copy_(2, ring, self.rv)
        rows = torch.div(base, g, rounding_mode="floor") + torch.arange(r // g, device=dev)  # [R / G]
        self.krows.index_copy_(2, rows, self.codecs[0].encode(self.rk))  # read only once the ring is full
        self.vrows.index_copy_(2, rows, self.codecs[1].encode(self.rv))
        self.position.add_(1)
        self.length += 1  # compiled: marks the host count stale (room was checked eagerly: no overflow)
        return keys, values

    def _bulk(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Several tokens (eager): what as many one-token steps would leave; all of them exact in the output."""
        t, p = key.shape[2], self._count  # (synced by surface())
        s = p % self.r
        base = p - s
        keys, values = self._dequantize(self.krows, 0), self._dequantize(self.vrows, 1)  # [B, H, L, D]
        exact = torch.cat([self.rk[:, :, :s], key], 2), torch.cat([self.rv[:, :, :s], value], 2)  # [B, H, s+t, D]
        keys[:, :, base : p + t].copy_(exact[0])
        values[:, :, base : p + t].copy_(exact[1])
        flush = (s + t) // self.r * self.r
        if flush:
            lo, hi = base // self.g, (base + flush) // self.g
            self.krows[:, :, lo:hi].copy_(self.codecs[0].encode(exact[0][:, :, :flush]))
            self.vrows[:, :, lo:hi].copy_(self.codecs[1].encode(exact[1][:, :, :flush]))
        rest = s + t - flush
        self.rk[:, :, :rest].copy_(exact[0][:, :, flush:])
        self.rv[:, :, :rest].copy_(exact[1][:, :, flush:])
        self.position.fill_(p + t)
        self._count = p + t
        return keys, values

    def _dequantize(self, rows: torch.Tensor, i: int) -> torch.Tensor:
        """Every row ``[B, H, N, row]`` -> fresh ``[B, H, N * G, D]``: ``BlockCodec.decode``'s arithmetic
        (the same numbers), in ops with no cached views, so the graph tracer follows it."""
        c = self.codecs[i]
        b, h, n, _ = rows.shape
        codes = rows[..., : c.code_bytes]  # [B, H, N, code_bytes]
        bits = c.backend.bits
        if bits != 8:
            per = 8 // bits
            shifts = torch.arange(per, device=rows.device, dtype=torch.uint8).mul_(bits).view(per, 1)
            codes = (codes.unsqueeze(-2) >> shifts).bitwise_and_(2**bits - 1)  # [B, H, N, per, bytes]: planes
        x = codes.reshape(b, h, n, c.elements)[..., : c.elements].to(c.dtype).view(b, h, n, *c.shape)
        scale, offset = (rows[..., c.meta_at + j * c.meta_bytes : c.meta_at + (j + 1) * c.meta_bytes]
                         .view(c.dtype).reshape(b, h, n, *c.meta_shape) for j in (0, 1))
        x = torch.addcmul(offset, x, scale) if c.axis == "channel" else x * scale + offset
        return x.reshape(b, h, n * c.g, c.d)

    # -- what the cache asks ----------------------------------------------------------------------
    def _sync(self) -> None:
        """After compiled steps: read the device position and overflow into the host view (one read)."""
        if self._stale and self.position is not None:
            count, over = torch.stack([self.position, self.overflow.long()]).tolist()
            self._count, self._overflowed, self._stale = count, bool(over), False

    def surface(self) -> None:
        """Raise the ``CacheError`` a compiled step could not (it ran past ``max_length``)."""
        self._sync()
        if self._overflowed:
            raise CacheError(f"static quantized layer: a compiled decode step ran past max_length={self.limit} tokens "
                             "(its output is not valid); raise max_length in the policy or generate fewer tokens")

    def seq_length(self):
        """Tokens seen: the host count eagerly (read from the device only after compiled steps),
        the device counter itself under compile."""
        if self.position is not None and not torch.compiler.is_compiling():
            self.surface()
        return self.length

    def crop(self, n: int) -> None:
        held = self.seq_length()
        n = check_crop(n, held)
        if self.position is None:
            return
        if n and n >= held:
            self.position.zero_()
            self._count = 0
        elif n > held % self.r:
            raise CacheError(f"static quantized layer: crop({n}) reaches into packed blocks (only the newest "
                             f"{held % self.r} tokens, the residual, can be cropped)")
        elif n:
            self.position.sub_(n)
            self._count -= n

    def reset(self) -> None:
        super().reset()
        self.codecs = None
        self.krows = self.vrows = self.rk = self.rv = self.overflow = None
        self._overflowed = False

    @torch.no_grad()
    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Fresh dequantized ``[B, H, S, D]`` (packed blocks, then the residual exact)."""
        p = 0 if self.spec is None else self.seq_length()
        if not p:
            return None
        base = p - p % self.r
        keys, values = self._dequantize(self.krows, 0)[:, :, :p], self._dequantize(self.vrows, 1)[:, :, :p]
        keys[:, :, base:].copy_(self.rk[:, :, : p - base])
        values[:, :, base:].copy_(self.rv[:, :, : p - base])
        return keys.clone(), values.clone()

    @torch.no_grad()
    def _fill(self, spec: KVSpec, key: torch.Tensor, value: torch.Tensor) -> None:
        """``ingest``: what one update of these tokens leaves (quantized by this layer's rule)."""
        self.reset()
        self._allocate(spec)
        if key.shape[2]:
            self._bulk(key, value)

    # -- buffers ----------------------------------------------------------------------------------
    def _buffers(self) -> list[torch.Tensor]:
        return [self.krows, self.vrows, self.rk, self.rv]

    def _set_buffers(self, bufs: list[torch.Tensor]) -> None:
        self.krows, self.vrows, self.rk, self.rv = bufs

    def _shapes(self, s: KVSpec) -> list[tuple[tuple, torch.dtype]]:
        kc, vc = self.codec.for_kv(s.key_dim, s.value_dim, s.dtype)
        rows, u8 = self.slots // self.g, torch.uint8
        return [((s.batch, s.heads, rows, kc.row_bytes), u8), ((s.batch, s.heads, rows, vc.row_bytes), u8),
                ((s.batch, s.heads, self.r, s.key_dim), s.dtype), ((s.batch, s.heads, self.r, s.value_dim), s.dtype)]

    def _allocate(self, spec: KVSpec) -> None:
        super()._allocate(spec)
        self.codecs = self.codec.for_kv(spec.key_dim, spec.value_dim, spec.dtype)
        self.overflow = torch.zeros((), dtype=torch.bool, device=spec.device)
        self._overflowed = False
        mark_static(self.overflow)

    def _held(self) -> dict:
        """The packed rows of the packed tokens and the residual, as held (a lossless state)."""
        p = self.seq_length()
        s = p % self.r
        rows = (p - s) // self.g
        return {"krows": self.krows[:, :, :rows], "vrows": self.vrows[:, :, :rows],
                "rk": self.rk[:, :, :s], "rv": self.rv[:, :, :s]}

    def _load(self, spec: KVSpec, length: int, sd: dict) -> None:
        self.reset()  # a refused state leaves the layer empty
        s = length % self.r
        counts = (*[(length - s) // self.g] * 2, s, s)  # packed rows, rows, residual tokens, tokens
        held = [held_tensor(sd, name, (*shape[:2], n, shape[3]), dtype, self.kind)
                for name, n, (shape, dtype) in zip(("krows", "vrows", "rk", "rv"), counts, self._shapes(spec))]
        self._refill(spec, held, length)
