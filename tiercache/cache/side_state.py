"""``WithSideState``: an attention layer's chain plus a side state its model keeps beside the K/V.

    WithSideState(attention, side)     a KVLayer (the chain builder makes one, ``tiercache.cache.chain``)
    layer.attention                    the layer's K/V chain, tiered by the policy like any attention layer
    layer.side                         the side state (a ``SideState``), exact, on the model's device

Some attention layers keep more than K/V: the indexer keys of Dynamic Sparse Attention
(``tiercache.cache.indexed_layer``: DeepSeek-V3.2, GLM-MoE-DSA ...) and the compressor state
of DeepSeek-V4's compressed attention (``tiercache.cache.compressed_layer``). This class does
the generic part once: every K/V call of the layer protocol goes to ``attention``, every
whole-layer operation (accounting, lifecycle, batch operations, reset, close, retier's
``adopt``) covers both. The model reaches the side state through the subclass's own methods
(transformers' names: ``update_indexer``, ``store_compression_weights`` ...).

A side state (``SideState``) speaks a small protocol:
    tensors() -> dict[str, Tensor]      what it has allocated now (the bytes ``nbytes`` counts)
    state_tensors() -> dict[str, Tensor]   what it holds (views; saved by ``state_dict``)
    meta() -> dict                      its plain (JSON) fields
    load(meta, tensors)                 replace its state by a saved one (tensors copied)
    index(idx)                          keep batch rows ``idx`` (beam reorder, select, repeat)
    validate_crop(n) / crop(n)          roll back the last ``n`` tokens, or ``CacheError``
    reset()                             as new
    empty_like(other) (classmethod)     a new, empty side state of ``other``'s kind and geometry

``state_dict`` holds ``kind``, ``meta.*`` (the side state's plain fields), ``side.*`` (its tensors,
views), ``side_state.device`` (where they live: ``load(device=)`` moves them) and ``attention.*``
(the chain's state); loading copies the tensors (the side state's ``load`` clones them).

``export`` / ``ingest`` carry K/V only: a side state cannot be rebuilt from tokens' K/V, so such
a layer refuses ``ingest`` once it holds a side state, and legacy tuples refuse the model.
"""

from __future__ import annotations

import torch

from tiercache.cache.accounting import by_place, plus_device, summed
from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer, check_batch_indices, check_repeats
from tiercache.layers.state import expect, nest, part


