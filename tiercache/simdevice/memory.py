"""The simulated device's memory and streams (used by ``tiercache.simdevice.device``, which
documents the model): arenas with a first-fit allocator, queued ops, streams, events.

    SimDevice(sim, index, nbytes)   one simulated GPU: ``arena`` (uint8), ``alloc`` / ``free``
                                    (poisoned on free), ``block_at(addr)``, a compute stream
    Block                           one allocation: bytes, compute clocks, streams recorded on it
    SimStream                       ``wait_event``, ``wait_stream``, ``synchronize``, ``query``;
                                    ``push(op)`` queues, ``advance(pos)`` lands in order
    SimEvent                        ``record``, ``query``, ``synchronize``
    Op, Late                        a queued op; a device tensor in it, kept by address
    poison_(t), intervals(t), overlap(a, b), poison_dirty(args, dirty)
``sim`` is the ``Sim`` (``device``): its clock, pending ops, hazards, ``land`` and ``collect``.
"""

from __future__ import annotations

import collections
import weakref

import torch

ALIGN = 256

def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with what an unwritten destination holds here."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(-1 if info.min < 0 else info.max)


def intervals(t: torch.Tensor) -> list[tuple[int, int]]:
    """The address intervals ``t`` covers (rows of a strided view; its span beyond 4096 rows)."""
    if t.numel() == 0:
        return []
    es, base = t.element_size(), t.data_ptr()
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s != 1]
    length = 1
    while dims and dims[-1][1] == length:
        length *= dims[-1][0]
        dims.pop()
    starts = [0]
    for s, st in dims:
        if len(starts) * s > 4096:
            hi = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
            return [(base, base + (hi + 1) * es)]
        starts = [a + i * st for a in starts for i in range(s)]
    return [(base + a * es, base + (a + length) * es) for a in starts]


def overlap(a: list, b: list) -> bool:
    return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)


def hull(ivs: list) -> tuple[int, int]:
    """The one interval that spans all of ``ivs`` ((0, 0), which meets no address, when empty): two
    lists whose hulls are disjoint do not ``overlap``, a test that costs one comparison, not one per pair."""
    return (min(x0 for x0, _ in ivs), max(x1 for _, x1 in ivs)) if ivs else (0, 0)


class Block:
    """One device allocation: arena bytes ``lo .. hi`` of ``dev``."""

    def __init__(self, dev, lo: int, hi: int, clock: int):
        self.dev, self.lo, self.hi = dev, lo, hi
        self.last_write = self.last_access = clock  # allocated on the compute stream
        self.recorded: set = set()  # side streams record_stream-ed on it
        self.live = True


