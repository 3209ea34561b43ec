"""The Prefetcher: one per cache, shared by its offloaded layers; owns the side stream, the
pool of device buffers (slots) and the device copies of offloaded layers in them: one
``Mirror`` (``tiercache.offload.mirror``) per fetched layer, created, regrown and
invalidated here only.

Interface used by ``Offload`` (``tiercache.offload.processor``)
    register(layer, index) -> key          order the layer among the offloaded ones
    acquire(layer, room) -> Mirror         make ``layer`` the one in use: its mirror is on the
                                           device, waited for on the compute stream; the next
                                           ``layer.depth`` layers (cyclic) start fetching
    reserve(mirror, key, value)            room in the mirror for these new tokens (slide, or
                                           regrow into fresh slot bytes with the held tokens)
    mirror(layer) -> Mirror | None         the layer's mirror now, if fetched (no fetch)
    prefetch(layer)                        start fetching ``layer`` if a slot is free
    evict(layer)                           drop the layer's mirror (after crop, reorder ...)
    count_d2h(nbytes), count_host_wait(), stats(), nbytes(), close()
    side_stream(home) -> Stream            the side stream of that device, one per device (offload
                                           write-backs use it too)

Streams, events, device memory and ``record_stream`` come from the device runtime
(``tiercache.runtime``: CUDA, or the simulated device of the CPU tests), never from
``torch.cuda`` directly. A layer offers, read-only: ``key`` (from ``register``), ``depth`` (layers
fetched ahead), ``device`` (its compute device), ``home`` (its stream device, from the runtime;
None on the CPU), ``pad`` (its mirror's least capacity: a static layer's
max_length, else 0), ``host_kv()`` (its host copy, ``[B, H, S, D]`` views, or None; landed
write-backs joined first) and ``staged_kv()`` (the write-backs still staged, pinned: a fetch
copies them after the host copy, on the side stream that wrote them). The prefetcher never writes a layer's attributes; a ``Mirror`` it
has dropped is marked ``valid = False`` and holds no views.

Errors: a device buffer that cannot be allocated (``torch.OutOfMemoryError``) raises
``CacheError`` from ``acquire`` / ``reserve`` before any slot or mirror changes; a fetch *ahead*
that cannot get one is skipped (the layer is fetched, or reports, when it is used).

Safety (CUDA): a fetch runs on the side stream after ``wait_event(slot.release)``, the event
recorded on the compute stream when the slot's previous owner stopped being in use (its
attention was enqueued by then), so no buffer is overwritten while it is still read; the
compute stream ``wait_event(slot.ready)`` before reading a mirror, so no copy is read before it
lands. Slot memory is allocated on the compute stream and ``record_stream``-ed on the side one.
Each device has its own side stream; a slot whose bytes are on another device than the layer
it is given to gets fresh bytes on the layer's device (layers of one cache may sit on several
GPUs). At most ``depth + 1`` slots exist: the layer in use and the ones fetched ahead. Without
CUDA (no stream device) there is no stream or event; the copies are real, synchronous copies.

No host wait is needed to drop a mirror (``evict``: before the host copy changes in place, is
replaced or freed) or the slots (``close``): a fetch still in flight only fills a mirror nobody
reads again (a later fetch into the same slot is ordered after it on the same side stream; one
into fresh bytes waits for the compute stream); slot memory is ``record_stream``-ed on the side
stream, so freeing it waits for the fetch; a pinned host copy freed meanwhile is kept by torch's
pinned-memory allocator until the copies that read it are done (it records an event per
non-blocking copy); a pageable one (disk tier, ``pin_memory: false``) was read before the copy
call returned. The simulated device checks this: a fetch whose host source changes under it
copies poison, which nothing reads.

Counters (``stats()``; ``TieredCache.offload_stats()``): ``bytes_h2d`` (host -> device,
fetches: the bytes copied, including the free slack between rows that a one-span copy carries), ``bytes_d2h`` (new tokens written back), ``fetches`` and ``side_fetches`` (those
enqueued on a side stream), ``host_waits`` (times an offloaded layer had to block on a
write-back that had not landed yet: 0 in steady decoding), ``skipped_fetches`` (fetches ahead that
could not get device memory and were skipped: that layer is fetched, or reports, when used).
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from tiercache import runtime
from tiercache.errors import CacheError
from tiercache.layers import regrowth
from tiercache.layers.allowance import size_of
from tiercache.layers.tiers import by_place, nbytes_of
from tiercache.offload.mirror import Mirror, layout_bytes, mirror_capacity, plan

ALIGN = 2 << 20  # slot bytes grow in 2 MiB steps
COUNTERS = ("bytes_h2d", "bytes_d2h", "fetches", "side_fetches", "host_waits", "skipped_fetches")


class Slot:
    """One reusable device buffer: flat bytes, the layer that owns it, and its two events."""

    def __init__(self):
        self.data: torch.Tensor | None = None  # [nbytes] uint8 on the compute device
        self.home = None  # the stream device of `data` (None: the CPU, no streams)
        self.owner: int | None = None  # key of the layer whose mirror it holds
        self.ready = None  # event: the fetch into it has landed (side stream)
        self.release = None  # event: its last reader was enqueued before this (compute stream)

    def nbytes(self) -> int:
        return 0 if self.data is None else self.data.numel()

    def views(self, shapes, dtype: torch.dtype) -> list[torch.Tensor]:
        """Typed views laid end to end over the slot's bytes, one per shape."""
        out, offset = [], 0
        for shape in shapes:
            n = size_of(shape, dtype)
            out.append(self.data[offset : offset + n].view(dtype).view(shape))
            offset += n
        return out


