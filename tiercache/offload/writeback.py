"""How ``Offload`` sends an update's new tokens to its host layer.

Interface (used by ``tiercache.offload.processor.Offload``; ``layer`` is the Offload)
    to_host(key, value) -> (host_k, host_v)     synchronous: the tensors on CPU, else a pinned copy, waited for
    defers(layer, key) -> bool                  whether this update's write-back is staged
    staging(key, value) -> [host_k, host_v]     pinned host tensors for a staged write-back
    write_back(layer, key, value, host_k, host_v)   enqueue the staged copy (no host sync)
    Staged(prefetcher, index)                   the layer's queue of staged write-backs (``layer.staged``):
        push(host_k, host_v, done), len(), tokens() (staged, not yet in the host layer), first(),
        pending(), settle(inner, block) (join them to the host layer ``inner``; ``block``: waiting
        for those in flight, else only the landed ones), clear(), failed
The module reads the layer (``deferred``, ``prefetcher``, ``inner``, ``staged``) and changes
only its ``Staged`` queue, through the queue's methods.

Streams, events, pinned memory and ``record_stream`` come from the device runtime
(``tiercache.runtime``); "CUDA" below means any stream device (the simulated one too).

Write-back on CUDA (``deferred``: full or static storage in pinned host memory, the ``cpu`` tier): the new
tokens are copied into a pinned staging pair on the side stream of their device (after it waits for
the compute stream; ``record_stream`` keeps their device memory alive), with an event; the
update returns at once, no host sync. The staged tokens join the host layer once the event has
landed: the layer's uses (``update``, ``kv``, a fetch of its mirror) join the landed ones
(``query()``, never a wait); a host-side or lifecycle operation (and ``nbytes``) joins all of them,
blocking (counted in ``offload_stats()["host_waits"]``) on one still in flight. A fetch of the
mirror copies the host copy, then the pairs still staged from their pinned staging, on the side
stream that wrote them: ordered after the write-backs, with no host wait.
``seq_length`` and ``mask_sizes`` count the staged tokens. An error from the host tier (a CUDA
error of the copy, the host buffer that cannot grow) raises ``CacheError`` naming the layer when
it surfaces, and at every later use of the layer until it is reset or its state replaced
(``Staged.failed``).

Sliding and disk host layers copy synchronously (one event wait per update, after the layer's
mirror was acquired: the host copy changes only once its fetch has landed). Why not sliding:
what a sliding layer shows and keeps for an update (the window's tail; a long update's fresh
tensors; every token while recording) is decided by its ``append``, and the mirror follows that
answer (``Mirror.keep``); deferring the append would have ``Offload`` predict the window's rules
instead of asking the layer, which the layer protocol does not offer. Its window is small, so the
wait costs latency, not bandwidth. Disk: the host tier is pageable memory-mapped files, which a
non-blocking copy cannot target (CUDA copies to pageable memory synchronously anyway). Static
storage (not padded) is deferred like full storage: it shows every held token and keeps them all.

Every lifecycle operation of the layer settles first (``state_dict``, ``export``: fork, save,
retier read every token; ``load_state_dict``, ``ingest``, ``evict`` replace or drop the host
copy, so no staged pair joins a new state later).
"""

from __future__ import annotations

import torch

from tiercache import runtime
from tiercache.errors import CacheError


def to_host(key: torch.Tensor, value: torch.Tensor):
    """The new tokens on the CPU: the tensors themselves on CPU, else a pinned copy, waited for."""
    rt = runtime.current()
    home = rt.device_of(key)
    if home is None:
        return key, value
    out = staging(key, value)
    for host, t in zip(out, (key, value)):
        host.copy_(t, non_blocking=True)
    done = rt.event()
    done.record(rt.current_stream(home))
    done.synchronize()
    return out


def defers(layer, key: torch.Tensor) -> bool:
    """Whether this update's write-back is staged (a stream device, full or static storage in host memory)."""
    return layer.deferred and runtime.current().device_of(key) is not None


def staging(key: torch.Tensor, value: torch.Tensor):
    """Pinned host tensors shaped like ``key`` / ``value``, for their write-back."""
    rt = runtime.current()
    return [rt.pinned_empty(t.shape, t.dtype) for t in (key, value)]


def write_back(layer, key, value, host_k, host_v) -> None:
    """Enqueue the device -> host copy of the new tokens on their device's side stream; no host sync."""
    rt = runtime.current()
    home = rt.device_of(key)
    stream = layer.prefetcher.side_stream(home)
    stream.wait_stream(rt.current_stream(home))  # the tokens are written on the compute stream
    with rt.use(stream):
        host_k.copy_(key, non_blocking=True)
        host_v.copy_(value, non_blocking=True)
    for t in (key, value):
        rt.record_stream(t, stream)  # their memory is not reused before the copy has read it
    done = rt.event()
    done.record(stream)
    layer.staged.push(host_k, host_v, done)


class Staged:
    """One layer's write-backs not yet in its host layer: (keys, values, event), oldest first.

    A write-back that fails (a CUDA error of the copy; the host layer refusing the tokens: disk
    full, a buffer that cannot grow) leaves the host copy without tokens the device copy had.
    The queue then stays *failed*: every later ``settle`` raises the same ``CacheError`` (the
    first one may surface where it is dropped: an optional fetch ahead of the layer's use), until
    ``clear()`` (the layer is reset, replaced or closed)."""

    def __init__(self, prefetcher, index: int):
        self.prefetcher = prefetcher  # counts the waits (``count_host_wait``)
        self.index = index  # the model layer, for errors
        self.pairs: list[tuple[torch.Tensor, torch.Tensor, object]] = []  # [B, H, T, D] pinned, event
        self.failed: str | None = None  # why the host copy lacks tokens (then every settle raises)

    def __len__(self) -> int:
        return len(self.pairs)

    def push(self, host_k: torch.Tensor, host_v: torch.Tensor, done) -> None:
        self.pairs.append((host_k, host_v, done))

    def tokens(self) -> int:
        return sum(k.shape[2] for k, _, _ in self.pairs)

    def first(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The oldest staged keys and values ``[B, H, T, D]`` (what a first update looked like), or None."""
        return self.pairs[0][:2] if self.pairs else None

    def clear(self) -> None:
        self.pairs = []
        self.failed = None

    def pending(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The staged keys and values, oldest first (``[B, H, T, D]`` pinned; maybe not landed)."""
        return [(k, v) for k, v, _ in self.pairs]

    def settle(self, inner, block: bool = True) -> None:
        """Append the landed pairs to ``inner`` (the host layer), oldest first; ``block``: every
        pair, waiting for those in flight (counted in ``host_waits``); else stop at the first one
        in flight (never a wait)."""
        if self.failed is not None:
            raise CacheError(self.failed)
        while self.pairs:
            host_k, host_v, done = self.pairs[0]
            try:
                if not done.query():
                    if not block:
                        return
                    self.prefetcher.count_host_wait()
                    done.synchronize()
            except RuntimeError as e:  # a CUDA error of the copy
                self._fail(f"the write-back of layer {self.index}'s new tokens to the host failed ({e})", e)
            self.pairs.pop(0)
            try:
                inner.append(host_k, host_v)
            except (CacheError, RuntimeError) as e:  # disk full; torch.OutOfMemoryError is a RuntimeError
                self._fail(f"layer {self.index}'s host copy could not take its new tokens ({e}); "
                           "its device copy has them, the host copy does not", e)

    def _fail(self, why: str, cause: BaseException):
        self.pairs = []
        self.failed = f"offload: {why}; reset the cache"
        raise CacheError(self.failed) from cause
