"""``StateLayer``: a hybrid or recurrent model's layer that keeps a conv / recurrent state.

    StateLayer(states, attention=None)     a KVLayer (the chain builder makes it, ``tiercache.cache.chain``)
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

The KVLayer protocol goes to ``attention`` for K/V (a layer without one refuses ``append`` and
answers ``seq_length() == 0``) and covers the state too: ``nbytes`` / ``tier_nbytes`` (device
bytes), ``state_dict`` / ``load_state_dict`` (``state.conv.{i}`` / ``state.recurrent.{i}`` tensors,
lossless; loading copies them to the saved device), batch operations (beam reorder, select,
repeat), ``reset`` (zeroed in place, as transformers') / ``close`` (freed), ``set_recording`` (transformers'
``activate_past_recording``), ``crop`` (transformers' rule: a layer with a state crops only while
recording, else ``CacheError``). ``adopt`` (retier) moves the state as it is and the attention
part by its own chain's ``adopt`` or ``ingest(*export())``. ``export`` / ``ingest`` carry K/V only:
a state cannot be rebuilt from tokens' K/V (``from_legacy`` refuses models with state layers).

The cache reaches the state through ``conv_state(i)`` / ``update_conv_state`` /
``recurrent_state(i)`` / ``update_recurrent_state`` / ``has_previous_state(i)`` (transformers'
``Cache`` methods of those names, answered by ``TieredCache``).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from tiercache.cache.accounting import by_place, plus_device, summed
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer, check_batch_indices, check_crop, check_repeats
from tiercache.layers.state import expect, field, nest, part

_KINDS = ("conv", "recurrent")


class StateLayer(KVLayer):
    def __init__(self, states: int, attention: KVLayer | None = None):
        if not isinstance(states, int) or states < 0:
            raise CacheError(f"a state layer keeps an int >= 0 of conv / recurrent states, got {states!r}")
        self.states, self.attention = states, attention
        self.is_sliding = attention is not None and attention.is_sliding
        self.state = LinearAttentionLayer(number_of_states=states) if states else None

    # -- the conv / recurrent state (transformers' Cache methods) -------------------------------
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

    # -- K/V: the attention part ----------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor):
        return self._attention("update").append(key, value)

    def layout(self):
        return None if self.attention is None else self.attention.layout()

    def seq_length(self) -> int:
        return 0 if self.attention is None else self.attention.seq_length()

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._attention("get_mask_sizes").mask_sizes(query_length)

    def max_length(self) -> int:
        return -1 if self.attention is None else self.attention.max_length()

    def kv(self):
        return None if self.attention is None else self.attention.kv()

    def peek(self):
        return None if self.attention is None else self.attention.peek()

    def export(self):
        return None if self.attention is None else self.attention.export()

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        if self.state is not None:
            raise CacheError("ingest: this layer keeps a conv / recurrent state, which K/V tokens cannot rebuild "
                             "(legacy tuples carry attention K/V only)")
        self._attention("ingest").ingest(key, value, seen)

    @property
    def is_initialized(self) -> bool:
        return self.attention.is_initialized if self.attention is not None else self._any_state()

    # -- cache operations -----------------------------------------------------------------------
    def validate_crop(self, n: int) -> None:
        if self.attention is not None:
            self.attention.validate_crop(n)
        else:
            check_crop(n, 0)
        if self._any_state() and not self.state.record_past:
            raise CacheError("crop: a conv / recurrent state cannot be rolled back unless it was recording "
                             "(activate_past_recording() before the updates to roll back; transformers refuses too)")

    def crop(self, n: int) -> None:
        self.validate_crop(n)
        if self._any_state():
            self.state.crop(-n)
        if self.attention is not None:
            self.attention.crop(n)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._gather(beam_idx, "reorder", lambda a: a.reorder(beam_idx))

    def select(self, indices: torch.Tensor) -> None:
        self._gather(indices, "select", lambda a: a.select(indices))

    def repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        batch = self._state_batch()
        if self.attention is not None:
            self.attention.repeat_interleave(repeats)
        if batch is not None:
            self._index_states(torch.arange(batch).repeat_interleave(repeats))

    def reset(self) -> None:
        """As transformers' ``reset``: the states are zeroed in place and count as absent (no previous
        state) but keep their memory and kernel sizes; ``close`` frees them."""
        if self.attention is not None:
            self.attention.reset()
        if self.state is not None:
            self.state.reset()

    def close(self) -> None:
        if self.attention is not None:
            self.attention.close()
        self._fresh_state()

    def set_recording(self, on: bool) -> None:
        if self.attention is not None:
            self.attention.set_recording(on)
        if self.state is None:
            return
        if on:
            self.state.activate_past_recording()
        elif self.state.record_past:
            self.state.record_past = False
            for i, conv in self.state.conv_states.items():  # back to the working size (kernel)
                if conv is not None and conv.shape[-1] > self.state.conv_kernel_size[i]:
                    self.state.conv_states[i] = conv[..., -self.state.conv_kernel_size[i]:].clone()

    @property
    def recording(self) -> bool:
        return bool(self.state is not None and self.state.record_past) or bool(
            self.attention is not None and self.attention.record_past)

    def reserve(self, tokens: int) -> None:
        if self.attention is not None:
            self.attention.reserve(tokens)

    def prefetch(self) -> None:
        if self.attention is not None:
            self.attention.prefetch()

    def evict(self) -> None:
        if self.attention is not None:
            self.attention.evict()

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        return summed([self.attention.nbytes() if self.attention is not None else {},
                       by_place(self._tensors().values())])

    def tier_nbytes(self) -> dict[str, int]:
        """The states are device bytes (they stay on the model's device)."""
        return plus_device(self.attention.tier_nbytes() if self.attention is not None else {}, self.state_nbytes())

    def state_nbytes(self) -> int:
        """Bytes of the conv / recurrent states alone (part of ``nbytes()``)."""
        return sum(by_place(self._tensors().values()).values())

    def batch_size(self) -> int | None:
        batch = None if self.attention is None else self.attention.batch_size()
        if batch is None and self.state is not None and any(self.state.has_previous_state.values()):
            return self._state_batch()  # (zeroed states after a reset count as absent)
        return batch

    # -- lifecycle ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        s = self.state
        sd = {"kind": "state", "states": self.states, "recording": bool(s is not None and s.record_past),
              "device": None if s is None or s.device is None else str(s.device)}
        if s is not None:
            for i in range(self.states):
                sd[f"previous.{i}"] = bool(s.has_previous_state[i])
                sd[f"kernel.{i}"] = s.conv_kernel_size[i]
        sd.update({f"state.{k}": t for k, t in self._tensors().items()})
        if self.attention is not None:
            sd.update(nest("attention.", self.attention.state_dict()))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, "state")
        if field(sd, "states", "state") != self.states:
            raise CacheError(f"state of a state layer: {sd['states']} states, this layer keeps {self.states}")
        self._fresh_state()
        try:
            if self.attention is not None:
                self.attention.load_state_dict(part(sd, "attention."))
            if self.state is not None:
                self._load_states(sd)
        except (CacheError, KeyError, TypeError) as e:
            self.reset()
            raise e if isinstance(e, CacheError) else CacheError(f"state of a state layer is malformed: {e!r}") from e

    def can_adopt(self, other: KVLayer) -> bool:
        return isinstance(other, StateLayer) and other.states == self.states and (
            (other.attention is None) == (self.attention is None))

    def adopt(self, other: "StateLayer") -> None:
        """Take ``other``'s state as held (retier): the conv / recurrent tensors move as they are; the
        attention part by its chain's ``adopt`` when it can (same block format), else ``ingest(*export())``."""
        if not self.can_adopt(other):
            raise CacheError(f"adopt: a state layer of {other.states if isinstance(other, StateLayer) else 'no'} "
                             f"states cannot move into one of {self.states}")
        if self.attention is not None:
            if other.recording:
                self.attention.set_recording(True)
            if self.attention.can_adopt(other.attention):
                self.attention.adopt(other.attention)
            else:
                held = other.attention.export()
                if held is not None:
                    self.attention.ingest(*held)
        self.state, other.state = other.state, LinearAttentionLayer(number_of_states=self.states) if self.states else None

    # -- internals ------------------------------------------------------------------------------
    def _state(self, what: str) -> LinearAttentionLayer:
        if self.state is None:
            raise CacheError(f"{what}: this layer keeps no conv / recurrent state (an attention-only or empty layer)")
        return self.state

    def _attention(self, what: str) -> KVLayer:
        if self.attention is None:
            raise CacheError(f"{what}: this layer keeps a conv / recurrent state (or nothing), not attention K/V")
        return self.attention

    def _fresh_state(self) -> None:
        self.state = LinearAttentionLayer(number_of_states=self.states) if self.states else None

    def _any_state(self) -> bool:
        s = self.state
        return s is not None and any(s.is_conv_states_initialized.values()) or (
            s is not None and any(s.is_recurrent_states_initialized.values()))

    def _tensors(self) -> dict[str, torch.Tensor]:
        s, out = self.state, {}
        if s is None:
            return out
        for i in range(self.states):
            if s.is_conv_states_initialized[i]:
                out[f"conv.{i}"] = s.conv_states[i]
            if s.is_recurrent_states_initialized[i]:
                out[f"recurrent.{i}"] = s.recurrent_states[i]
        return out

    def _state_batch(self) -> int | None:
        return next((t.shape[0] for t in self._tensors().values()), None)

    def _gather(self, indices, what: str, on_attention) -> None:
        batch = self._state_batch()
        index = None if batch is None else check_batch_indices(indices, batch, what)  # validated before any change
        if self.attention is not None:
            on_attention(self.attention)
        if index is not None:
            self._index_states(index)

    def _index_states(self, index: torch.Tensor) -> None:
        s = self.state
        for i in range(self.states):
            if s.is_conv_states_initialized[i]:
                s.conv_states[i] = s.conv_states[i].index_select(0, index.to(s.conv_states[i].device))
            if s.is_recurrent_states_initialized[i]:
                s.recurrent_states[i] = s.recurrent_states[i].index_select(0, index.to(s.recurrent_states[i].device))

    def _load_states(self, sd: dict) -> None:
        s, device = self.state, sd.get("device")
        s.record_past = field(sd, "recording", "state", bool)
        for i in range(self.states):
            s.has_previous_state[i] = bool(sd[f"previous.{i}"])
            s.conv_kernel_size[i] = sd[f"kernel.{i}"]
            for kind, store, flags in (("conv", s.conv_states, s.is_conv_states_initialized),
                                       ("recurrent", s.recurrent_states, s.is_recurrent_states_initialized)):
                t = sd.get(f"state.{kind}.{i}")
                if t is not None:
                    if not isinstance(t, torch.Tensor):
                        raise CacheError(f"state of a state layer: state.{kind}.{i} is not a tensor")
                    store[i] = t.to(device if device is not None else t.device, copy=True)  # its own copy
                    flags[i] = True
                    s.device, s.dtype = store[i].device, store[i].dtype
