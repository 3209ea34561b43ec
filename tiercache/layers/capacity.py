"""How much a storage layer allocates: plain integer rules (no torch), written once.

The layers allocate by them (``buffer.Buffer``, ``sliding.SlidingLayer``) and the planner
(``tiercache.planner.footprint``) predicts ``nbytes()`` by them.

    CHUNK                                  tokens of capacity a growable buffer adds at a time
    capacity_for(tokens, chunk) -> int     capacity of a buffer that grew to hold ``tokens``
    sliding_slack(window, chunk) -> int    tokens a sliding buffer appends between two slides:
                                           ``min(chunk, window)``
    long_update(held, t, capacity, chunk) -> bool
        a sliding layer (not recording) takes the long path for an update of ``t`` tokens: it
        does not fit the buffer and is longer than a chunk; it then attends over held + new
        once and keeps only the window's tail (with the slack of room)
    sliding_capacity(tokens, window, chunk, step=1) -> int
        a sliding buffer's capacity in steady decoding after ``tokens`` were appended ``step``
        at a time: ``window`` plus the slack, in chunks; when every step takes the long path,
        the ``window - 1`` kept plus the slack
    store_capacity(kind, tokens, window, max_length, chunk, step=1) -> int
        the same for any storage kind (``full`` | ``static`` | ``sliding``): ``capacity_for``,
        ``max_length`` preallocated, or ``sliding_capacity``; 0 before the first token

In units of the storage's "tokens": a quantized layer's store holds one packed block per row,
so Quantize's store geometry (``quantize/geometry.py``) goes through the same rules.
"""

from __future__ import annotations

CHUNK = 256  # tokens of capacity added at a time


def capacity_for(tokens: int, chunk: int = CHUNK) -> int:
    """Capacity (tokens) of a buffer that grew to hold ``tokens``: rounded up to whole chunks."""
    return max(chunk, -(-tokens // chunk) * chunk)


def sliding_slack(window: int, chunk: int = CHUNK) -> int:
    return min(chunk, window)


def long_update(held: int, t: int, capacity: int, chunk: int = CHUNK) -> bool:
    return held + t > capacity and t > chunk


def sliding_capacity(tokens: int, window: int, chunk: int = CHUNK, step: int = 1) -> int:
    if tokens <= 0:
        return 0
    slack = sliding_slack(window, chunk)
    kept = min(tokens, window - 1)
    after_long = capacity_for(kept + slack, chunk)  # what a long update leaves
    if long_update(kept, step, after_long, chunk):  # so every step of this size takes it again
        return after_long
    return capacity_for(min(tokens, window) + slack, chunk)


def store_capacity(kind: str, tokens: int, window: int | None = None, max_length: int | None = None,
                   chunk: int = CHUNK, step: int = 1) -> int:
    if tokens <= 0:
        return 0
    if kind == "static":
        return max_length
    if kind == "sliding":
        return sliding_capacity(tokens, window, chunk, step)
    return capacity_for(tokens, chunk)
