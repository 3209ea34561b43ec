"""``Mirror``: the device copy of one offloaded layer, in a slot of the prefetcher's pool.

The ``Prefetcher`` (``tiercache.offload.prefetch``) creates, owns and invalidates mirrors;
``Offload`` gets its layer's one from ``Prefetcher.acquire`` and reads and appends through it.

Interface
    Mirror                                 made by the prefetcher (``fill``), one per fetch
        slot                               the ``Slot`` whose bytes hold it
        k, v                               [B, H, C, Dk], [B, H, C, Dv] views in the slot; None while
                                           it holds no tokens (an empty host layer)
        lo, held                           it holds the host layer's tokens in rows ``lo .. lo + held``
        capacity                           ``C`` (0 when empty); pad: the least ``C`` (static: max_length)
        valid                              False once the prefetcher dropped it (evict, slot reuse, close)
        kv() -> (k, v)                     the held tokens, [B, H, held, D]
        has_room(t) -> bool                ``t`` more tokens fit after the held ones
        append(key, value)                 write new tokens after the held ones (device to device)
        shown(n) -> (k, v)                 what the host layer's update returned (``n`` tokens), on the device
        keep(n)                            the host layer kept only the last ``n`` held tokens
    plan(host, room, pad) -> Plan | None   how a fetch copies the host layer (None: it holds nothing)
    mirror_capacity(need, floor) -> int    the capacity rule (tokens, or rows of blocks); torch-free
    steady_capacity(host_capacity, kept)   what a mirror settles at in steady decoding (the planner's)
    row_stride(t), layout_bytes(k, v, cap)

Capacity: a fetch whose host rows allow one flat copy per tensor takes the host rows' capacity;
otherwise, and when an append does not fit, the mirror gets ``mirror_capacity(held + new, pad)``
(``grown_capacity``: whole CHUNKs on its ladder of 2^k and 1.5 x 2^k, at least ``pad``). Regrowing takes
fresh slot bytes from the prefetcher; the held tokens are copied over, device to device (counted
by ``layers/regrowth.py`` under ``device``), about ``2.4 C`` bytes at most up to a capacity ``C``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiercache.layers.capacity import grown_capacity
from tiercache.layers.tiers import nbytes_of


def mirror_capacity(need: int, floor: int = 0) -> int:
    """Tokens (or block rows) a mirror is laid out for when it must hold ``need``: whole CHUNKs on
    ``grown_capacity``'s ladder, at least ``floor`` (a static layer's ``max_length``, or the host rows)."""
    return max(grown_capacity(need), floor)


def steady_capacity(host_capacity: int, kept: int, rows: int = 2, floor: int = 0) -> int:
    """The capacity a layer's mirror settles at while decoding, keeping ``kept`` tokens (rows)
    in host rows of ``host_capacity``: a fetch copies the host rows as they are (``host_capacity``),
    the next append regrows it to ``mirror_capacity(kept + 1)``; slots never shrink. One row
    (``rows`` = batch x KV heads == 1) is fetched with room for the next token:
    ``mirror_capacity(kept + 1, floor)`` (``floor``: a static layer's max_length)."""
    if rows == 1:
        return mirror_capacity(kept + 1, floor)
    return mirror_capacity(kept + 1, host_capacity)


def row_stride(t: torch.Tensor) -> int | None:
    """``C`` when ``t`` ``[B, H, S, D]`` is the first ``S`` tokens of rows of ``C`` tokens laid
    end to end (what storage layers return), so one flat span of memory holds all of it."""
    b, h, s, d = t.shape
    st = t.stride()
    if (d > 1 and st[3] != 1) or (s > 1 and st[2] != d):
        return None
    row = st[1] if h > 1 else (st[0] if b > 1 else s * d)
    if row % max(d, 1) or row // max(d, 1) < s:
        return None
    c = row // max(d, 1)
    if b > 1 and st[0] != h * c * d:
        return None
    return c


def layout_bytes(k: torch.Tensor, v: torch.Tensor, cap: int) -> int:
    """Bytes of a mirror of ``cap`` tokens for keys like ``k`` and values like ``v``."""
    b, h = k.shape[:2]
    return b * h * cap * (k.shape[3] + v.shape[3]) * k.element_size()


@dataclass(frozen=True)
class Plan:
    """A fetch: the host views to copy, the mirror's capacity, one flat copy per tensor or not,
    and the staged write-backs to copy after the host tokens."""

    k: torch.Tensor  # [B, H, S, Dk] host view (S may be 0)
    v: torch.Tensor  # [B, H, S, Dv]
    cap: int
    flat: bool
    nbytes: int  # slot bytes the mirror needs
    extra: tuple = ()  # ([B, H, T, Dk], [B, H, T, Dv]) pinned pairs, oldest first


def plan(host, room: int, pad: int, extra=()) -> Plan | None:
    """How to copy ``host`` (the host layer's ``kv()``) and then ``extra`` (staged write-backs)
    with room for ``room`` more tokens."""
    extra = tuple(extra)
    if host is None and not extra:
        return None
    hk, hv = host if host is not None else (extra[0][0][:, :, :0], extra[0][1][:, :, :0])  # [B, H, S, D]
    s, staged = hk.shape[2], sum(k.shape[2] for k, _ in extra)
    ck, cv = row_stride(hk), row_stride(hv)
    # One flat copy per tensor when the host rows allow it (and hold the staged tokens too); an
    # update needing more room than the host rows have regrows the mirror on the device (cheap
    # next to the bus). One row (batch 1, one KV head) is one span anyway, and its strides do
    # not tell the host capacity: it gets room like a non-flat copy, else every step regrows.
    rows = hk.shape[0] * hk.shape[1]
    flat = ck is not None and ck == cv and ck >= max(pad, s + staged) and rows > 1 and s > 0
    cap = ck if flat else mirror_capacity(s + staged + room, pad)
    return Plan(hk, hv, cap, flat, layout_bytes(hk, hv, cap), extra)


class Mirror:
    def __init__(self, slot, pad: int):
        self.slot = slot
        self.pad = pad  # static: views span max_length
        self.k: torch.Tensor | None = None  # [B, H, C, Dk] in the slot
        self.v: torch.Tensor | None = None  # [B, H, C, Dv]
        self.lo = 0  # first held token
        self.held = 0  # tokens held (== what the host layer holds once staged write-backs joined it)
        self.valid = True

    @property
    def capacity(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def fill(self, p: Plan | None) -> int:
        """Copy the host layer, then the staged pairs, into the slot (the caller made the side
        stream current); bytes moved."""
        if p is None:
            return 0
        hk, hv, cap = p.k, p.v, p.cap
        b, h, s = hk.shape[:3]
        self._lay_out(cap, hk, hv)
        moved = 0  # bytes that cross the bus: a flat span also carries the free slack between rows
        for dst, src in ((self.k, hk), (self.v, hv)):
            if p.flat:  # one contiguous span: rows of `cap` tokens, the last one cut at `s`
                n = ((b * h - 1) * cap + s) * src.shape[3]
                dst.view(-1)[:n].copy_(src.as_strided((n,), (1,)), non_blocking=True)
                moved += n * src.element_size()
            elif s:
                dst[:, :, :s].copy_(src, non_blocking=True)
                moved += nbytes_of(src)
        for ek, ev in p.extra:  # staged write-backs, after the host tokens
            t = ek.shape[2]
            self.k[:, :, s : s + t].copy_(ek, non_blocking=True)
            self.v[:, :, s : s + t].copy_(ev, non_blocking=True)
            moved += nbytes_of(ek, ev)
            s += t
        if self.pad:
            for dst in (self.k, self.v):
                dst[:, :, s:].zero_()  # static: attention reads the masked tail; keep it finite
        self.lo, self.held = 0, s
        return moved

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :, self.lo : self.lo + self.held], self.v[:, :, self.lo : self.lo + self.held]

    def has_room(self, t: int) -> bool:
        return self.k is not None and self.lo + self.held + t <= self.capacity

    def slide(self) -> None:
        """Move the held tokens to the front of their rows (room at the end, same memory)."""
        for m in (self.k, self.v):
            m[:, :, : self.held].copy_(m[:, :, self.lo : self.lo + self.held].clone())
        self.lo = 0

    def relayout(self, cap: int, key: torch.Tensor, value: torch.Tensor, old) -> None:
        """Lay the mirror out anew over the slot's bytes for ``cap`` tokens like ``key`` /
        ``value``, then copy ``old`` (the held tokens, in other memory) to its front."""
        self._lay_out(cap, key, value)
        if self.pad:
            self.k.zero_()
            self.v.zero_()
        if old is not None:
            self.k[:, :, : self.held].copy_(old[0])
            self.v[:, :, : self.held].copy_(old[1])
        self.lo = 0

    def _lay_out(self, cap: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """``k`` / ``v`` over the slot's bytes: ``cap`` tokens like ``key`` / ``value``."""
        b, h = key.shape[:2]
        self.k, self.v = self.slot.views([(b, h, cap, key.shape[3]), (b, h, cap, value.shape[3])], key.dtype)

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the new tokens after the held ones (device to device); room was reserved."""
        t = key.shape[2]
        end = self.lo + self.held
        self.k[:, :, end : end + t].copy_(key)
        self.v[:, :, end : end + t].copy_(value)
        self.held += t

    def shown(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device tensors for the ``n`` tokens the host layer's update returned: its last
        ``n`` held tokens, or ``n`` from ``lo`` when it returns more (static: max_length)."""
        a = self.lo + self.held - n if n <= self.held else self.lo
        return self.k[:, :, a : a + n], self.v[:, :, a : a + n]

    def keep(self, n: int) -> None:
        """The host layer keeps only the last ``n`` of the held tokens (a window): forget the rest."""
        self.lo, self.held = self.lo + self.held - n, n

    def invalidate(self) -> None:
        """Dropped by the prefetcher: its slot may hold another layer's mirror from now on."""
        self.valid = False
        self.k = self.v = None
        self.slot = None
        self.lo = self.held = 0