class SideState:
    """Base of side states: subclasses implement the protocol of the module docstring."""

    kind = "side"

    @classmethod
    def empty_like(cls, other: "SideState") -> "SideState":
        raise NotImplementedError

    def tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.tensors()

    def meta(self) -> dict:
        return {}

    def load(self, meta: dict, tensors: dict[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def index(self, idx: torch.Tensor) -> None:
        raise NotImplementedError

    def validate_crop(self, n: int) -> None:
        """Default: nothing to roll back when nothing is held."""

    def crop(self, n: int) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def batch(self) -> int | None:
        return next((t.shape[0] for t in self.tensors().values() if t.dim() and self.batch_dim(t) == 0), None)

    def batch_dim(self, t: torch.Tensor) -> int:
        return 0

    def nbytes(self) -> dict[str, int]:
        return by_place(self.tensors().values())


class WithSideState(KVLayer):
    def __init__(self, attention: KVLayer, side: SideState):
        self.attention, self.side = attention, side
        self.is_sliding = attention.is_sliding

    # -- K/V: the attention chain ---------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor):
        return self.attention.append(key, value)

    def layout(self):
        return self.attention.layout()

    def seq_length(self) -> int:
        return self.attention.seq_length()

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.mask_sizes(query_length)

    def max_length(self) -> int:
        return self.attention.max_length()

    def kv(self):
        return self.attention.kv()

    def peek(self):
        return self.attention.peek()

    def export(self):
        return self.attention.export()

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        if self.side.tensors():
            raise CacheError(f"ingest: this layer keeps {self.side.kind} beside its K/V, which K/V tokens cannot "
                             "rebuild (legacy tuples carry attention K/V only)")
        self.attention.ingest(key, value, seen)

    @property
    def is_initialized(self) -> bool:
        return self.attention.is_initialized

    # -- cache operations -----------------------------------------------------------------------
    def validate_crop(self, n: int) -> None:
        self.attention.validate_crop(n)
        self.side.validate_crop(n)

    def crop(self, n: int) -> None:
        self.validate_crop(n)
        self.side.crop(n)
        self.attention.crop(n)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._gather(beam_idx, "reorder", lambda a: a.reorder(beam_idx))

    def select(self, indices: torch.Tensor) -> None:
        self._gather(indices, "select", lambda a: a.select(indices))

    def repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        batch = self.side.batch()
        self.attention.repeat_interleave(repeats)
        if batch is not None:
            self.side.index(torch.arange(batch).repeat_interleave(repeats))

    def reset(self) -> None:
        self.attention.reset()
        self.side.reset()

    def close(self) -> None:
        self.attention.close()
        self.side.reset()

    def set_recording(self, on: bool) -> None:
        self.attention.set_recording(on)

    @property
    def recording(self) -> bool:
        return bool(self.attention.record_past)

    def reserve(self, tokens: int) -> None:
        self.attention.reserve(tokens)

    def prefetch(self) -> None:
        self.attention.prefetch()

    def evict(self) -> None:
        self.attention.evict()

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        return summed([self.attention.nbytes(), self.side.nbytes()])

    def tier_nbytes(self) -> dict[str, int]:
        """The side state is device bytes (it stays on the model's device)."""
        return plus_device(self.attention.tier_nbytes(), self.side_nbytes())

    def side_nbytes(self) -> int:
        """Bytes of the side state alone (part of ``nbytes()``)."""
        return sum(self.side.nbytes().values())

    def batch_size(self) -> int | None:
        batch = self.attention.batch_size()
        return self.side.batch() if batch is None else batch

    # -- lifecycle ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        held = self.side.state_tensors()
        device = next((str(t.device) for t in held.values()), None)  # (a load with device= moves it: persist)
        sd = {"kind": self.side.kind, "side_state.device": device, **nest("meta.", self.side.meta())}
        sd.update(nest("side.", held))
        sd.update(nest("attention.", self.attention.state_dict()))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, self.side.kind)
        self.side.reset()
        try:
            self.attention.load_state_dict(part(sd, "attention."))
            tensors = part(sd, "side.")
            if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise CacheError(f"state of a {self.side.kind} layer: a side. entry is not a tensor")
            device = sd.get("side_state.device")
            if device is not None:  # the saved compute device (or the one load(device=) asks for)
                tensors = {k: t.to(device) for k, t in tensors.items()}
            self.side.load(part(sd, "meta."), tensors)
        except (CacheError, KeyError, TypeError, ValueError) as e:
            self.reset()
            raise e if isinstance(e, CacheError) else CacheError(
                f"state of a {self.side.kind} layer is malformed: {e!r}") from e

    def can_adopt(self, other: KVLayer) -> bool:
        return isinstance(other, WithSideState) and type(other.side) is type(self.side) and (
            other.side.meta().keys() == self.side.meta().keys())

    def adopt(self, other: "WithSideState") -> None:
        """Take ``other``'s state as held (retier): the side state moves as it is; the attention
        part by its chain's ``adopt`` when it can (same block format), else ``ingest(*export())``."""
        if not self.can_adopt(other):
            raise CacheError(f"adopt: a {type(other).__name__} cannot move into a {type(self).__name__} "
                             f"({self.side.kind})")
        if other.recording:
            self.attention.set_recording(True)
        if self.attention.can_adopt(other.attention):
            self.attention.adopt(other.attention)
        else:
            held = other.attention.export()
            if held is not None:
                self.attention.ingest(*held)
        self.side, other.side = other.side, type(other.side).empty_like(other.side)

    # -- internals ------------------------------------------------------------------------------
    def _gather(self, indices, what: str, on_attention) -> None:
        batch = self.side.batch()
        index = None if batch is None else check_batch_indices(indices, batch, what)  # validated before any change
        on_attention(self.attention)
        if index is not None:
            self.side.index(index)