class SimDevice:
    """One simulated GPU: an arena, a first-fit allocator, a compute stream."""

    def __init__(self, sim, index: int, nbytes: int):
        self.sim, self.index = sim, index
        self.arena = torch.empty(nbytes, dtype=torch.uint8).fill_(255)
        self.np = self.arena.numpy()
        self.base = self.arena.data_ptr()
        self.nbytes = nbytes
        self.free_list = [(0, nbytes)]
        self.blocks: dict[int, Block] = {}  # lo -> live block
        self.compute = SimStream(sim, self, compute=True)
        self.current = self.compute

    def __repr__(self) -> str:
        return f"sim:{self.index}"

    def owns(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.nbytes

    def block_at(self, addr: int) -> Block | None:
        off = addr - self.base
        for lo, b in self.blocks.items():
            if lo <= off < b.hi or (lo == off == b.hi):
                return b
        return None

    def alloc(self, nbytes: int) -> Block:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (lo, hi) in enumerate(self.free_list):
            if hi - lo >= size:
                self.free_list[i : i + 1] = [(lo + size, hi)] if hi - lo > size else []
                block = self.blocks[lo] = Block(self, lo, lo + size, self.sim.clock)
                self.sim.allocs += 1
                return block
        raise torch.OutOfMemoryError(f"simulated device {self}: cannot allocate {nbytes} bytes "
                                     f"({self.nbytes} in its arena)")

    def free(self, block: Block) -> None:
        block.live = False
        del self.blocks[block.lo]
        self.arena[block.lo : block.hi].fill_(255)  # poison: what a later owner finds
        spans = sorted([*self.free_list, (block.lo, block.hi)])
        merged = [spans[0]]
        for lo, hi in spans[1:]:
            if lo == merged[-1][1]:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        self.free_list = merged

    def tensor(self, block: Block, size, stride, dtype: torch.dtype) -> torch.Tensor:
        """A tensor over ``block``'s bytes; the block is freed when its storage dies."""
        raw = self.np[block.lo : block.hi]
        weakref.finalize(raw, self.sim.dead.append, block)
        return torch.from_numpy(raw).view(dtype).as_strided(size, stride)


class Op:
    """A queued in-place op (or a wait marker) of one stream."""

    def __init__(self, stream, func=None, args=(), kwargs=None, marker=None):
        self.stream, self.func, self.args, self.kwargs, self.marker = stream, func, args, kwargs or {}, marker
        self.reads: list = []
        self.writes: list = []
        self.written: list = []  # blocks written, to spot a landing in freed memory
        self.racy = False
        self.dirty: list = []  # source intervals overwritten before it landed: their copies are poison
        self.hulls: tuple | None = None  # (hull of writes, hull of reads), made when first needed
        self.pos = 0


class SimStream:
    def __init__(self, sim, dev: SimDevice, compute: bool):
        self.sim, self.dev, self.compute = sim, dev, compute
        self.queue: collections.deque[Op] = collections.deque()
        self.enq = self.done = 0
        self.after: dict[int, int] = {}  # device index -> compute clock this stream is ordered after

    def __repr__(self) -> str:
        return f"{'compute' if self.compute else 'side'} stream {id(self) % 997} of {self.dev}"

    def push(self, op: Op) -> None:
        self.enq += 1
        op.pos = self.enq
        self.queue.append(op)
        if op.marker is None:
            self.sim.pending.append(op)

    def advance(self, pos: int) -> None:
        while self.done < pos and self.queue:
            op = self.queue.popleft()
            self.done = op.pos
            self.sim.land(op)
        self.done = max(self.done, min(pos, self.enq))
        self.sim.collect()

    def wait_event(self, event) -> None:
        if event.stream is None or event.stream is self:
            return
        if self.compute:  # eager: the waited work lands now
            event.stream.advance(event.pos)
            return
        for d, c in event.after.items():
            self.after[d] = max(self.after.get(d, -1), c)
        if event.stream.done < event.pos:
            self.push(Op(self, marker=(event.stream, event.pos)))

    def wait_stream(self, other) -> None:
        event = SimEvent(self.sim)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        if self.done < self.enq:
            self.sim.host_syncs += 1
        self.advance(self.enq)

    def query(self) -> bool:
        return self.done >= self.enq


class SimEvent:
    def __init__(self, sim):
        self.sim, self.stream, self.pos, self.after = sim, None, 0, {}

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else self.sim.devices[self.sim.index].current
        self.stream, self.pos = stream, stream.enq
        self.after = {stream.dev.index: self.sim.clock} if stream.compute else dict(stream.after)

    def query(self) -> bool:
        self.sim.collect()
        return self.stream is None or self.stream.done >= self.pos

    def synchronize(self) -> None:
        if self.stream is not None:
            if self.stream.done < self.pos:
                self.sim.host_syncs += 1  # the host blocks on work still queued
            self.stream.advance(self.pos)

class Late:
    """A device tensor in a queued op, kept by address (its memory may be freed meanwhile)."""

    def __init__(self, sim: Sim, t: torch.Tensor):
        self.dev = sim.device_of(t)
        self.offset = t.data_ptr() - self.dev.base
        self.size, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype

    def __call__(self) -> torch.Tensor:
        es = torch.empty((), dtype=self.dtype).element_size()
        flat = self.dev.arena[self.offset :].view(self.dtype) if self.offset % es == 0 else None
        return flat.as_strided(self.size, self.stride)


def poison_dirty(args, dirty: list) -> None:
    """After ``dst.copy_(src)`` landed: the elements copied from overwritten ``src`` bytes are poison."""
    dst, src = args[0], args[1]
    if not isinstance(src, torch.Tensor) or src.shape != dst.shape or src.numel() == 0:
        poison_(dst)
        return
    span = sum((s - 1) * st for s, st in zip(src.shape, src.stride())) + 1
    addr = torch.arange(span, dtype=torch.int64).as_strided(src.shape, src.stride()) * src.element_size()
    addr += src.data_ptr()
    bad = torch.zeros(src.shape, dtype=torch.bool)
    for lo, hi in dirty:
        bad |= (addr >= lo) & (addr < hi)
    if bad.any():
        view = dst[bad]
        poison_(view)
        dst[bad] = view
