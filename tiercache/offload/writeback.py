"""How ``Offload`` sends an update's new tokens to its host layer.

Interface (used by ``tiercache.offload.processor.Offload``; ``layer`` is the Offload)
    to_host(key, value) -> (host_k, host_v)     synchronous: the tensors on CPU, else a pinned copy, waited for
    defers(layer, key) -> bool                  whether this update's write-back is staged
    staging(key, value) -> [host_k, host_v]     pinned host tensors for a staged write-back
    write_back(layer, key, value, host_k, host_v)   enqueue the staged copy (no host sync)
    staged_tokens(layer) -> int                 tokens staged, not yet in the host layer
    settle(layer)                               join the landed write-backs to the host layer
    Staged(prefetcher, index)                   the layer's queue of staged write-backs (``layer.staged``):
        push(host_k, host_v, done), len(), tokens(), first(), settle(inner), clear(), failed
The module reads the layer (``deferred``, ``prefetcher``, ``inner``, ``staged``) and changes
only its ``Staged`` queue, through the queue's methods.

Write-back on CUDA (``deferred``: full storage in pinned host memory, the ``cpu`` tier): the new
tokens are copied into a pinned staging pair on the prefetcher's side stream (after it waits for
the compute stream; ``record_stream`` keeps their device memory alive), with an event; the
update returns at once, no host sync. The staged tokens join the host layer when the event has
landed, at the layer's next use at the latest (``update``, ``kv``, a fetch of its mirror, any
host-side or lifecycle operation, ``nbytes``): ``settle`` reads the event with ``query()`` and only blocks
(counted in ``offload_stats()["host_waits"]``) when the copy is still in flight. A fetch after that reads
the whole host copy on the same side stream, so it is ordered after the write-back.
``seq_length`` and ``mask_sizes`` count the staged tokens. An error from the host tier (a CUDA
error of the copy, the host buffer that cannot grow) raises ``CacheError`` naming the layer when
it surfaces, and at every later use of the layer until it is reset or its state replaced
(``Staged.failed``). Disk, sliding and static host layers copy synchronously (one event wait per
update, after the layer's mirror was acquired: the host copy changes only once its fetch has
landed): their update reads or moves host memory at once.

Every lifecycle operation of the layer settles first (``state_dict``, ``export``: fork, save,
retier read every token; ``load_state_dict``, ``ingest``, ``evict`` replace or drop the host
copy, so no staged pair joins a new state later).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError


def to_host(key: torch.Tensor, value: torch.Tensor):
    """The new tokens on the CPU: the tensors themselves on CPU, else a pinned copy, waited for."""
    if key.device.type == "cpu":
        return key, value
    out = []
    for t in (key, value):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(key.device))
    done.synchronize()
    return out


def defers(layer, key: torch.Tensor) -> bool:
    """Whether this update's write-back is staged (CUDA, full storage in host memory)."""
    return layer.deferred and key.is_cuda


def staging(key: torch.Tensor, value: torch.Tensor):
    """Pinned host tensors shaped like ``key`` / ``value``, for their write-back."""
    return [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (key, value)]


def write_back(layer, key, value, host_k, host_v) -> None:
    """Enqueue the device -> host copy of the new tokens on the side stream; no host sync."""
    stream = layer.prefetcher.side_stream(key.device)
    stream.wait_stream(torch.cuda.current_stream(key.device))  # the tokens are written on the compute stream
    with torch.cuda.stream(stream):
        host_k.copy_(key, non_blocking=True)
        host_v.copy_(value, non_blocking=True)
    for t in (key, value):
        t.record_stream(stream)  # their memory is not reused before the copy has read it
    done = torch.cuda.Event()
    done.record(stream)
    layer.staged.push(host_k, host_v, done)


def staged_tokens(layer) -> int:
    return layer.staged.tokens()


def settle(layer) -> None:
    """Append the landed write-backs to the host layer (blocking only on one still in flight)."""
    layer.staged.settle(layer.inner)


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

    def settle(self, inner) -> None:
        """Append the landed pairs to ``inner`` (the host layer), oldest first."""
        if self.failed is not None:
            raise CacheError(self.failed)
        while self.pairs:
            host_k, host_v, done = self.pairs[0]
            try:
                if not done.query():
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
