"""``Offload``: a layer whose authoritative copy lives on a host tier (pinned CPU memory or disk
files), brought to the compute device just before use.

    offloaded(make_storage_on, config, prefetcher, index, owned_outputs=False) -> Offload
        ``make_storage_on(tier)`` builds the storage layer (full | static | sliding) on the tier
        that ``config.device`` names: ``HostTier(pin_memory)`` for ``cpu``, ``DiskTier(path)``
        for ``disk``. The ``Prefetcher`` (``tiercache.processors.prefetch``) is shared by the
        offloaded layers of one cache. ``owned_outputs``: ``update`` returns copies, not views
        of the mirror (for a layer whose K/V the model reads after other layers' updates,
        which reuse the slots: KV sharing).

It is a layer (``tiercache.layers.base`` protocol) and reads the layer it wraps only through
that protocol. The device side is a *mirror* in a reusable slot of the prefetcher's pool: when
a layer is used (``update`` or ``kv``) the prefetcher makes its mirror ready and starts fetching
the next ``prefetch`` offloaded layers on a side stream. ``update`` writes the new tokens to
the mirror device-to-device and sends only those tokens to the host (device -> host, then the
inner layer appends them): never the whole layer per token. Any dtype works (the packed uint8
blocks of ``Quantize`` cross the bus compressed), and keys and values may differ in head dim.

``peek()`` (and ``keys`` / ``values``) bypass the mirror and the prefetcher: they copy the host
copy to the compute device, so reading them never evicts the slot another layer is using.

Errors: an update's shape, dtype, device and room are checked once before it reaches the layer
(``tiercache.layers.validate``); the host write happens before the mirror changes, so one the
inner layer still rejects (``CacheError``: disk full) leaves the layer as it was; device memory for the mirror is found before that, so running out of it (``CacheError``
from the prefetcher) changes nothing either. Crop / reorder / select / repeat_interleave / set_recording / reset act on the host copy
and drop the mirror (the next use fetches it again).

``nbytes()`` reports the host tier only (``"cpu"`` or ``"disk"``). The mirrors belong to the
prefetcher, which reports them once for the whole cache (``Prefetcher.nbytes()``, added by
``TieredCache.nbytes``); on a CPU-only run the "device" is the CPU, so they appear under
``"cpu"`` as well: they are real extra bytes there.

Without CUDA the compute device and the host are both the CPU: every copy still happens through
the same code (fetch, append, write-back), with no stream or event, and results are
bit-identical to a resident layer.

Write-back (``tiercache.processors.writeback``): on CUDA, for full storage in pinned host memory
(``deferred``), the new tokens reach the host layer without a host sync and join it at the
layer's next use at the latest: every use, host-side and lifecycle operation calls ``_settle``
first; ``seq_length`` and ``mask_sizes`` count the staged tokens. Elsewhere it is synchronous.
"""

from __future__ import annotations

import dataclasses

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.layers.buffer import capacity_for
from tiercache.layers.spec import KVSpec, check_pair
from tiercache.layers.state import expect, nest, part
from tiercache.policy import OffloadPolicy
from tiercache.processors import writeback
from tiercache.processors.prefetch import Prefetcher
from tiercache.tiers import HostTier

__all__ = ["Offload", "Prefetcher", "offloaded"]


def offloaded(make_storage_on, config: OffloadPolicy, prefetcher: Prefetcher, index: int,
              owned_outputs: bool = False) -> "Offload":
    """Build the storage on the tier ``config`` names and wrap it in ``Offload``."""
    if config.device == "disk":
        from tiercache.processors.disk import DiskTier

        tier = DiskTier(config.path, label=f"layer{index}")
    else:
        tier = HostTier(config.pin_memory)
    return Offload(make_storage_on(tier), prefetcher, index, depth=config.prefetch, owned_outputs=owned_outputs,
                   deferred=config.device == "cpu")


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


