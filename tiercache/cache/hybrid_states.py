"""``HybridStates``: what transformers asks a cache about hybrid and recurrent models' layers.

    class TieredCache(HybridStates, Cache)    # the mixin comes first: its methods answer, not Cache's

``is_linear`` / ``is_dummy`` (transformers' meaning: a state and no attention / nothing cached or a
KV-sharing placeholder), and the conv / recurrent state methods transformers' hybrid models call
(``get_conv_state`` / ``update_conv_state`` / ``get_recurrent_state`` / ``update_recurrent_state`` /
``has_previous_state``), each answered by the layer's ``StateLayer`` (``tiercache.cache.state_layer``)
or refused with a ``CacheError`` naming a layer without a state (``tiercache.cache.layer_roles``).

The class using it provides ``layers``, ``model`` (a ``ModelSpec``), ``_reuse`` (``Placeholders``),
``_roles`` (``LayerRoles``), ``_layer(i)`` (the checked layer) and ``_on(i, op)`` (``op(layers[i])``,
its ``CacheError`` naming the layer).
"""

from __future__ import annotations

import torch


class HybridStates:
    @property
    def is_linear(self) -> list[bool]:
        """True for the layers with a conv / recurrent state and no attention (transformers' meaning)."""
        return [self.model.states(i) > 0 and not self.model.attends(i) for i in range(len(self.layers))]

    @property
    def is_dummy(self) -> list[bool]:
        """True for the layers that reuse another layer's K/V (transformers' placeholder layers) and the
        layers that cache nothing (``mlp`` / ``moe`` layers of hybrid models)."""
        return [i in self._reuse or not (self.model.attends(i) or self.model.states(i)) for i in range(len(self.layers))]

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self._stateful(layer_idx, "get_conv_state", lambda layer: layer.conv_state(state_idx))

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._stateful(layer_idx, "update_conv_state",
                              lambda layer: layer.update_conv_state(conv_states, state_idx, **kwargs))

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self._stateful(layer_idx, "get_recurrent_state", lambda layer: layer.recurrent_state(state_idx))

    def update_recurrent_state(self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        return self._stateful(layer_idx, "update_recurrent_state",
                              lambda layer: layer.update_recurrent_state(recurrent_states, state_idx, **kwargs))

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        i = self._roles.last_stateful(len(self.layers)) if layer_idx is None else layer_idx  # transformers: the last
        return self._stateful(i, "has_previous_state", lambda layer: layer.has_previous_state(state_idx))

    def _stateful(self, layer_idx: int, what: str, op):
        """``op(layers[layer_idx])`` for a layer with a conv / recurrent state (``tiercache.cache.state_layer``)."""
        self._layer(layer_idx)
        self._roles.stateful(layer_idx, what)
        return self._on(layer_idx, op)
