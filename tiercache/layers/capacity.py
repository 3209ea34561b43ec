"""How much a storage layer allocates: plain integer rules (no torch), written once.

The layers allocate by them (``buffer.Buffer``, ``sliding.SlidingLayer``) and the planner
(``tiercache.planner.footprint``) predicts ``nbytes()`` by them.

    CHUNK                                  tokens of capacity a growable buffer adds at a time
    capacity_for(tokens, chunk) -> int     ``tokens`` rounded up to whole chunks (what a buffer
                                           reserved for ``tokens`` holds; sliding buffers)
    grown_capacity(tokens, chunk) -> int   capacity of a buffer that *grew* to hold ``tokens``:
                                           whole chunks on a ladder (1, 2, 3, 4, 6, 8, 12, 16
                                           ... chunks: 2^k and 1.5 x 2^k), so growing to a
                                           capacity ``C`` copies about ``2.4 C`` tokens at most
                                           in all, and it holds at most 1.5x the whole chunks
                                           it needs (a power of two: exactly)
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
    store_capacity(kind, tokens, window, max_length, chunk, step=1, geometric=False) -> int
        the same for any storage kind (``full`` | ``static`` | ``sliding``): ``grown_capacity``
        (``geometric``: a full-precision buffer) or ``capacity_for`` (a quantized store, chunk 1:
        its ``nbytes()`` stays the packed size), ``max_length`` preallocated, or
        ``sliding_capacity``; 0 before the first token

In units of the storage's "tokens": a quantized layer's store holds one packed block per row,
so Quantize's store geometry (``quantize/geometry.py``) goes through the same rules.
"""

from __future__ import annotations

CHUNK = 256  # tokens of capacity added at a time


def capacity_for(tokens: int, chunk: int = CHUNK) -> int:
    """Capacity (tokens) of a buffer that grew to hold ``tokens``: rounded up to whole chunks."""
    return max(chunk, -(-tokens // chunk) * chunk)


def grown_capacity(tokens: int, chunk: int = CHUNK) -> int:
    """Capacity (tokens) of a buffer that grew to hold ``tokens``: the smallest step of the ladder
    ``chunk`` x (1, 2, 3, 4, 6, 8, 12, 16, 24 ...: 2^k and 3 x 2^(k-1)) that holds them. It
    depends on ``tokens`` alone (not on how they were appended), so the planner predicts it
    exactly; a power-of-two number of chunks is held exactly (32k, 128k tokens: no slack), any
    other count at most 1.5x its whole chunks; each step is 1.33x or 1.5x the one before, so
    the copies of all regrowths up to a capacity ``C`` sum to about ``2.4 C`` at most (growing a
    chunk at a time copies ``n^2 / (2 chunk)``)."""
    n = max(1, -(-tokens // chunk))
    if n <= 2:
        return n * chunk
    k = (n - 1).bit_length()  # 2^(k-1) < n <= 2^k
    mid = 3 << (k - 2)  # 1.5 x 2^(k-1)
    return (mid if n <= mid else 1 << k) * chunk


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
                   chunk: int = CHUNK, step: int = 1, geometric: bool = False) -> int:
    if tokens <= 0:
        return 0
    if kind == "static":
        return max_length
    if kind == "sliding":
        return sliding_capacity(tokens, window, chunk, step)
    return grown_capacity(tokens, chunk) if geometric else capacity_for(tokens, chunk)
