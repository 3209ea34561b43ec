"""A deterministic simulated device: the CUDA ordering of offload, checked on the CPU.

    with simulated(devices=1) as sim:      installs the runtime (``tiercache.processors.runtime``)
        k = torch.randn(1, 2, 5, 8)        factories make tensors on the current simulated device
        cache.update(k, k, 0)              ... the offload chain runs its CUDA path on them
    sim.hazards                            the races seen (a test asserts there are none)
    sim.device(i)                          context: the current device (factories allocate there: a
                                           ``device="cpu"`` argument cannot name a simulated device,
                                           so a test sets it around a layer's work, as
                                           ``torch.cuda.device(i)`` would)
    sim.synchronize()                      every stream of every device lands (a host sync)
    sim.host_syncs                         event / stream synchronizes that had to wait for queued work
    sim.allocs, sim.device_allocs          allocations so far: all, and ``device_empty`` ones (the
                                           memory a cache asks for: regrowth shows here)

Simulated "device" tensors are CPU tensors whose memory lies in one device's *arena* (a big
uint8 buffer, one per simulated device): ``device_of(t)`` is found from the address. A
``TorchDispatchMode`` sees every op while the block runs:
- an op on arena tensors produces its results in that device's arena (as CUDA keeps results on
  the inputs' device); an op mixing two devices' tensors raises, as CUDA does (``copy_`` may);
  a factory (``randn``, ``empty`` ...) allocates on the current device; host tiers and pinned
  staging come from ``host_empty`` / ``pinned_empty`` and stay in host memory.
- the compute stream of each device is *eager* (its ops run at once), except a non-blocking copy
  into pinned host memory, which is queued on it (its source read at once, in stream order).
- a side stream is *lazy*: every in-place op (``copy_``, ``zero_`` ...) issued while it is current
  is queued and lands only when the stream is advanced past it: an event on it synchronized, the
  stream synchronized, or a ``wait_event`` / ``wait_stream`` by the (eager) compute stream.
  ``query()`` is false until then: nothing lands by itself.

What a missing ordering call does here:
- a queued op's destination holds *poison* (NaN, all ones, True) until it lands: reading it
  early reads poison, and is recorded as a hazard;
- a queued copy whose source the host or the compute stream overwrites before it lands copies
  poison from there (it may read old or new bytes);
- a side-stream op that reads memory the compute stream wrote, or writes memory it used, without
  having waited for that work (``wait_stream`` / ``wait_event`` of an event recorded after it) is a
  hazard, and lands poison;
- device memory whose last tensor dies is poisoned and reused (first fit); if a side stream still
  has work on it and was not ``record_stream``-ed there, that is a hazard (record_stream keeps it
  until the stream passes the point of the free); a copy landing in freed memory is one too;
- a side stream of one device touching another device's memory is a hazard.
"""

from __future__ import annotations

import collections
import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tiercache.processors import runtime

ALIGN = 256
HOST_FACTORIES = {"aten::from_file"}


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


