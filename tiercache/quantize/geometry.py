"""Where a quantized layer's tokens go: the KIVI residual rule and its store's size in blocks.

Plain integer functions (no torch): ``Quantize`` (``quantize/processor.py``) runs by them, the
chain spec (``tiercache.planner.chainspec``) sizes the inner store by them and the planner
(``tiercache.planner.footprint``) predicts bytes by them, so each rule is written once.

    flush_split(held, new, residual_length, group_size) -> int
        tokens to pack when ``new`` tokens join a residual of ``held`` (as ``new`` one-token
        updates would); ``flush_split(0, seen, R, G)`` is the packed part after ``seen`` tokens
    flush_rows(residual_length, group_size) -> int
        blocks one flush appends in steady decoding (the flush period over ``G``)
    store_window(window, group_size) -> int
        blocks a sliding layer's store covers: ``ceil((window - 1) / G) + 1`` (it keeps one less)
    static_rows(max_length, group_size) -> int
        blocks a static layer's store preallocates: ``max_length // G`` (at least 1)
    kept_sinks(sink_tokens, window) -> int
        attention-sink tokens a layer keeps exact: none on a sliding layer (the window slides them out)
    STORE_CHUNK
        rows of capacity a growable store adds at a time: 1, so ``nbytes()`` stays the packed size
"""

from __future__ import annotations

STORE_CHUNK = 1


def flush_split(held: int, new: int, residual_length: int, group_size: int) -> int:
    """Tokens to pack when ``new`` tokens join a residual of ``held``: as ``new`` one-token updates would."""
    first = max(residual_length, group_size)  # the residual is flushed when it reaches this
    total = held + new
    if total < first:
        return 0
    base = first % group_size  # what stays after a flush
    return total - (base + (total - first) % (first - base))


def flush_rows(residual_length: int, group_size: int) -> int:
    """Blocks appended by one flush once the residual has filled (``P / G``, ``P = F - F mod G``)."""
    first = max(residual_length, group_size)
    return (first - first % group_size) // group_size


def store_window(window: int, group_size: int) -> int:
    return -(-(window - 1) // group_size) + 1


def static_rows(max_length: int, group_size: int) -> int:
    return max(1, max_length // group_size)


def kept_sinks(sink_tokens: int, window: int | None) -> int:
    return 0 if window is not None else sink_tokens
