"""What each layer of a model's cache is for transformers' questions, hybrid models included.

    LayerRoles(model_spec, placeholders)
    r.kv_layers(n) -> list[int]     the layers that store attention K/V (not KV-sharing
                                    placeholders, not state-only or empty layers)
    r.first(n) -> int | None        the first of them
    r.answering(i, n, what) -> int  the layer that answers ``get_seq_length`` / ``get_mask_sizes``
                                    for ``i``: ``i`` itself; for a layer 0 without attention (or a
                                    placeholder 0) the first that stores K/V; else ``CacheError``
    r.stateful(i, what)             ``CacheError`` unless layer ``i`` keeps a conv / recurrent state
    r.last_stateful(n) -> int       the last layer with a state (transformers' ``has_previous_state()``)

transformers answers these from its layer classes (``CacheLayerMixin`` vs
``LinearAttentionCacheLayerMixin``); here the ``ModelSpec``'s layer types say it
(``attends(i)``, ``states(i)``), and ``tiercache.cache.placeholders`` the KV-sharing rules.
"""

from __future__ import annotations

from tiercache.errors import CacheError


class LayerRoles:
    def __init__(self, model, placeholders):
        self.model, self.reuse = model, placeholders

    def kv_layers(self, n: int) -> list[int]:
        return [i for i in self.reuse.stores(n) if self.model.attends(i)]

    def first(self, n: int) -> int | None:
        return next(iter(self.kv_layers(n)), None)

    def answering(self, i: int, n: int, what: str) -> int:
        if self.model.attends(i):
            return self.reuse.answering(i, n, what)
        first = self.first(n)
        if i != 0 or first is None:
            raise CacheError(f"{what}(layer_idx={i}): layer {i} is a {self.model.layer_types[i]!r} layer, which "
                             f"tracks no sequence length; ask an attention layer: {self.kv_layers(n)}")
        return first

    def stateful(self, i: int, what: str) -> None:
        if not self.model.states(i):
            raise CacheError(f"{what}: layer {i} is a {self.model.layer_types[i]!r} layer, which keeps no conv / "
                             "recurrent state")

    def last_stateful(self, n: int) -> int:
        last = next((i for i in reversed(range(n)) if self.model.states(i)), None)
        if last is None:
            raise CacheError("has_previous_state: this cache has no layer with a conv / recurrent state")
        return last
