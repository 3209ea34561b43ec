"""``AllocationMeter``: the peak of extra tensor memory while a block of code runs (CPU or GPU).

    with AllocationMeter(watch=tensors) as m:
        work()
    m.peak      # max over time of (bytes allocated inside the block still alive - bytes of
                #  watched storages freed so far), i.e. the peak extra memory the block needed
    m.net       # the same at the end (what the block left allocated, minus what it freed)

It counts tensor storages, not the process (a ``TorchDispatchMode`` sees every op; a storage is
new when no input of the op shares it, and a ``weakref.finalize`` on it says when it is
freed). ``watch`` names tensors alive before the block (e.g. a cache's ``state_dict()``): when
their storages are freed inside the block, that memory counts as given back. Python's
``tracemalloc`` does not see torch's allocator, and torch has no CPU allocator statistics;
this works the same on every device. Tensors made outside torch's dispatcher (files mapped by
the disk tier) are not counted: they are not memory.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AllocationMeter(TorchDispatchMode):
    def __init__(self, watch=()):
        super().__init__()
        self.live = self.peak = 0
        self._known: set[int] = set()  # data_ptr of storages already counted or watched
        self._watch = [t for t in watch if isinstance(t, torch.Tensor)]

    @property
    def net(self) -> int:
        return self.live

    def __enter__(self):
        for t in self._watch:
            self._track(t.untyped_storage(), count=False)
        self._watch = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {s.data_ptr() for s in map(_storage, tree_flatten((args, kwargs))[0]) if s is not None}
        for storage in map(_storage, tree_flatten(out)[0]):
            if storage is not None and storage.data_ptr() not in inputs and storage.nbytes():
                self._track(storage, count=True)
        return out

    def _track(self, storage, count: bool) -> None:
        ptr = storage.data_ptr()
        if ptr in self._known or not storage.nbytes():
            return
        self._known.add(ptr)
        size = storage.nbytes()
        if count:
            self.live += size
            self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, ptr, size)

    def _freed(self, ptr: int, size: int) -> None:
        self._known.discard(ptr)
        self.live -= size


def _storage(t):
    """The storage behind a plain tensor; None for anything else (meta tensors, and wrapper subclasses
    such as quanto's, whose inner tensors the meter sees when their own ops run)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
