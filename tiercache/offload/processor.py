"""``Offload``: a layer whose authoritative copy lives on a host tier (pinned CPU memory or disk
files), brought to the compute device just before use.

    offloaded(make_storage_on, config, prefetcher, index, owned_outputs=False) -> Offload
        ``make_storage_on(tier)`` builds the storage layer (full | static | sliding) on the tier
        that ``config.device`` names: ``HostTier(pin_memory)`` for ``cpu``, ``DiskTier(path)``
        for ``disk``. The ``Prefetcher`` (``tiercache.offload.prefetch``) is shared by the
        offloaded layers of one cache. ``owned_outputs``: ``update`` returns copies, not views
        of the mirror (for a layer whose K/V the model reads after other layers' updates,
        which reuse the slots: KV sharing).

It is a layer (``tiercache.layers.base`` protocol) and reads the layer it wraps only through
that protocol. The device side is a *mirror* (``tiercache.offload.mirror.Mirror``) in a
reusable slot of the prefetcher's pool, owned by the prefetcher: when a layer is used
(``update`` or ``kv(fetch=True)``) ``prefetcher.acquire`` makes its mirror ready, returns it and starts
fetching the next ``prefetch`` offloaded layers on a side stream. ``update`` asks the
prefetcher for room (``reserve``), writes the new tokens to the mirror device-to-device
(``mirror.append``) and sends only those tokens to the host (device -> host, then the inner
layer appends them): never the whole layer per token. The layer holds no reference to its
mirror between calls; it offers the prefetcher ``host_kv()`` and ``pad`` to fetch it. Any
dtype works (the packed uint8 blocks of ``Quantize`` cross the bus compressed), and keys and
values may differ in head dim.

A sliding host layer (not recording) given more tokens at once than a window's mirror holds (a
long prompt) answers them in fresh tensors, as a resident sliding layer does, and its mirror keeps
only the window: device slots never grow to the prompt's length (they never shrink).

``kv()`` (and ``keys`` / ``values``) bypass the mirror and the prefetcher: they copy the host
copy to the compute device, so reading them never evicts the slot another layer is using.

Errors: an update's shape, dtype, device and room are checked once before it reaches the layer
(``tiercache.layers.validate``); the host write happens before the mirror changes, so one the
inner layer still rejects (``CacheError``: disk full) leaves the layer as it was; device memory for the mirror is found before that, so running out of it (``CacheError``
from the prefetcher) changes nothing either. Crop / reorder / select / repeat_interleave / set_recording / reset act on the host copy
and drop the mirror (the next use fetches it again).

Lifecycle: the host copy is the state (``state_dict``, ``export``, ``ingest``). ``adopt(other)``
takes another ``Offload``'s host copy host to host (retier between offload policies: another
tier, storage or prefetch depth), where ``ingest(*other.export())`` would bring it to the
compute device and back.

``nbytes()`` reports the host tier only (``"cpu"`` or ``"disk"``). The mirrors belong to the
prefetcher, which reports them once for the whole cache (``Prefetcher.nbytes()``, added by
``TieredCache.nbytes``); on a CPU-only run the "device" is the CPU, so they appear under
``"cpu"`` as well: they are real extra bytes there.

Without a stream device the compute device and the host are both the CPU: every copy still happens through
the same code (fetch, append, write-back), with no stream or event, and results are
bit-identical to a resident layer.

Write-back (``tiercache.offload.writeback``): on CUDA, for full and static storage in pinned
host memory (``deferred``), the new tokens reach the host layer without a host sync; they join it
once landed (checked with ``query()`` at the layer's uses, never a wait) and at the latest at a
host-side or lifecycle operation (``_settle``, which waits); a fetch meanwhile copies the staged
tokens from their pinned staging after the host copy, on the side stream that wrote them;
``seq_length`` and ``mask_sizes`` count the staged tokens. Elsewhere (sliding, disk) it is
synchronous, after the mirror is acquired. A write-back that failed refuses every use
(``CacheError``) until ``reset`` (which drops pending write-backs) or a replacing ``ingest`` /
``load_state_dict`` / ``adopt``.

Streams, events, pinned memory and device memory come from the device runtime
(``tiercache.runtime``): CUDA, or the simulated device the CPU tests run this same
code on (``tiercache.simdevice``).
"""

