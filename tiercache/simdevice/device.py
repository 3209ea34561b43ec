"""A deterministic simulated device: the CUDA ordering of offload, checked on the CPU.

    with simulated(devices=1) as sim:      installs the runtime (``tiercache.runtime``)
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

The memory and streams live in ``tiercache.simdevice.memory``.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tiercache import runtime
from tiercache.simdevice.memory import Block, Late, Op, SimDevice, SimEvent, SimStream, hull, intervals, \
    overlap, poison_, poison_dirty

HOST_FACTORIES = {"aten::from_file"}


class Sim:
    """The simulated runtime (the ``tiercache.runtime`` interface) and its state."""

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
                    poison_dirty(args, op.dirty)

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
        rw = [iv for t in tensors for iv in intervals(t)] + w
        (rw0, rw1), (w0, w1) = hull(rw), hull(w)
        for op in self.pending:  # the hulls first: most pending ops are far from this op's memory
            if op.hulls is None:
                op.hulls = hull(op.writes), hull(op.reads)
            (ow0, ow1), (or0, or1) = op.hulls
            if ow0 < rw1 and rw0 < ow1 and overlap(op.writes, rw):
                self.hazard(f"{func} used memory that {op.func} on {op.stream} writes before that landed "
                            "(wait_event / synchronize missing): it saw poison")
            elif or0 < w1 and w0 < or1 and overlap(op.reads, w):  # the copy may read old or new bytes: poison
                op.dirty.extend(w)

    def touch(self, tensors, writes) -> None:
        for t in tensors:
            block = self.block_of(t) if isinstance(t, torch.Tensor) else None
            if block is not None:
                block.last_access = self.clock
                if any(t is w for w in writes):
                    block.last_write = self.clock

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