class Sim:
    """The simulated runtime (the ``tiercache.processors.runtime`` interface) and its state."""

    name = "simulated"

    def __init__(self, devices: int = 1, nbytes: int = 64 << 20):
        self.clock = 0
        self.allocs = 0
        self.device_allocs = 0
        self.host_syncs = 0
        self.index = 0
        self.busy = 0
        self.collecting = False
        self.host_depth = 0
        self.dead: list[Block] = []
        self.zombies: list[tuple[Block, list]] = []
        self.pending: list[Op] = []
        self.pinned: dict[int, tuple[int, object]] = {}
        self.hazards: list[str] = []
        self.devices = [SimDevice(self, i, nbytes) for i in range(devices)]

    # -- the runtime interface --------------------------------------------------------------
    def device_of(self, t: torch.Tensor):
        addr = t.data_ptr()
        return next((d for d in self.devices if d.owns(addr)), None)

    def home_of(self, device):
        return self.devices[self.index] if torch.device(device).type == "cpu" else None

    def new_stream(self, home: SimDevice) -> SimStream:
        return SimStream(self, home, compute=False)

    def current_stream(self, home: SimDevice) -> SimStream:
        return home.current

    @contextlib.contextmanager
    def use(self, stream: SimStream):
        dev, before, index = stream.dev, stream.dev.current, self.index
        dev.current, self.index = stream, dev.index
        try:
            yield
        finally:
            dev.current, self.index = before, index

    def event(self) -> SimEvent:
        return SimEvent(self)

    def record_stream(self, t: torch.Tensor, stream: SimStream) -> None:
        dev = self.device_of(t)
        block = dev.block_at(t.data_ptr()) if dev is not None else None
        if block is not None and not stream.compute:
            block.recorded.add(stream)

    def pinned_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        with self.host():
            t = torch.empty(shape, dtype=dtype)
        if t.numel():
            lo = t.data_ptr()
            self.pinned[lo] = (lo + t.numel() * t.element_size(), weakref.ref(t))
        return t

    def host_empty(self, shape, dtype: torch.dtype, pin: bool) -> torch.Tensor:
        if pin:
            return self.pinned_empty(shape, dtype)
        with self.host():
            return torch.empty(shape, dtype=dtype)

    def can_pin(self) -> bool:
        return True

    def device_empty(self, nbytes: int, home: SimDevice) -> torch.Tensor:
        with self.quiet():
            self.collect()
            self.device_allocs += 1
            return home.tensor(home.alloc(nbytes), (nbytes,), (1,), torch.uint8)

    def current_device(self) -> int:
        return self.index

    # -- for tests --------------------------------------------------------------------------
    @contextlib.contextmanager
    def device(self, index: int):
        before, self.index = self.index, index
        try:
            yield self.devices[index]
        finally:
            self.index = before

    def synchronize(self) -> None:
        """A host sync: every queued op of every stream lands (streams in creation order)."""
        while self.pending:
            self.pending[0].stream.synchronize()

    @contextlib.contextmanager
    def host(self):
        """Factories inside allocate host memory (a host tier, staging)."""
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

    @contextlib.contextmanager
    def quiet(self):
        self.busy += 1
        try:
            yield
        finally:
            self.busy -= 1

    # -- internals ----------------------------------------------------------------------------
    def hazard(self, what: str) -> None:
        self.hazards.append(what)

    def pinned_dst(self, t: torch.Tensor) -> bool:
        addr = t.data_ptr()
        for lo, (hi, ref) in list(self.pinned.items()):
            if ref() is None:
                del self.pinned[lo]
            elif lo <= addr < hi:
                return True
        return False

    def block_of(self, t: torch.Tensor) -> Block | None:
        dev = self.device_of(t)
        return None if dev is None else dev.block_at(t.data_ptr())

    def place(self, out, home: SimDevice, copy: bool = True):
        """``out`` (a fresh host tensor) copied into ``home``'s arena, same shape and strides
        (``copy=False``: uninitialised, what the arena holds there: poison, or an earlier owner's bytes)."""
        if not isinstance(out, torch.Tensor) or out.numel() == 0 or self.device_of(out) is not None:
            return out
        span = sum((s - 1) * st for s, st in zip(out.shape, out.stride())) + 1
        t = home.tensor(home.alloc(span * out.element_size()), out.shape, out.stride(), out.dtype)
        if copy:
            t.copy_(out)
        return t

    def collect(self) -> None:
        """Free the blocks whose last tensor died (at a safe point), and the zombies now due."""
        if self.collecting:
            return
        self.collecting = True
        try:
            with self.quiet():
                while self.dead:
                    self.release(self.dead.pop(0))
                for entry in list(self.zombies):
                    block, waits = entry
                    if all(s.done >= p for s, p in waits):
                        self.zombies.remove(entry)
                        block.dev.free(block)
        finally:
            self.collecting = False

    def release(self, block: Block) -> None:
        span = [(block.dev.base + block.lo, block.dev.base + block.hi)]
        users = {op.stream for op in self.pending if not op.stream.compute and overlap(op.reads + op.writes, span)}
        for stream in users - block.recorded:
            self.hazard(f"device memory of {block.dev} freed while {stream} still uses it (no record_stream): "
                        "poisoned and reused")
        waits = [(s, s.enq) for s in block.recorded if s.done < s.enq]
        if waits and not users - block.recorded:
            self.zombies.append((block, waits))
        else:
            block.dev.free(block)

    def land(self, op: Op) -> None:
        if op.marker is not None:
            stream, pos = op.marker
            stream.advance(pos)
            return
        self.pending.remove(op)
        with self.quiet():
            for block in op.written:
                if not block.live:
                    self.hazard(f"{op.func} on {op.stream} landed in freed device memory of {block.dev}")
            args = tree_map(lambda a: a() if isinstance(a, Late) else a, op.args)
            if op.racy:
                poison_(args[0])
            else:
                op.func(*args, **op.kwargs)
                if op.dirty:
                    _poison_dirty(args, op.dirty)

    def defer(self, stream: SimStream, func, args, kwargs, snapshot: bool):
        op = Op(stream, func, None, kwargs)
        dst = args[0]
        op.writes = intervals(dst)
        reads = [t for t in tree_flatten((args[1:], kwargs))[0] if isinstance(t, torch.Tensor)]
        if not snapshot:
            op.reads = [iv for t in reads for iv in intervals(t)]
        for t, write in [(dst, True), *((t, False) for t in reads)]:
            block = self.block_of(t)
            if block is None:
                continue
            if write:
                op.written.append(block)
            if stream.compute:
                continue
            if block.dev is not stream.dev:
                self.hazard(f"{func} on {stream} touches memory of {block.dev}")
            seen = stream.after.get(block.dev.index, -1)
            if write and block.last_access > seen:
                op.racy = True
                self.hazard(f"{func} on {stream} writes device memory the compute stream used after the "
                            "last point this stream waited for (wait_event / wait_stream missing)")
            if not write and block.last_write > seen:
                op.racy = True
                self.hazard(f"{func} on {stream} reads device memory the compute stream wrote after the "
                            "last point this stream waited for (wait_stream missing)")

        def pack(a):
            if not isinstance(a, torch.Tensor):
                return a
            if snapshot and a is not dst:
                return a.clone()
            return Late(self, a) if self.device_of(a) is not None else a

        op.args = tuple(tree_map(pack, list(args)))
        poison_(dst)
        stream.push(op)
        return dst

    def check_eager(self, func, tensors, writes) -> None:
        if not self.pending:
            return
        w = [iv for t in writes for iv in intervals(t)]
        r = [iv for t in tensors for iv in intervals(t)]
        for op in self.pending:
            if overlap(op.writes, r + w):
                self.hazard(f"{func} used memory that {op.func} on {op.stream} writes before that landed "
                            "(wait_event / synchronize missing): it saw poison")
            elif overlap(op.reads, w):  # the copy may read old or new bytes: what it copies from there is poison
                op.dirty.extend(w)

    def touch(self, tensors, writes) -> None:
        for t in tensors:
            block = self.block_of(t) if isinstance(t, torch.Tensor) else None
            if block is not None:
                block.last_access = self.clock
                if any(t is w for w in writes):
                    block.last_write = self.clock


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


