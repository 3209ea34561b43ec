"""Bytes a cache holds, from its holders (its layers and the buffers they share).

    summed(parts) -> {key: bytes}           dicts of bytes added key by key
    per_place(layers, shared) -> {place: bytes}   ``nbytes()``: ``cpu``, ``cuda:0``, ``disk`` ...
    per_tier(layers, shared) -> {tier: bytes}     ``tier_nbytes()``: ``device``, ``host``, ``disk``;
                                            the shared buffers (workspace, prefetch slots) are device bytes
"""

from __future__ import annotations


def summed(parts) -> dict[str, int]:
    total: dict[str, int] = {}
    for part in parts:
        for key, n in part.items():
            total[key] = total.get(key, 0) + n
    return total


def per_place(layers, shared=None) -> dict[str, int]:
    return summed(holder.nbytes() for holder in [*layers, *([shared] if shared is not None else [])])


def per_tier(layers, shared=None) -> dict[str, int]:
    parts = [layer.tier_nbytes() for layer in layers]
    if shared is not None:
        parts.append({"device": sum(shared.nbytes().values())})
    return {tier: n for tier, n in summed(parts).items() if n}