class Prefetcher:
    def __init__(self):
        self.layers: dict[int, weakref.ref] = {}
        self.order: list[tuple[int, int]] = []  # (model layer index, key), sorted
        self.slots: list[Slot] = []
        self.mirrors: dict[int, Mirror] = {}  # layer key -> its mirror, while fetched
        self.current: int | None = None
        self.streams: dict = {}  # stream device -> its side stream, made at its first use
        self._next_key = 0
        for name in COUNTERS:  # bytes_h2d, bytes_d2h, fetches, ...: read by stats()
            setattr(self, name, 0)

    # -- registry ---------------------------------------------------------------------------
    def register(self, layer, index: int) -> int:
        key, self._next_key = self._next_key, self._next_key + 1
        self.layers[key] = weakref.ref(layer)
        self.order = sorted([*self.order, (index, key)])
        return key

    def unregister(self, layer) -> None:
        self.evict(layer)
        self.layers.pop(layer.key, None)
        self.order = [(i, k) for i, k in self.order if k != layer.key]

    # -- the schedule -----------------------------------------------------------------------
    def acquire(self, layer, room: int = 0) -> Mirror:
        """``layer`` is in use now: its mirror is ready on the compute stream; fetch ahead."""
        mirror = self.mirrors.get(layer.key)
        if self.current == layer.key and mirror is not None:
            return mirror
        wanted = [layer, *self._ahead(layer)]
        keep = {w.key for w in wanted}
        for slot in self.slots:
            if slot.owner is not None and slot.owner not in keep:
                self._release(slot)
        if layer.key not in self.mirrors:
            self._fetch(layer, room)
        mirror = self.mirrors[layer.key]
        self.current = layer.key
        self._wait(mirror.slot)
        for nxt in wanted[1:]:
            if nxt.key not in self.mirrors and not self._fetch_ahead(nxt):
                break
        return mirror

    def mirror(self, layer) -> Mirror | None:
        """The layer's mirror now, if it is fetched (nothing is fetched or waited for)."""
        return self.mirrors.get(layer.key)

    def prefetch(self, layer) -> None:
        """Start fetching ``layer`` ahead of use, if a slot is free (never evicts)."""
        if layer.key not in self.mirrors and any(s.owner is None for s in self.slots):
            self._fetch_ahead(layer)

    def evict(self, layer) -> None:
        """Forget the layer's mirror (no wait: see "Safety")."""
        mirror = self.mirrors.get(layer.key)
        if mirror is not None:
            self._release(mirror.slot)
        if self.current == layer.key:
            self.current = None

    def reserve(self, mirror: Mirror, key: torch.Tensor, value: torch.Tensor) -> None:
        """Room in ``mirror`` (acquired, in use) for the tokens of ``key`` / ``value`` after the
        held ones: slide the held tokens to the front, or move them to fresh, larger slot bytes
        (compute stream). Raises ``CacheError`` (device memory) before anything changes."""
        t = key.shape[2]
        if mirror.has_room(t):
            return
        need = mirror.held + t
        if mirror.k is not None and need <= mirror.capacity:
            mirror.slide()
            return
        cap = mirror_capacity(need, mirror.pad)
        old = mirror.kv() if mirror.held else None
        nbytes = layout_bytes(key, value, cap)
        slot = mirror.slot
        home = runtime.current().device_of(key)
        if old is not None or nbytes > slot.nbytes() or slot.home != home:
            slot.data = self._alloc(nbytes, home, key.device)  # fresh bytes: `old` stays valid
            slot.home = home
        mirror.relayout(cap, key, value, old)
        if old is not None:
            regrowth.record("device", nbytes_of(*old))

    def stats(self) -> dict[str, int]:
        """The counters (see the module docstring), by name."""
        return {name: getattr(self, name) for name in COUNTERS}

    def count_host_wait(self) -> None:
        self.host_waits += 1

    def side_stream(self, home):
        """The side stream of the stream device ``home`` (one per device, made at first use)."""
        if home not in self.streams:
            self.streams[home] = runtime.current().new_stream(home)
        return self.streams[home]

    def count_d2h(self, nbytes: int) -> None:
        self.bytes_d2h += nbytes

    # -- accounting and lifetime ------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        return by_place(slot.data for slot in self.slots if slot.data is not None)

    def close(self) -> None:
        for slot in self.slots:
            self._release(slot)
        self.slots = []
        self.mirrors = {}
        self.current = None

    # -- internals --------------------------------------------------------------------------
    def _ahead(self, layer) -> list:
        """The next ``layer.depth`` live offloaded layers after ``layer``, wrapping around."""
        keys = [k for _, k in self.order if self.layers.get(k) is not None and self.layers[k]() is not None]
        if layer.key not in keys or layer.depth <= 0:
            return []
        at = keys.index(layer.key)
        ahead = [keys[(at + j) % len(keys)] for j in range(1, min(layer.depth, len(keys) - 1) + 1)]
        return [self.layers[k]() for k in ahead]

    def _release(self, slot: Slot) -> None:
        mirror = self.mirrors.pop(slot.owner, None) if slot.owner is not None else None
        if mirror is not None:
            mirror.invalidate()
        slot.owner = None
        if slot.data is not None and slot.home is not None:
            rt = runtime.current()
            slot.release = rt.event()
            slot.release.record(rt.current_stream(slot.home))

    def _fetch_ahead(self, layer) -> bool:
        """Fetch ``layer`` ahead of its use; False (counted) when no device memory: fetching ahead
        is optional, that layer is fetched (or reports) when used."""
        try:
            self._fetch(layer, 1)
            return True
        except CacheError:
            self.skipped_fetches += 1
            return False

    def _fetch(self, layer, room: int) -> None:
        slot = next((s for s in self.slots if s.owner is None), None) or Slot()
        p = plan(layer.host_kv(), room, layer.pad, layer.staged_kv())  # host_kv may raise CacheError (a failed write-back)
        fresh = p is not None and (p.nbytes > slot.nbytes() or slot.home != layer.home)
        if fresh:  # may raise CacheError: then no slot is taken and nothing has changed
            slot.data = self._alloc(p.nbytes, layer.home, layer.device)  # the old bytes are not needed
            slot.home = layer.home
        if slot not in self.slots:
            self.slots.append(slot)
        slot.owner = layer.key
        mirror = self.mirrors[layer.key] = Mirror(slot, layer.pad)
        with self._side(slot, fresh):
            moved = mirror.fill(p)
        self.bytes_h2d += moved
        self.fetches += 1

    @contextlib.contextmanager
    def _side(self, slot: Slot, fresh: bool):
        """Run the enclosed copies on the side stream, ordered after the slot's release.

        Memory just allocated on the compute stream may have been freed there by work still
        queued: then the side stream waits for everything the compute stream has so far."""
        if slot.data is None or slot.home is None:
            slot.ready = None
            yield
            return
        rt = runtime.current()
        stream = self.side_stream(slot.home)
        if fresh:
            stream.wait_stream(rt.current_stream(slot.home))
        elif slot.release is not None:
            stream.wait_event(slot.release)
        with rt.use(stream):
            yield
        slot.ready = rt.event()
        slot.ready.record(stream)
        self.side_fetches += 1

    def _wait(self, slot: Slot) -> None:
        if slot.ready is not None and slot.data is not None and slot.home is not None:
            runtime.current().current_stream(slot.home).wait_event(slot.ready)

    def _alloc(self, nbytes: int, home, device) -> torch.Tensor:
        """``[nbytes]`` uint8 on the stream device ``home`` (None: plain memory on ``device``)."""
        nbytes = -(-nbytes // ALIGN) * ALIGN if torch.device(device).type == "cuda" else nbytes
        rt = runtime.current()
        try:  # on the compute stream
            data = torch.empty(nbytes, dtype=torch.uint8, device=device) if home is None else rt.device_empty(nbytes, home)
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            raise CacheError(
                f"offload: cannot allocate {nbytes} bytes on {device} for a layer's device copy: {e}; "
                "free device memory or lower offload.prefetch (the layer is unchanged)"
            ) from e
        if home is not None:
            rt.record_stream(data, self.side_stream(home))
        return data
