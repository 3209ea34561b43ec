"""Deprecated alias of ``tiercache.simdevice.memory``: re-exports it, with a ``DeprecationWarning``."""

import warnings

from tiercache.simdevice import memory as _target

warnings.warn("tiercache.offload.simmemory is deprecated: import tiercache.simdevice.memory",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_target, name)
