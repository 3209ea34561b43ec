"""A bound on the bytes a piece of work may allocate: ``within(nbytes, what)`` / ``charge(shape, dtype)``.

    with allowance.within(max_bytes, "load", hint):
        ...   # every tier allocation inside is charged first
    allowance.charge(shape, dtype)   # by the tiers (compute, host, disk), before they allocate
    allowance.size_of(shape, dtype)  # the bytes such an allocation takes

Inside ``within``, each allocation a tier makes is counted before it is made, and one that would
take the total past ``nbytes`` raises ``CacheError`` instead (naming ``what``, the bytes asked,
the bound and ``hint``): nothing is allocated for it. Outside any ``within`` a charge costs one
context-variable read. ``TieredCache.load`` runs under one, so a file's header cannot make it
allocate more than the file's size allows (``tiercache.lifecycle.bounds``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch

from tiercache.errors import CacheError


class _Allowance:
    def __init__(self, nbytes: int, what: str, hint: str):
        self.limit, self.used, self.what, self.hint = int(nbytes), 0, what, hint


_current: contextvars.ContextVar[_Allowance | None] = contextvars.ContextVar("tiercache_allowance", default=None)


@contextlib.contextmanager
def within(nbytes: int, what: str, hint: str = ""):
    token = _current.set(_Allowance(nbytes, what, hint))
    try:
        yield
    finally:
        _current.reset(token)


def size_of(shape, dtype: torch.dtype) -> int:
    """Bytes of an allocation of ``shape`` x ``dtype``."""
    return math.prod(int(s) for s in shape) * torch.empty((), dtype=dtype).element_size()


def charge(shape, dtype: torch.dtype) -> None:
    """Count an allocation of ``shape`` x ``dtype``; ``CacheError`` when it would pass the bound."""
    a = _current.get()
    if a is None:
        return
    nbytes = size_of(shape, dtype)
    if a.used + nbytes > a.limit:
        raise CacheError(f"{a.what} would allocate {a.used + nbytes} bytes (an allocation of {nbytes} for "
                         f"{tuple(int(s) for s in shape)} {str(dtype).replace('torch.', '')}), over its bound of "
                         f"{a.limit} bytes{'; ' + a.hint if a.hint else ''}")
    a.used += nbytes
