"""Build one processor chain per model layer from the resolved policy.

    quantize off, offload off:   storage                       (full | static | sliding)
    offload only:                Offload(storage on host/disk)
    quantize (+ offload):        Quantize(store factory)       the factory builds the store of
                                                               packed blocks, offloaded when asked

Quantize sits *outside* Offload so that what is kept on the host and crosses the bus is the
packed blocks, and the residual window stays on the compute device. ``Shared`` carries what
the layers of one cache share: the offload prefetcher (side stream, device buffers).
"""

from __future__ import annotations

from tiercache.layers.base import KVLayer
from tiercache.layers.buffer import CHUNK
from tiercache.layers.full import FullLayer
from tiercache.layers.sliding import SlidingLayer
from tiercache.layers.static import StaticLayer
from tiercache.policy import LayerPolicy


def make_storage(window: int | None = None, max_length: int | None = None, tier=None, chunk: int = CHUNK) -> KVLayer:
    """``sliding`` when a window is given, else ``static`` when a max_length is, else ``full``.

    ``chunk``: tokens of capacity a growable buffer adds at a time (Quantize stores one packed
    block per "token", so it asks for a few blocks at a time rather than 256).
    """
    if window is not None:
        return SlidingLayer(window, tier, chunk)
    if max_length is not None:
        return StaticLayer(max_length, tier)
    return FullLayer(tier, chunk)


class Shared:
    """Objects shared by the layers of one cache; created lazily, closed with the cache."""

    def __init__(self):
        self._prefetcher = None

    @property
    def prefetcher(self):
        if self._prefetcher is None:
            from tiercache.processors.offload import Prefetcher

            self._prefetcher = Prefetcher()
        return self._prefetcher

    def nbytes(self) -> dict[str, int]:
        """Bytes of shared buffers (the prefetcher's device mirrors), per place."""
        return self._prefetcher.nbytes() if self._prefetcher is not None else {}

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()


def build_layer(lp: LayerPolicy, shared: Shared) -> KVLayer:
    max_length = lp.max_length if lp.storage == "static" else None

    def make_store(window: int | None = None, max_length: int | None = None, chunk: int = CHUNK) -> KVLayer:
        if lp.offload is None:
            return make_storage(window, max_length, chunk=chunk)
        from tiercache.processors.offload import offloaded

        return offloaded(lambda tier: make_storage(window, max_length, tier, chunk), lp.offload, shared.prefetcher, lp.index)

    if lp.quantize is None:
        return make_store(lp.window, max_length)
    from tiercache.processors.quantize import Quantize

    return Quantize(make_store, lp.quantize, window=lp.window, max_length=max_length)


def build_layers(layer_policies: list[LayerPolicy]) -> tuple[list[KVLayer], Shared]:
    shared = Shared()
    return [build_layer(lp, shared) for lp in layer_policies], shared
