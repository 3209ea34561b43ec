"""``StateLayer``: a hybrid or recurrent model's layer that keeps a conv / recurrent state.

    StateLayer(states, attention=None)     a ``WithSideState`` whose side state is a ``RecurrentState``
    layer.state                            transformers' own ``LinearAttentionLayer`` (or None: no state)
    layer.attention                        the attention chain of a hybrid layer, tiered by the policy (or None)

What transformers' ``DynamicCache`` builds per layer type, here:
- ``linear_attention`` / ``conv`` (Mamba, gated delta nets, LFM's short convolutions):
  ``StateLayer(n)`` holds transformers' ``LinearAttentionLayer(number_of_states=n)`` itself, so
  the states are updated, padded, recorded and cropped exactly as transformers does, exact and on
  the model's device (where the model's first update puts them). No policy tiers them: they are
  a fixed size per sequence, read whole every step.
- ``hybrid`` / ``hybrid_sliding`` (Falcon-H1, Zamba): the same state plus ``attention``, the
  layer's attention chain (full / sliding storage, quantized, offloaded per the policy).
- ``mlp`` / ``moe`` (Nemotron-H): ``StateLayer(0)``, which holds nothing.

Everything a side state shares with the indexer keys and the compressor state (K/V to the
attention chain, a layer without one refuses ``append``; accounting as device bytes; lifecycle;
batch gathers; adopt) is ``WithSideState``'s. What is the state's own: ``reset`` zeroes it in
place (as transformers'), ``close`` frees it; ``set_recording`` is transformers'
``activate_past_recording``; ``crop`` follows transformers' rule (a layer with a state crops only
while recording, else ``CacheError``). Its ``state_dict``: ``meta.states`` / ``meta.recording`` /
``meta.previous.{i}`` / ``meta.kernel.{i}`` and the ``side.conv.{i}`` / ``side.recurrent.{i}``
tensors; a state saved in the flat format of earlier releases (``states``, ``state.conv.{i}`` ...)
still loads (``RecurrentState.upgrade``).

The cache reaches the state through ``conv_state(i)`` / ``update_conv_state`` /
``recurrent_state(i)`` / ``update_recurrent_state`` / ``has_previous_state(i)`` (transformers'
``Cache`` methods of those names, answered by ``TieredCache``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from tiercache.cache.side_state import SideState, WithSideState
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer
from tiercache.layers.state import field



class RecurrentState(SideState):
    """``states`` conv / recurrent states in transformers' ``LinearAttentionLayer`` (``layer``; None for 0)."""

    kind = "state"

    def __init__(self, states: int):
        if not isinstance(states, int) or states < 0:
            raise CacheError(f"a state layer keeps an int >= 0 of conv / recurrent states, got {states!r}")
        self.states = states
        self.close()

    @classmethod
    def empty_like(cls, other: "RecurrentState") -> "RecurrentState":
        return cls(other.states)

    def _slots(self):
        """(name, store dict, initialized flags, i) for every conv / recurrent slot."""
        s = self.layer
        for i in range(self.states if s is not None else 0):
            yield f"conv.{i}", s.conv_states, s.is_conv_states_initialized, i
            yield f"recurrent.{i}", s.recurrent_states, s.is_recurrent_states_initialized, i

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: store[i] for name, store, flags, i in self._slots() if flags[i]}

    def holds(self) -> bool:
        """Whether a state counts as present (zeroed states after a reset count as absent)."""
        return self.layer is not None and any(self.layer.has_previous_state.values())

    def meta(self) -> dict:
        s = self.layer
        out = {"states": self.states, "recording": self.recording}
        for i in range(self.states if s is not None else 0):
            out[f"previous.{i}"], out[f"kernel.{i}"] = bool(s.has_previous_state[i]), s.conv_kernel_size[i]
        return out

    def upgrade(self, sd: dict) -> dict:
        """A state saved in the flat format (``states``, ``device``, ``previous.{i}``, ``kernel.{i}``,
        ``state.conv.{i}`` ...) as today's (``meta.*``, ``side.*``, ``side_state.device``)."""
        if "states" not in sd:
            return sd
        out = {"kind": sd["kind"], "side_state.device": sd.get("device")}
        for key, value in sd.items():
            if key.startswith("state."):
                out["side." + key[len("state."):]] = value
            elif key.startswith("attention."):
                out[key] = value
            elif key not in ("kind", "device"):
                out["meta." + key] = value
        return out

    def load(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        if field(meta, "states", self.kind) != self.states:
            raise CacheError(f"state of a state layer: {meta['states']} states, this layer keeps {self.states}")
        s = self.layer
        if s is None:
            return
        s.record_past = field(meta, "recording", self.kind, bool)
        for i in range(self.states):
            s.has_previous_state[i] = bool(meta[f"previous.{i}"])
            s.conv_kernel_size[i] = meta[f"kernel.{i}"]
        for name, store, flags, i in self._slots():
            if name in tensors:
                store[i], flags[i] = tensors[name].clone(), True  # its own copy
                s.device, s.dtype = store[i].device, store[i].dtype

    def index(self, idx: torch.Tensor) -> None:
        for name, store, flags, i in self._slots():
            if flags[i]:
                store[i] = store[i].index_select(0, idx.to(store[i].device))

    def validate_crop(self, n: int) -> None:
        if self.tensors() and not self.layer.record_past:
            raise CacheError("crop: a conv / recurrent state cannot be rolled back unless it was recording "
                             "(activate_past_recording() before the updates to roll back; transformers refuses too)")

    def crop(self, n: int) -> None:
        if self.tensors():
            self.layer.crop(-n)

    @property
    def recording(self) -> bool:
        return bool(self.layer is not None and self.layer.record_past)

    def set_recording(self, on: bool) -> None:
        s = self.layer
        if s is None:
            return
        if on:
            s.activate_past_recording()
        elif s.record_past:
            s.record_past = False
            for i, conv in s.conv_states.items():  # back to the working size (kernel)
                if conv is not None and conv.shape[-1] > s.conv_kernel_size[i]:
                    s.conv_states[i] = conv[..., -s.conv_kernel_size[i]:].clone()

    def reset(self) -> None:
        """As transformers' ``reset``: zeroed in place, counted as absent, memory and kernel sizes kept."""
        if self.layer is not None:
            self.layer.reset()

    def close(self) -> None:
        self.layer = LinearAttentionLayer(number_of_states=self.states) if self.states else None


class StateLayer(WithSideState):
    def __init__(self, states: int, attention: KVLayer | None = None):
        super().__init__(attention, RecurrentState(states))

    @property
    def states(self) -> int:
        return self.side.states

    @property
    def state(self) -> LinearAttentionLayer | None:
        return self.side.layer

    def conv_state(self, i: int = 0) -> torch.Tensor | None:
        s = self._state("get_conv_state")
        return s.conv_states[i] if s.has_previous_state[i] else None

    def recurrent_state(self, i: int = 0) -> torch.Tensor | None:
        s = self._state("get_recurrent_state")
        return s.recurrent_states[i] if s.has_previous_state[i] else None

    def update_conv_state(self, conv: torch.Tensor, i: int = 0, **kwargs) -> torch.Tensor:
        return self._state("update_conv_state").update_conv_state(conv, i, **kwargs)

    def update_recurrent_state(self, recurrent: torch.Tensor, i: int = 0, **kwargs) -> torch.Tensor:
        return self._state("update_recurrent_state").update_recurrent_state(recurrent, i, **kwargs)

    def has_previous_state(self, i: int | None = None) -> bool:
        s = self._state("has_previous_state")
        return all(s.has_previous_state.values()) if i is None else s.has_previous_state[i]

    def state_nbytes(self) -> int:
        """Bytes of the conv / recurrent states alone (part of ``nbytes()``)."""
        return self.side_nbytes()

    def _state(self, what: str) -> LinearAttentionLayer:
        if self.side.layer is None:
            raise CacheError(f"{what}: this layer keeps no conv / recurrent state (an attention-only or empty layer)")
        return self.side.layer
