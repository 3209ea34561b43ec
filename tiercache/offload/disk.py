"""The disk tier: a layer's host copy in memory-mapped files (``offload.device: disk``).

Tier interface (``tiercache.layers.tiers``): ``empty(shape, dtype, device)``, ``place(device)``,
``free(tensor)``, ``close()``. Each allocation is one file in a directory of its own, made with
``mkdtemp`` under ``path`` (default: the system temp directory) at the first allocation, so two
tiers (two layers, two caches) never share files. The file's blocks are reserved up front
(``posix_fallocate``): a full disk or an unwritable path raises ``CacheError`` right there, at
the first write that needs room, before the layer changes (the storage layers allocate before
they copy), and never later as a ``SIGBUS`` on a page of a sparse file.

Nothing is left behind: ``free`` unlinks a tensor's file (the mapping stays valid until the
tensor is gone), so does dropping the tensor without ``free``, and ``close()``, garbage collection of the tier (``weakref.finalize``) and
interpreter exit remove the whole directory. Files or the directory removed by someone else
while in use lose nothing (the mappings hold the data); the next allocation makes the
directory again. ``nbytes`` places these bytes under ``"disk"``.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import weakref

import torch

from tiercache.errors import CacheError
from tiercache.layers import allowance


def reserve(fd: int, nbytes: int) -> None:
    """Give the file ``nbytes`` of real blocks (raises ``OSError`` ENOSPC when the disk is full)."""
    os.posix_fallocate(fd, 0, nbytes)


class DiskTier:
    kind = "disk"

    def __init__(self, path: str | None = None, label: str = "kv"):
        self.root = os.fspath(path) if path is not None else tempfile.gettempdir()
        self.label = label
        self.dir: str | None = None  # created at the first allocation
        self.files: dict[int, tuple[str, weakref.finalize]] = {}  # storage data_ptr -> file, unlinker
        self._finalizer: weakref.finalize | None = None

    def empty(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel, nbytes = math.prod(int(s) for s in shape), allowance.size_of(shape, dtype)
        allowance.charge(shape, dtype)  # a bounded load: refused before any file is made
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        name = None
        try:
            fd, name = tempfile.mkstemp(suffix=".kv", dir=self._directory())
            try:
                reserve(fd, nbytes)
            finally:
                os.close(fd)
            tensor = torch.from_file(name, shared=True, size=numel, dtype=dtype).view(shape)
        except (OSError, RuntimeError) as e:
            if name is not None:
                _unlink(name)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise CacheError(
                f"disk tier: cannot store {nbytes} bytes of KV cache under {self.root!r}: {reason}; "
                "free space there or set offload.path to a writable directory with room "
                "(the layer is unchanged)"
            ) from e
        # The file goes with the tensor even if a caller drops it without free() (a half-done regrow).
        unlink = weakref.finalize(tensor, _unlink, name)
        unlink.atexit = False  # the directory's finalizer covers exit
        self.files = {ptr: e for ptr, e in self.files.items() if e[1].alive}
        self.files[tensor.untyped_storage().data_ptr()] = (name, unlink)
        return tensor

    def place(self, device: torch.device) -> str:
        return "disk"

    def free(self, tensor: torch.Tensor) -> None:
        entry = self.files.pop(tensor.untyped_storage().data_ptr(), None)
        if entry is not None:
            entry[1]()  # unlink now (the mapping stays valid while the tensor lives)

    def close(self) -> None:
        self.files.clear()
        if self._finalizer is not None:
            self._finalizer()  # removes the directory once; later calls are no-ops
        self._finalizer = None
        self.dir = None

    def paths(self) -> list[str]:
        """The files this tier holds now (for tests and diagnostics)."""
        return sorted(name for name, fin in self.files.values() if fin.alive)

    def _directory(self) -> str:
        if self.dir is None:
            os.makedirs(self.root, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix=f"tiercache-{self.label}-", dir=self.root)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, True)  # ignore_errors; also runs at exit
        elif not os.path.isdir(self.dir):  # removed under us (a temp cleaner): make it again
            os.makedirs(self.dir, exist_ok=True)
        return self.dir


def _unlink(name: str) -> None:
    try:
        os.unlink(name)
    except FileNotFoundError:
        pass
