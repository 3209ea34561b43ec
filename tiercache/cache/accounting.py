"""Bytes a cache holds, from its holders (its layers and the buffers they share).

    summed(parts) -> {key: bytes}           dicts of bytes added key by key
    by_place(tensors) -> {place: bytes}     bytes of tensors by where they lie (``place_of``)
    plus_device(tiers, n) -> {tier: bytes}  ``tiers`` with ``n`` more device bytes (exact states kept on
                                            the model's device; no ``device`` key added for 0)
    per_place(layers, shared) -> {place: bytes}   ``nbytes()``: ``cpu``, ``cuda:0``, ``disk`` ...
    per_tier(layers, shared) -> {tier: bytes}     ``tier_nbytes()``: ``device``, ``host``, ``disk``;
                                            the shared buffers (workspace, prefetch slots) are device bytes
"""

from __future__ import annotations

from tiercache.layers.tiers import by_place, summed  # (the layers' accounting, shared)

__all__ = ["by_place", "per_place", "per_tier", "plus_device", "summed"]


def plus_device(tiers: dict[str, int], n: int) -> dict[str, int]:
    return summed([tiers, {"device": n}]) if n else dict(tiers)


def per_place(layers, shared=None) -> dict[str, int]:
    return summed(holder.nbytes() for holder in [*layers, *([shared] if shared is not None else [])])


def per_tier(layers, shared=None) -> dict[str, int]:
    parts = [layer.tier_nbytes() for layer in layers]
    if shared is not None:
        parts.append({"device": sum(shared.nbytes().values())})
    return {tier: n for tier, n in summed(parts).items() if n}
