"""KV-sharing placeholders: the layers of Gemma 3n / Gemma 4 that reuse another layer's K/V.

    Placeholders(model_spec)      the layers with ``model.kv_sharing(i) == "reuse"``
    i in p                        layer ``i`` is a placeholder
    p.stores(n) -> list[int]      the layers that store, in order
    p.first                       the first layer that stores (a forward's first write), or None
    p.check_update(i, name)       ``CacheError``: the model never writes a placeholder
    p.answering(i, n, what)       the layer that answers ``get_seq_length`` / ``get_mask_sizes``
                                  for ``i``: ``i`` itself, the first storing layer for a
                                  placeholder 0, else ``CacheError``

transformers builds such layers as ``DummyLayer``: they hold nothing, refuse updates, ignore
crop and batch operations, have no maximum length (-1), are neither sliding nor recording,
and asking their sequence length or mask sizes raises (``ValueError``; here ``CacheError``)
except for layer 0. ``TieredCache`` keeps their chains (empty, never written) and answers for
them by these rules.
"""

from __future__ import annotations

from tiercache.errors import CacheError


class Placeholders:
    def __init__(self, model):
        self.indices = frozenset(i for i in range(model.num_layers) if model.kv_sharing(i) == "reuse")
        self.first = next((i for i in range(model.num_layers) if i not in self.indices), None)  # first to store
        self.name = model.name

    def __contains__(self, i: int) -> bool:
        return i in self.indices

    def stores(self, n: int) -> list[int]:
        return [i for i in range(n) if i not in self.indices]

    def check_update(self, i: int) -> None:
        if i in self.indices:
            raise CacheError(
                f"layer {i} reuses the K/V of an earlier layer (KV sharing, {self.name}): the model never writes "
                "it, and the cache refuses updates to it (transformers' placeholder layer does too)"
            )

    def answering(self, i: int, n: int, what: str) -> int:
        if i not in self.indices:
            return i
        stores = self.stores(n)
        if i != 0 or not stores:
            raise CacheError(
                f"{what}(layer_idx={i}): layer {i} reuses the K/V of an earlier layer (KV sharing) and tracks no "
                f"sequence length; ask a layer that stores: {stores}"
            )
        return stores[0]