from __future__ import annotations

import dataclasses

import torch

from tiercache import runtime
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.layers.delegating import Delegating
from tiercache.layers.spec import KVSpec, check_pair
from tiercache.layers.state import expect, nest, part
from tiercache.layers.tiers import HostTier, nbytes_of
from tiercache.offload import writeback
from tiercache.offload.mirror import mirror_capacity, row_stride
from tiercache.offload.prefetch import Prefetcher
from tiercache.policy.schema import OffloadPolicy

__all__ = ["Offload", "Prefetcher", "offloaded", "row_stride"]


def offloaded(make_storage_on, config: OffloadPolicy, prefetcher: Prefetcher, index: int,
              owned_outputs: bool = False) -> "Offload":
    """Build the storage on the tier ``config`` names and wrap it in ``Offload``."""
    if config.device == "disk":
        from tiercache.offload.disk import DiskTier

        tier = DiskTier(config.path, label=f"layer{index}")
    else:
        tier = HostTier(config.pin_memory)
    return Offload(make_storage_on(tier), prefetcher, index, depth=config.prefetch, owned_outputs=owned_outputs,
                   deferred=config.device == "cpu")


class Offload(Delegating):
    def __init__(self, inner: KVLayer, prefetcher: Prefetcher, index: int = 0, depth: int = 1,
                 owned_outputs: bool = False, deferred: bool = False):
        if depth < 0:
            raise CacheError(f"offload prefetch depth must be >= 0, got {depth}")
        super().__init__(inner)
        self.owned_outputs = owned_outputs
        self.prefetcher = prefetcher
        self.index = index
        self.depth = depth
        limit = inner.max_length()
        self.pad = limit if (not inner.is_sliding and limit > 0) else 0  # static: views span max_length
        self.device: torch.device | None = None  # the compute device, from the first update (sets `home`)
        # CUDA write-backs not yet in the host layer, oldest first (full and static storage; not a
        # padded static layer, whose answer spans max_length): see writeback.py for sliding
        self.deferred = deferred and not inner.is_sliding and not inner.is_compileable
        self.staged = writeback.Staged(prefetcher, index)
        self.key = prefetcher.register(self, index)

    # -- the protocol -----------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = key.shape[2]  # shape, dtype, batch, device, room: checked once (layers/validate.py)
        self._settle(block=False)  # landed write-backs join the host layer (they may regrow it); never a wait
        defer = writeback.defers(self, key)
        self._on(key)
        if self._long_sliding(t):
            return self._append_long(key, value)
        mirror = self.prefetcher.acquire(self, room=t)  # may raise CacheError (device memory): nothing changed
        self.prefetcher.reserve(mirror, key, value)  # likewise, before the host copy changes
        if defer:  # full or static storage: it will show every held token
            writeback.write_back(self, key, value, *writeback.staging(key, value))  # [B, H, T, D] pinned
            shown = mirror.held + t
        else:
            # The host sync after acquire: the compute stream has waited for this layer's fetch, so
            # the host copy (a sliding window slides down in place) never changes under its read.
            host_k, host_v = writeback.to_host(key, value)  # [B, H, T, D] on the CPU
            out = self.inner.append(host_k, host_v)  # may still raise (disk full): the mirror holds the same tokens
            shown = out[0].shape[2]
        self.prefetcher.count_d2h(nbytes_of(key, value))
        mirror.append(key, value)
        result = mirror.shown(shown)  # the inner's answer, on the device
        if not defer:
            kept = self.inner.kv()
            mirror.keep(0 if kept is None else kept[0].shape[2])  # the inner keeps a suffix of held + new
        if self.owned_outputs:
            return result[0].clone(), result[1].clone()
        return result

    def _long_sliding(self, t: int) -> bool:
        """A sliding host layer (not recording) given more tokens than a window's mirror holds
        (a long prompt): its mirror is not grown for them (slots never shrink)."""
        inner = self.inner
        if not inner.is_sliding or inner.record_past or t <= 1:
            return False
        held = inner.kv()
        return (0 if held is None else held[0].shape[2]) + t > mirror_capacity(inner.window)

    def _append_long(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As a resident sliding layer's long update: the answer (held + new) in fresh tensors,
        the mirror then holds only what the host layer keeps (its window), in its own room."""
        mirror = self.prefetcher.acquire(self, room=1)  # may raise CacheError (device memory): nothing changed
        held_k, held_v = mirror.kv() if mirror.k is not None else (key[:, :, :0], value[:, :, :0])
        k, v = torch.cat([held_k, key], dim=2), torch.cat([held_v, value], dim=2)  # [B, H, held + T, D], fresh
        room = min(k.shape[2], self.inner.window - 1)
        try:
            mirror.keep(0)  # its tokens are in k / v now; the window is written back below
            self.prefetcher.reserve(mirror, k[:, :, :room], v[:, :, :room])
            out = self.inner.append(*writeback.to_host(key, value))  # may raise (disk full)
        except CacheError:
            self.prefetcher.evict(self)  # the host copy is as it was; the next use fetches it again
            raise
        self.prefetcher.count_d2h(nbytes_of(key, value))
        kept = self.inner.kv()
        n = 0 if kept is None else kept[0].shape[2]
        mirror.append(k[:, :, k.shape[2] - n:], v[:, :, v.shape[2] - n:])
        shown = out[0].shape[2]
        return k[:, :, k.shape[2] - shown:], v[:, :, v.shape[2] - shown:]

    def layout(self):
        """The host layer's layout on the compute device (a staged first write-back counts: so do
        ``batch_size()`` and ``is_initialized``, derived from it)."""
        spec = self.inner.layout()
        first = self.staged.first()
        if spec is None and first is not None:
            spec = KVSpec.read(*first)
        return None if spec is None else dataclasses.replace(spec, device=self.device)

    def seq_length(self) -> int:
        return self.inner.seq_length() + self.staged.tokens()

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length, offset = self.inner.mask_sizes(query_length)
        return kv_length + self.staged.tokens(), offset  # staged only on full / static storage: no window offset

    def validate_crop(self, n: int) -> None:
        self._settle()
        self.inner.validate_crop(n)

    def changing(self) -> None:
        """Host-side operations (crop, gather, set_recording, evict: ``Delegating``): pending write-backs
        join the host copy, the mirror is dropped, then the host layer changes; the next use fetches it again."""
        self._settle()
        self.prefetcher.evict(self)  # drops the mirror (a fetch in flight fills it for nobody)

    def reset(self) -> None:
        self.staged.clear()  # pending write-backs (or a failed one) are of no use: the layer empties
        self.prefetcher.evict(self)
        self.inner.reset()
        self.device = None

    def close(self) -> None:
        self.staged.clear()  # the layer is dropped: its pending write-backs are of no use
        self.prefetcher.unregister(self)
        self.inner.close()
        self.device = None

    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``fetch``: the device mirror (acquired from the prefetcher, which starts the next
        prefetch). Else a copy of the host copy on the compute device: no slot acquired, no mirror
        evicted, no prefetch started; one host -> device copy (a disk tier: a read of its files)."""
        if fetch:
            self._settle(block=False)
            if self.inner.kv() is None and not self.staged:
                return None
            return self.prefetcher.acquire(self).kv()
        self._settle()  # the host copy holds every token (a staged write-back joins it first)
        held = self.inner.kv()
        if held is None:
            return None
        device = self.device if self.device is not None else held[0].device
        return held[0].to(device, copy=True), held[1].to(device, copy=True)  # [B, H, S, D]

    def nbytes(self) -> dict[str, int]:
        self._settle_unless_failed()
        return self.inner.nbytes()  # the device mirror is the prefetcher's (see module docstring)

    def tier_nbytes(self) -> dict[str, int]:
        self._settle_unless_failed()
        return self.inner.tier_nbytes()

    # -- lifecycle: the host copy is the state; the mirror is never part of it ------------------
    # Each method settles pending write-backs first: the host copy must hold every token before
    # it is read (state_dict, export: fork, save, retier) and before it is replaced
    # (load_state_dict, ingest), else a staged pair would join the new state at the next use.
    def state_dict(self) -> dict:
        self._settle()
        return {"kind": "offload", "device": None if self.device is None else str(self.device),
                **nest("inner.", self.inner.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, "offload")
        device = sd.get("device")
        if device is not None and not isinstance(device, str):
            raise CacheError(f"state of an offload layer: device should be a string or None, got {device!r}")
        self._before_replace()
        self.device = None
        self.inner.load_state_dict(part(sd, "inner."))
        self.staged.clear()
        self.device = device  # the setter stores it canonical (``cuda`` -> ``cuda:0``)

    export = KVLayer.export  # ``kv()``: a copy of the host copy on the compute device, with ``seq_length()``

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        check_pair(key, value)
        self._before_replace()
        host_k, host_v = writeback.to_host(key, value) if key.shape[2] else (key.cpu(), value.cpu())
        self.inner.ingest(host_k, host_v, seen)
        self.staged.clear()
        self._on(key)

    def can_adopt(self, other: KVLayer) -> bool:
        return isinstance(other, Offload)

    def adopt(self, other: "Offload") -> None:
        """Take another offloaded layer's host copy host to host (``retier`` between offload
        policies: another tier, storage or prefetch depth), never through the compute device as
        ``ingest(*other.export())`` would go; the wrapped layer ingests it (its checks apply)."""
        held = other.host_export()
        self._before_replace()
        if held is None:
            self.reset()
            return
        self.inner.ingest(*held)
        self.staged.clear()
        self.device = other.device
        self.home = other.home

    def host_export(self):
        """The host copy as the wrapped layer exports it (host tensors, ``seen``), staged write-backs joined."""
        self._settle()
        return self.inner.export()

    def prefetch(self) -> None:
        if self.device is not None and self.inner.kv() is not None:
            self.prefetcher.prefetch(self)

    # -- what the prefetcher reads to fetch the mirror (and ``key``, ``depth``, ``device``, ``home``, ``pad``)
    def host_kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The host copy, ``[B, H, S, D]`` views, the landed write-backs joined first (no wait)."""
        self._settle(block=False)
        return self.inner.kv()

    def staged_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The write-backs still staged (pinned ``[B, H, T, D]``, oldest first), after ``host_kv()``:
        a fetch copies them after the host copy, on the side stream that wrote them (so after
        they land there), instead of waiting for them on the host."""
        return self.staged.pending()

    # -- internals --------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        return self._device

    @device.setter
    def device(self, device) -> None:
        """The compute device; ``home`` (the stream device the prefetcher allocates the mirror on,
        None on the CPU) follows it, from the runtime."""
        self._device = None if device is None else runtime.canonical_device(device)
        self.home = None if device is None else runtime.current().home_of(device)

    def _on(self, key: torch.Tensor) -> None:
        """The layer computes where ``key`` is (its stream device from the tensor: the exact one)."""
        self._device = key.device
        self.home = runtime.current().device_of(key)

    def _settle(self, block: bool = True) -> None:
        self.staged.settle(self.inner, block)

    def _settle_unless_failed(self) -> None:
        """Settle, unless a write-back already failed: then ``nbytes()`` still counts what is held
        (the failure is reported by the layer's use), and a replacing state may take its place."""
        if self.staged.failed is None:
            self._settle()

    def _before_replace(self) -> None:
        """Before the host copy is replaced (``ingest``, ``load_state_dict``, ``adopt``): pending
        write-backs join it, so a refused replacement leaves the layer as it was; a failed one
        (``Staged.failed``) is not raised: the new state replaces the broken copy."""
        self._settle_unless_failed()
        self.prefetcher.evict(self)  # drops the mirror (a fetch in flight fills it for nobody)
