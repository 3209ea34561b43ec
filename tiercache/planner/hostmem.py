"""Host memory that is freed goes back to the OS: the CPU side of "the plan counts what is held".

Interface
    release_freed_memory(threshold=1 MiB) -> bool     True when it could be set (Linux, glibc)

glibc's ``malloc`` serves blocks of up to 32 MiB from its heap once a block that large has been
freed (its mmap threshold adapts upwards), and a heap rarely shrinks: a long prefill that frees
activations of a few MiB per layer and per chunk leaves them mapped, so a process's resident set
grows well past what it holds (measured here: +30-40% over the live bytes at 16k tokens). Fixing
the threshold (``mallopt(M_MMAP_THRESHOLD)``, the documented knob also read from
``MALLOC_MMAP_THRESHOLD_``) makes every block of ``threshold`` bytes or more its own mapping,
returned to the OS when freed; that costs a page-fault pass over each new large block, small
next to the matrix products that fill it. ``tiercache generate`` calls it before loading the
model; set ``TIERCACHE_KEEP_MALLOC=1`` to keep glibc's defaults. Elsewhere (macOS, musl,
Windows) it does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def release_freed_memory(threshold: int = 1 << 20) -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("TIERCACHE_KEEP_MALLOC") == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, int(threshold))) and bool(mallopt(M_TRIM_THRESHOLD, int(threshold)))