class Offload(KVLayer):
    def __init__(self, inner: KVLayer, prefetcher: Prefetcher, index: int = 0, depth: int = 1,
                 owned_outputs: bool = False, deferred: bool = False):
        if depth < 0:
            raise CacheError(f"offload prefetch depth must be >= 0, got {depth}")
        self.inner = inner
        self.owned_outputs = owned_outputs
        self.prefetcher = prefetcher
        self.index = index
        self.depth = depth
        self.is_sliding = inner.is_sliding
        limit = inner.max_length()
        self.pad = limit if (not inner.is_sliding and limit > 0) else 0  # static: views span max_length
        self.device: torch.device | None = None  # the compute device, from the first update
        self.slot = None  # set and cleared by the prefetcher
        self.k: torch.Tensor | None = None  # [B, H, C, Dk] mirror in the slot
        self.v: torch.Tensor | None = None  # [B, H, C, Dv]
        self.lo = 0  # first held token in the mirror
        self.held = 0  # tokens held (== what inner.kv() holds once the staged write-backs have joined it)
        # CUDA write-backs not yet in the host layer: (keys, values, event), oldest first (full storage only)
        self.deferred = deferred and not inner.is_sliding and inner.max_length() <= 0
        self.staged: list[tuple[torch.Tensor, torch.Tensor, object]] = []
        self.key = prefetcher.register(self, index)

    # -- the protocol -----------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = key.shape[2]  # shape, dtype, batch, device, room: checked once (layers/validate.py)
        self._settle()  # earlier write-backs join the host layer first (they may regrow it)
        defer = writeback.defers(self, key)
        host_k, host_v = writeback.staging(key, value) if defer else writeback.to_host(key, value)  # [B, H, T, D] on the CPU
        self.device = key.device
        self.prefetcher.acquire(self, room=t)  # may raise CacheError (device memory): nothing changed
        if self.k is None or self.lo + self.held + t > self.k.shape[2]:
            self._make_room(key, value)  # likewise, before the host copy changes
        if defer:  # full storage: it will show every held token
            writeback.write_back(self, key, value, host_k, host_v)
            shown = self.held + t
        else:
            out = self.inner.append(host_k, host_v)  # may still raise (disk full): the mirror holds the same tokens
            shown = out[0].shape[2]
        self.prefetcher.count_d2h(_bytes(key) + _bytes(value))
        self._append(key, value)
        n = self.held
        a = self.lo + n - shown if shown <= n else self.lo  # the inner's answer, on the device
        result = self.k[:, :, a : a + shown], self.v[:, :, a : a + shown]
        if not defer:
            kept = self.inner.kv()
            kept = 0 if kept is None else kept[0].shape[2]
            self.lo, self.held = self.lo + n - kept, kept  # the inner keeps a suffix of held + new
        if self.owned_outputs:
            return result[0].clone(), result[1].clone()
        return result

    def layout(self):
        """The host layer's layout on the compute device (a staged first write-back counts)."""
        spec = self.inner.layout()
        if spec is None and self.staged:
            spec = KVSpec.read(*self.staged[0][:2])
        return None if spec is None else dataclasses.replace(spec, device=self.device)

    def seq_length(self) -> int:
        return self.inner.seq_length() + writeback.staged_tokens(self)

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length, offset = self.inner.mask_sizes(query_length)
        return kv_length + writeback.staged_tokens(self), offset  # staged only on full storage: no window offset

    def max_length(self) -> int:
        return self.inner.max_length()

    def validate_crop(self, n: int) -> None:
        self._settle()
        self.inner.validate_crop(n)

    def crop(self, n: int) -> None:
        self._on_host("crop", n)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._on_host("reorder", beam_idx)

    def select(self, indices: torch.Tensor) -> None:
        self._on_host("select", indices)

    def repeat_interleave(self, repeats: int) -> None:
        self._on_host("repeat_interleave", repeats)

    def set_recording(self, on: bool) -> None:
        self._on_host("set_recording", on)

    @property
    def recording(self) -> bool:
        return self.inner.record_past

    def reset(self) -> None:
        self._on_host("reset")
        self.device = None

    def close(self) -> None:
        self.staged = []  # the layer is dropped: its pending write-backs are of no use
        self.prefetcher.unregister(self)
        self.inner.close()
        self.device = None

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        self._settle()
        if self.inner.kv() is None:
            return None
        self.prefetcher.acquire(self)
        return self.k[:, :, self.lo : self.lo + self.held], self.v[:, :, self.lo : self.lo + self.held]

    def peek(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A copy of the host copy on the compute device, read through the wrapped layer's
        ``peek()``: no slot acquired, no mirror evicted, no prefetch started. Costs one host ->
        device copy of the layer (a disk tier: a read of its files) per call."""
        self._settle()  # the host copy holds every token (a staged write-back joins it first)
        held = self.inner.peek()
        if held is None:
            return None
        device = self.device if self.device is not None else held[0].device
        return held[0].to(device, copy=True), held[1].to(device, copy=True)  # [B, H, S, D]

    @property
    def is_initialized(self) -> bool:
        return bool(self.staged) or self.inner.is_initialized  # a staged first update counts

    def nbytes(self) -> dict[str, int]:
        self._settle()
        return self.inner.nbytes()  # the device mirror is the prefetcher's (see module docstring)

    def tier_nbytes(self) -> dict[str, int]:
        self._settle()
        return self.inner.tier_nbytes()

    def batch_size(self) -> int | None:
        return self.inner.batch_size()

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
        self._settle()
        self.prefetcher.evict(self)
        self.device = None
        self.inner.load_state_dict(part(sd, "inner."))
        self.device = None if device is None else torch.device(device)

    def export(self):
        """The host copy, on the compute device (a copy there when that is not the CPU)."""
        self._settle()
        held = self.inner.export()
        if held is None or self.device is None or held[0].device == self.device:
            return held
        k, v, seen = held
        return k.to(self.device), v.to(self.device), seen

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        check_pair(key, value)
        self._settle()
        self.prefetcher.evict(self)
        host_k, host_v = writeback.to_host(key, value) if key.shape[2] else (key.cpu(), value.cpu())
        self.inner.ingest(host_k, host_v, seen)
        self.device = key.device

    def evict(self) -> None:
        self._settle()
        self.prefetcher.evict(self)
        self.k = self.v = None  # the slot's memory is no longer held through this layer
        self.lo = self.held = 0

    def prefetch(self) -> None:
        if self.device is not None and self.inner.kv() is not None:
            self.prefetcher.prefetch(self)

    # -- prefetcher callbacks ---------------------------------------------------------------
    def plan_fetch(self, room: int):
        """Bytes the mirror needs to hold the host copy plus ``room`` tokens; the plan for fill."""
        self._settle()
        held = self.inner.kv()
        if held is None:
            return 0, None
        hk, hv = held  # [B, H, S, D] host views
        s = hk.shape[2]
        ck, cv = row_stride(hk), row_stride(hv)
        # One flat copy per tensor when the host rows allow it; an update needing more room than
        # the host rows have regrows the mirror on the device (cheap next to the bus).
        flat = ck is not None and ck == cv and ck >= self.pad and hk.shape[0] * hk.shape[1] > 0
        cap = ck if flat else max(capacity_for(s + room), self.pad)
        return _layout_bytes(hk, hv, cap), (hk, hv, cap, flat)

    def fill(self, slot, plan) -> int:
        """Copy the host layer into ``slot`` (the side stream is current); returns bytes moved."""
        if plan is None:
            self.k = self.v = None
            self.lo = self.held = 0
            return 0
        hk, hv, cap, flat = plan
        b, h, s = hk.shape[:3]
        self.k, self.v = slot.views([(b, h, cap, hk.shape[3]), (b, h, cap, hv.shape[3])], hk.dtype)
        for dst, src in ((self.k, hk), (self.v, hv)):
            if flat:  # one contiguous span: rows of `cap` tokens, the last one cut at `s`
                n = ((b * h - 1) * cap + s) * src.shape[3]
                dst.view(-1)[:n].copy_(src.as_strided((n,), (1,)), non_blocking=True)
            else:
                dst[:, :, :s].copy_(src, non_blocking=True)
            if self.pad:
                dst[:, :, s:].zero_()  # static: attention reads the masked tail; keep it finite
        self.lo, self.held = 0, s
        return _bytes(hk) + _bytes(hv)

    # -- internals --------------------------------------------------------------------------
    def _settle(self) -> None:
        writeback.settle(self)

    def _on_host(self, method: str, *args) -> None:
        self._settle()
        self.prefetcher.evict(self)  # waits for any fetch reading the host copy
        getattr(self.inner, method)(*args)

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write the new tokens after the held ones in the mirror (device to device)."""
        t = key.shape[2]
        if self.k is None or self.lo + self.held + t > self.k.shape[2]:
            self._make_room(key, value)
        end = self.lo + self.held
        self.k[:, :, end : end + t].copy_(key)
        self.v[:, :, end : end + t].copy_(value)
        self.held += t

    def _make_room(self, key: torch.Tensor, value: torch.Tensor) -> None:
        need = self.held + key.shape[2]
        if self.k is not None and need <= self.k.shape[2]:  # slide the held tokens to the front
            for m in (self.k, self.v):
                m[:, :, : self.held].copy_(m[:, :, self.lo : self.lo + self.held].clone())
            self.lo = 0
            return
        cap = max(capacity_for(need), self.pad)
        b, h = key.shape[:2]
        shapes = [(b, h, cap, key.shape[3]), (b, h, cap, value.shape[3])]
        old = (self.k[:, :, self.lo : self.lo + self.held], self.v[:, :, self.lo : self.lo + self.held]) if self.held else None
        nbytes = _layout_bytes(key, value, cap)
        if old is not None or nbytes > self.slot.nbytes():
            self.prefetcher.grow(self.slot, nbytes, key.device)  # fresh bytes: `old` stays valid
        self.k, self.v = self.slot.views(shapes, key.dtype)
        if self.pad:
            self.k.zero_()
            self.v.zero_()
        if old is not None:
            self.k[:, :, : self.held].copy_(old[0])
            self.v[:, :, : self.held].copy_(old[1])
        self.lo = 0


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _layout_bytes(k: torch.Tensor, v: torch.Tensor, cap: int) -> int:
    b, h = k.shape[:2]
    return b * h * cap * (k.shape[3] + v.shape[3]) * k.element_size()
