"""What each layer of a model's cache is for transformers' questions: one table, made once.

    LayerRoles(model_spec, n)        the roles of a cache's ``n`` layers, fixed at construction
    i in roles                       layer ``i`` is a KV-sharing placeholder
    roles.stores                     the layers that are not placeholders, in order (``roles.writable``:
                                     the same as a set, what ``update`` may write)
    roles.kv_layers                  the layers that store attention K/V (not placeholders, not
                                     state-only or empty layers); ``roles.first``: the first of them
    roles.is_linear / is_dummy       transformers' per-layer flags (below)
    roles.check_update(i)            ``CacheError``: the model never writes a placeholder
    roles.answering(i, what) -> int  the layer that answers ``get_seq_length`` / ``get_mask_sizes``
                                     for ``i``: ``i`` itself; for a layer 0 without attention (or a
                                     placeholder 0) the first that stores; else ``CacheError``
    roles.stateful(i, what)          ``CacheError`` unless layer ``i`` keeps a conv / recurrent state
    roles.last_stateful(what)        the last layer with a state (transformers' ``has_previous_state()``)

KV-sharing placeholders (Gemma 3n / Gemma 4: ``model.kv_sharing(i) == "reuse"``) are what
transformers builds as ``DummyLayer``: they hold nothing, refuse updates, ignore crop and batch
operations, have no maximum length (-1), are neither sliding nor recording, and asking their
sequence length or mask sizes raises (here ``CacheError``) except for layer 0. ``is_linear``:
a conv / recurrent state and no attention; ``is_dummy``: a placeholder, or a layer that caches
nothing (``mlp`` / ``moe`` layers of hybrid models). transformers answers these from its layer
classes (``CacheLayerMixin`` vs ``LinearAttentionCacheLayerMixin``); here the ``ModelSpec``'s layer
types say it (``attends(i)``, ``states(i)``, ``kv_sharing(i)``).

The table is computed once, so a decode step asks it in constant time per layer.
"""

from __future__ import annotations

from tiercache.errors import CacheError


class LayerRoles:
    def __init__(self, model, n: int):
        self.name, self.layer_types = model.name, model.layer_types
        self.reuse = frozenset(i for i in range(min(n, model.num_layers)) if model.kv_sharing(i) == "reuse")
        self.attends = [bool(model.attends(i)) for i in range(n)]
        self.has_state = [bool(model.states(i)) for i in range(n)]
        self.stores = [i for i in range(n) if i not in self.reuse]
        self.writable = frozenset(self.stores)
        self.kv_layers = [i for i in self.stores if self.attends[i]]
        self.first = self.kv_layers[0] if self.kv_layers else None
        self.is_linear = [s and not a for s, a in zip(self.has_state, self.attends)]
        self.is_dummy = [i in self.reuse or not (self.attends[i] or self.has_state[i]) for i in range(n)]

    def __contains__(self, i: int) -> bool:
        return i in self.reuse

    def check_update(self, i: int) -> None:
        if i in self.reuse:
            raise CacheError(
                f"layer {i} reuses the K/V of an earlier layer (KV sharing, {self.name}): the model never writes "
                "it, and the cache refuses updates to it (transformers' placeholder layer does too)"
            )

    def answering(self, i: int, what: str) -> int:
        if self.attends[i]:
            if i not in self.reuse:
                return i
            if i != 0 or not self.stores:
                raise CacheError(
                    f"{what}(layer_idx={i}): layer {i} reuses the K/V of an earlier layer (KV sharing) and tracks "
                    f"no sequence length; ask a layer that stores: {self.stores}"
                )
            return self.stores[0]
        if i != 0 or self.first is None:
            raise CacheError(f"{what}(layer_idx={i}): layer {i} is a {self.layer_types[i]!r} layer, which "
                             f"tracks no sequence length; ask an attention layer: {self.kv_layers}")
        return self.first

    def stateful(self, i: int, what: str) -> None:
        if not self.has_state[i]:
            raise CacheError(f"{what}: layer {i} is a {self.layer_types[i]!r} layer, which keeps no conv / "
                             "recurrent state")

    def last_stateful(self) -> int:
        last = next((i for i in reversed(range(len(self.has_state))) if self.has_state[i]), None)
        if last is None:
            raise CacheError("has_previous_state: this cache has no layer with a conv / recurrent state")
        return last
