"""``WithSideState``: a layer's attention chain plus a side state its model keeps beside the K/V.

    WithSideState(attention, side)     a ``Delegating`` layer (the chain builder makes one, ``tiercache.cache.chain``)
    layer.attention                    the layer's K/V chain, tiered by the policy like any attention layer
                                       (None for a layer without attention: ``NoAttention`` stands in)
    layer.side                         the side state (a ``SideState``), exact, on the model's device

Some layers keep more than K/V, or something else: the indexer keys of Dynamic Sparse Attention
(``tiercache.cache.indexed_layer``: DeepSeek-V3.2, GLM-MoE-DSA ...), the compressor state of
DeepSeek-V4's compressed attention (``tiercache.cache.compressed_layer``) and the conv /
recurrent states of hybrid and recurrent models (``tiercache.cache.state_layer``). This class
does the generic part once: every K/V call goes to the attention chain (``Delegating``), every
whole-layer operation (accounting, lifecycle, batch gather, crop, reset, close, recording,
retier's ``adopt``) covers both. The model reaches the side state through the subclass's own
methods (transformers' names: ``update_indexer``, ``update_conv_state`` ...).

A side state (``SideState``) speaks a small protocol:
    tensors() -> dict[str, Tensor]      what it has allocated now (the bytes ``nbytes`` counts)
    state_tensors() -> dict[str, Tensor]   what it holds (views; saved by ``state_dict``)
    meta() -> dict                      its plain (JSON) fields
    load(meta, tensors)                 replace its state by a saved one (tensors copied)
    upgrade(sd) -> sd                   a layer state saved in an older format, in today's (default: as is)
    holds() -> bool                     whether it holds a state (the default: any tensor)
    batch() -> int | None               the batch of its tensors
    index(idx)                          keep batch rows ``idx`` (beam reorder, select, repeat)
    validate_crop(n) / crop(n)          roll back the last ``n`` tokens, or ``CacheError``
    set_recording(on) / recording       keep what a rollback needs (default: nothing to keep)
    reset() / close()                   as new (``close`` frees what ``reset`` may keep)
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
from tiercache.layers.base import KVLayer, check_crop, move_state
from tiercache.layers.delegating import Delegating
from tiercache.layers.state import expect, nest, part


class SideState:
    """Base of side states: subclasses implement the protocol of the module docstring."""

    kind = "side"
    recording = False

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

    def upgrade(self, sd: dict) -> dict:
        return sd

    def holds(self) -> bool:
        return bool(self.tensors())

    def index(self, idx: torch.Tensor) -> None:
        raise NotImplementedError

    def validate_crop(self, n: int) -> None:
        """Default: nothing to roll back when nothing is held."""

    def crop(self, n: int) -> None:
        raise NotImplementedError

    def set_recording(self, on: bool) -> None:
        """Default: nothing a rollback needs is dropped."""

    def reset(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self.reset()

    def batch(self) -> int | None:
        return next((t.shape[0] for t in self.tensors().values() if t.dim()), None)

    def nbytes(self) -> dict[str, int]:
        return by_place(self.tensors().values())


class NoAttention(KVLayer):
    """The attention chain of a layer that has none (a recurrent or empty layer): holds nothing,
    refuses K/V, tracks no tokens."""

    def append(self, key: torch.Tensor, value: torch.Tensor):
        raise CacheError("update: this layer keeps a conv / recurrent state (or nothing), not attention K/V")

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise CacheError("get_mask_sizes: this layer keeps a conv / recurrent state (or nothing), not attention K/V")

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        raise CacheError("ingest: this layer keeps a conv / recurrent state (or nothing), not attention K/V")

    def layout(self):
        return None

    def seq_length(self) -> int:
        return 0

    def crop(self, n: int) -> None:
        check_crop(n, 0)

    def gather(self, index: torch.Tensor) -> None:
        """Nothing held: nothing to gather."""

    def reset(self) -> None:
        """Nothing held."""

    def kv(self, fetch: bool = False):
        return None

    def nbytes(self) -> dict[str, int]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        """Nothing to load."""

    def can_adopt(self, other: KVLayer) -> bool:
        return isinstance(other, NoAttention)

    def adopt(self, other: KVLayer) -> None:
        """Nothing to take."""


class WithSideState(Delegating):
    def __init__(self, attention: KVLayer | None, side: SideState):
        super().__init__(NoAttention() if attention is None else attention)
        self.side = side

    @property
    def attention(self) -> KVLayer | None:
        return None if isinstance(self.inner, NoAttention) else self.inner

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        if self.side.holds():
            raise CacheError(f"ingest: this layer keeps {self.side.kind} beside its K/V, which K/V tokens cannot "
                             "rebuild (legacy tuples carry attention K/V only)")
        self.inner.ingest(key, value, seen)

    @property
    def is_initialized(self) -> bool:
        return self.inner.is_initialized if self.attention is not None else bool(self.side.tensors())

    # -- whole-layer operations: both parts -------------------------------------------------------
    def validate_crop(self, n: int) -> None:
        self.inner.validate_crop(n)
        self.side.validate_crop(n)

    def crop(self, n: int) -> None:
        self.validate_crop(n)
        self.side.crop(n)
        self.inner.crop(n)

    def _rows(self) -> int | None:
        """The batch a gather is checked against: the K/V's, else the side state's (held or kept zeroed)."""
        batch = self.inner.batch_size()
        return self.side.batch() if batch is None else batch

    def gather(self, index: torch.Tensor) -> None:
        self.inner.gather(index)
        if self.side.batch() is not None:
            self.side.index(index)

    def reset(self) -> None:
        self.inner.reset()
        self.side.reset()

    def close(self) -> None:
        self.inner.close()
        self.side.close()

    def set_recording(self, on: bool) -> None:
        self.inner.set_recording(on)
        self.side.set_recording(on)

    @property
    def recording(self) -> bool:
        return bool(self.side.recording or self.inner.record_past)

    # -- accounting -----------------------------------------------------------------------------
    def nbytes(self) -> dict[str, int]:
        return summed([self.inner.nbytes(), self.side.nbytes()])

    def tier_nbytes(self) -> dict[str, int]:
        """The side state is device bytes (it stays on the model's device)."""
        return plus_device(self.inner.tier_nbytes(), self.side_nbytes())

    def side_nbytes(self) -> int:
        """Bytes of the side state alone (part of ``nbytes()``)."""
        return sum(self.side.nbytes().values())

    def batch_size(self) -> int | None:
        batch = self.inner.batch_size()
        return self.side.batch() if batch is None and self.side.holds() else batch

    # -- lifecycle ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        held = self.side.state_tensors()
        device = next((str(t.device) for t in held.values()), None)  # (a load with device= moves it: persist)
        sd = {"kind": self.side.kind, "side_state.device": device, **nest("meta.", self.side.meta())}
        sd.update(nest("side.", held))
        sd.update(nest("attention.", self.inner.state_dict()))
        return sd

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, self.side.kind)
        self.side.close()
        try:
            sd = self.side.upgrade(sd)
            self.inner.load_state_dict(part(sd, "attention."))
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
            other.side.meta().keys() == self.side.meta().keys()) and (
            (other.attention is None) == (self.attention is None))

    def adopt(self, other: "WithSideState") -> None:
        """Take ``other``'s state as held (retier): the side state moves as it is; the attention
        part by its chain's ``adopt`` when it can (same block format), else ``ingest(*export())``."""
        if not self.can_adopt(other):
            raise CacheError(f"adopt: a {type(other).__name__} cannot move into a {type(self).__name__} "
                             f"({self.side.kind})")
        move_state(other.inner, self.inner, other.recording)
        self.side, other.side = other.side, type(other.side).empty_like(other.side)
