"""Deprecated alias of ``tiercache.simdevice.device``: re-exports it, with a ``DeprecationWarning``."""

import warnings

from tiercache.simdevice import device as _target

warnings.warn("tiercache.offload.simdevice is deprecated: import tiercache.simdevice (or tiercache.simdevice.device)",
              DeprecationWarning, stacklevel=2)


def __getattr__(name: str):
    return getattr(_target, name)
