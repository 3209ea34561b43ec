"""Bytes copied by regrowth: what moving held tokens into larger memory has cost, process-wide.

    copied() -> {"device": int, "host": int, "disk": int}    bytes copied so far, by tier kind
    record(kind, nbytes)                                     a regrowth copied ``nbytes`` on that tier

Counted: a growable buffer (``layers/buffer.py``: full storage, quantized stores, on any tier)
moving its held tokens into a larger allocation, and an offload mirror regrowing on the device
(``offload/prefetch.py``). Not counted: the copies a layer makes by design (a sliding buffer
sliding its window down, a fetch host -> device, a write-back, a batch gather).

The counters only grow (read them before and after, as ``bench/bench_regrow.py`` does); they
are plain ints, updated under the GIL, and cost one add per regrowth.
"""

from __future__ import annotations

_COPIED = {"device": 0, "host": 0, "disk": 0}


def record(kind: str, nbytes: int) -> None:
    _COPIED[kind] = _COPIED.get(kind, 0) + int(nbytes)


def copied() -> dict[str, int]:
    return dict(_COPIED)