def _poison_dirty(args, dirty: list) -> None:
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


def _mutated(func, args, kwargs) -> list:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


class _Mode(TorchDispatchMode):
    def __init__(self, sim: Sim):
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sim = self.sim
        if sim.busy:
            return func(*args, **kwargs)
        with sim.quiet():
            sim.collect()
            return self._run(func, args, kwargs)

    def _run(self, func, args, kwargs):
        sim, schema = self.sim, func._schema
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors:  # a factory
            out = func(*args, **kwargs)
            if sim.host_depth or schema.name in HOST_FACTORIES or kwargs.get("pin_memory"):
                return out
            sim.clock += 1
            empty = schema.name in ("aten::empty", "aten::empty_strided")
            return tree_map(lambda o: sim.place(o, sim.devices[sim.index], copy=not empty), out)
        mutated = _mutated(func, args, kwargs)
        homes = [sim.device_of(t) for t in tensors]
        devs = {h for h in homes if h is not None}
        if len(devs) > 1 and schema.name != "aten::copy_":
            raise RuntimeError(f"simulated device: {func} got tensors of {sorted(map(repr, devs))}; "
                               "expected all tensors on one device")
        home = sim.device_of(mutated[0]) if mutated and sim.device_of(mutated[0]) is not None else (
            next(iter(devs)) if devs else None)
        stream = home.current if home is not None else None
        if mutated and stream is not None and not stream.compute:
            return sim.defer(stream, func, args, kwargs, snapshot=False)
        if (schema.name == "aten::copy_" and stream is not None and _non_blocking(args, kwargs)
                and sim.device_of(args[0]) is None and sim.pinned_dst(args[0])):
            return sim.defer(stream, func, args, kwargs, snapshot=True)  # D2H into pinned memory, queued
        if not mutated and any(r.alias_info is not None for r in schema.returns):
            return func(*args, **kwargs)  # a view: no memory is read
        sim.clock += 1
        sim.check_eager(func, tensors, mutated)
        out = func(*args, **kwargs)
        fresh = []
        if home is not None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            placed = []
            for o, r in zip(outs, schema.returns):
                placed.append(sim.place(o, home) if r.alias_info is None else o)
            fresh = [p for p in placed if isinstance(p, torch.Tensor)]
            out = type(out)(placed) if isinstance(out, (tuple, list)) else placed[0]
        sim.touch(tensors + fresh, mutated + fresh)
        return out


def _non_blocking(args, kwargs) -> bool:
    return bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))


@contextlib.contextmanager
def simulated(devices: int = 1, nbytes: int = 64 << 20):
    """Run the block on ``devices`` simulated devices (see the module docstring); yields the ``Sim``."""
    sim = Sim(devices, nbytes)
    with runtime.installed(sim), _Mode(sim):
        yield sim
