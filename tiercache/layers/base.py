"""The layer protocol: one attention layer's K/V store. Storage layers and processors share it.

Tensors are ``[B, H, T, D]`` (batch, kv heads, tokens, head dim); keys and values may differ in D.

Required (the core: what attention and the cache's operations need, and no more)
    append(key, value) -> (keys, values)
        Append ``T`` new tokens; return what attention must see, ``[B, H, S, D]``, already in
        order. The returned tensors may be views of internal buffers: they are valid until the
        next call on the same cache. It trusts its input: the pair was checked once, by
        ``tiercache.layers.validate.check_update`` (a processor appends to the layer it wraps
        what it derived from such a pair). ``update(key, value)`` (here, not overridden) is that
        check then ``append``: what a layer used on its own is called with.
    kv(fetch=False) -> (keys, values) | None
        The one read path: what the layer holds, ``[B, H, S, D]`` at full precision on the compute
        device, oldest first; None while it holds no token (before the first update, after
        ``reset``, cropped empty). Views of the layer's own memory for storage layers, fresh
        tensors for processors (dequantized; copied from the host tier). Processors read the layer
        they wrap through it (never through its attributes); ``keys`` / ``values`` and ``export``
        are built on it here, once, for every layer.
        No side effect by default (nothing fetched, evicted or written). ``fetch=True`` is the read
        of a layer about to be used (a processor's hot path): an offloaded layer answers from its
        device mirror (acquired from the prefetcher's pool, which may evict another layer's slot,
        and starts the next prefetch; views valid until the next call on the cache), and a
        quantized layer's codecs keep views of the rows for its next step.
    seq_length() -> int
        Tokens seen so far (positions), including any a sliding layer has since dropped.
    crop(n)
        Remove the last ``n >= 0`` tokens; all of them when ``n > seq_length()`` (as transformers'
        ``DynamicLayer``: cropping past the start empties the layer). ``crop(0)`` lets a sliding
        layer trim what it kept for a rollback back to its working size.
    gather(index)
        Keep batch rows ``index`` (a checked long tensor ``[B']``): the one batch primitive. Beam
        reorder (``B' == B``), batch select (fewer) and repeat-interleave (more) are made of it
        here, checked against ``batch_size()`` (``reorder`` / ``select`` / ``repeat_interleave``,
        no-ops on a layer never written). A layer with nothing held just takes the new batch.
    nbytes() -> dict[place, int]
        Bytes held now, per place (``"cpu"``, ``"cuda:0"``, ``"disk"``): allocated, not logical.
    layout() -> KVSpec | None
        What the next update must match (``tiercache.layers.spec.KVSpec``: batch, heads, head
        dims, dtype, compute device), None before the first update; cheap, no side effect.
        Irreducible beside ``kv()``: an emptied layer still holds its layout (an update must
        match it), and a processor's layout is not its inner's (an offloaded layer computes on
        the device, its host copy lives on the CPU; a quantized store holds uint8 rows).
    reset()
        Drop everything; the layer is as new (it re-learns shape, dtype and device). Not a
        ``crop(seq_length())``, which empties the layer but keeps its layout and its buffers.

Derived here from the core (a layer overrides one only where it differs)
    mask_sizes(query_length) -> (kv_length, kv_offset)
        For the *next* update of ``query_length`` tokens: how many keys it returns and the
        position of the first one (transformers' ``get_mask_sizes``). From ``seq_length()``:
        every token, or, for a sliding layer (``is_sliding``, window ``max_length()``), the last
        ``window - 1`` held plus the new ones. A padded static layer returns all its slots.
    validate_crop(n)
        Raise ``CacheError`` if ``crop(n)`` would be refused, changing nothing (here: ``n`` is an
        int ``>= 0``; a sliding layer also checks it still holds the tokens it would need after
        the crop). ``TieredCache.crop`` asks every layer first, so a refused crop changes no layer.
    batch_size() -> int | None
        The batch the layer holds (None before its first update): ``layout()``'s.
    is_initialized
        Whether the layer has had an update since it was built or reset: it has a ``layout()``.
    tier_nbytes() -> dict[tier, int]
        ``nbytes()`` keyed by tier kind (``"device"``, ``"host"``, ``"disk"``): host-tier bytes
        stay apart from compute-device bytes even when both are the CPU, so the kind cannot be
        read from the place. Here: a storage layer's, every byte on its one ``tier``
        (``tiercache.layers.tiers``); a processor adds what it holds beside its inner layer.
    keys / values
        ``kv()``'s halves, read-only (transformers' layer attributes).

Lifecycle (what save / load / fork / retier are made of)
    state_dict() -> dict
        The layer's whole state, lossless: flat keys, values are tensors (views of the layer's
        own buffers, left where they live: device, host or disk) or plain JSON values
        (``tiercache.layers.state``); a processor nests what it wraps (``inner.``, ``store.``).
        Includes ``seen``, the spec and the recording flag. No side effect (no fetch, no copy).
    load_state_dict(sd)
        Replace the layer's state by ``sd`` (tensors copied onto this layer's own tiers). The
        chain must be the one the same layer policy builds (the chain builder is the only
        constructor). ``CacheError`` on a malformed state; then the layer is left empty.
    export() -> (keys, values, seen) | None
        What the layer holds at full precision, ``[B, H, S, D]`` on the compute device (the
        newest ``S`` of ``seen`` tokens; quantized blocks dequantized into fresh tensors, other
        layers may return views), None before the first update. No side effect. The default is
        ``kv()`` with ``seq_length()``.
    ingest(keys, values, seen)
        Bulk load, not an attention step: afterwards the layer holds what it would hold had it
        been fed ``seen`` tokens ending with these (a sliding layer keeps its window and its
        ``seen``; Quantize splits blocks and residual by the KIVI rule). Replaces any state.

Optional hooks (no-op defaults here)
    reserve(tokens)     the layer will hold about ``tokens`` tokens (the context, when known):
                        a growable full-precision buffer allocates that room at its next
                        allocation, so filling up to it copies nothing (``layers/buffer.py``)
    prefetch()          start bringing the layer to the compute device (offload)
    evict()             drop any device copy of the layer (offload); the next use fetches it again
    can_adopt(other) / adopt(other)
                        take ``other``'s held state as it is held (Quantize: packed blocks of the
                        same block format move without re-quantization); False / refused by default
    set_recording(on)   keep tokens a sliding layer would drop until the next crop (assisted decoding)
    close()             release files and buffers for good

The lifecycle four are the ``Lifecycle`` protocol (``state_dict``, ``load_state_dict``,
``export``, ``ingest``): what save / load / fork / retier need, apart from what attention needs.

A wrapper derives from ``tiercache.layers.delegating.Delegating(inner)``: every call of both
protocols and every hook goes to ``inner`` unchanged, and a wrapper states only what it changes.

Class attributes: ``is_sliding``, ``is_compileable``, ``max_length()`` (-1 when unbounded).

Checks shared by layers and the cache: ``check_crop``, ``check_batch_indices``, ``check_repeats``
(an update's: ``tiercache.layers.validate``). ``move_state(old, new)``: one chain's state into
another (``adopt`` when it can, else ``ingest(*export())``): retier, and a side-state layer's ``adopt``.

``record_past`` is transformers' layer attribute for that mode: reading it says whether the layer
records (``recording``, False unless a layer defines it), and assigning it calls
``set_recording`` (transformers' generate sets ``layer.record_past = False`` on each layer when
it hands a cache back after a deferred stop).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tiercache.errors import CacheError
from tiercache.layers.spec import KVSpec
from tiercache.layers.validate import check_update


class Lifecycle(ABC):
    """What save / load / fork / retier are made of (module docstring: Lifecycle)."""

    @abstractmethod
    def state_dict(self) -> dict: ...

    @abstractmethod
    def load_state_dict(self, sd: dict) -> None: ...

    @abstractmethod
    def export(self) -> tuple[torch.Tensor, torch.Tensor, int] | None: ...

    @abstractmethod
    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None: ...


class KVLayer(Lifecycle):
    is_sliding: bool = False
    is_compileable: bool = False
    policy = None  # the LayerPolicy it was built from (set by the chain builder on a chain's outer layer)

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Checked once here (``CacheError``, the layer unchanged), then appended (``append``)."""
        check_update(self, key, value)
        return self.append(key, value)

    @abstractmethod
    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def layout(self) -> KVSpec | None: ...

    @abstractmethod
    def seq_length(self) -> int: ...

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        seen = self.seq_length()
        if not self.is_sliding:
            return seen + query_length, 0
        window = self.max_length()
        return min(seen, window - 1) + query_length, max(seen - window + 1, 0)

    @abstractmethod
    def crop(self, n: int) -> None: ...

    @abstractmethod
    def gather(self, index: torch.Tensor) -> None: ...

    def reorder(self, beam_idx: torch.Tensor) -> None:
        self._gather_checked(beam_idx, "reorder")

    def select(self, indices: torch.Tensor) -> None:
        self._gather_checked(indices, "select")

    def repeat_interleave(self, repeats: int) -> None:
        check_repeats(repeats)
        batch = self._rows()
        if batch is not None:
            self.gather(torch.arange(batch).repeat_interleave(repeats))

    def _gather_checked(self, indices: torch.Tensor, what: str) -> None:
        batch = self._rows()
        if batch is not None:  # never written (or reset): nothing to gather, as in transformers
            self.gather(check_batch_indices(indices, batch, what))

    def _rows(self) -> int | None:
        """The batch a gather is checked against (``batch_size()``)."""
        return self.batch_size()

    @abstractmethod
    def reset(self) -> None: ...

    @abstractmethod
    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None: ...

    def _kv_or_empty(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``kv()``, or the layout's zero-token pair when the layer holds none; None before the first update."""
        held = self.kv()
        if held is None:
            spec = self.layout()
            return None if spec is None else spec.empty()
        return held

    @abstractmethod
    def nbytes(self) -> dict[str, int]: ...

    @property
    def keys(self) -> torch.Tensor | None:
        """The keys the layer holds, ``[B, H, S, D]`` at full precision (transformers' attribute).

        None before the first update and after ``reset``; ``S`` is 0 once cropped empty (as
        ``DynamicLayer``). Read-only, and reading never changes the layer. Cost: a storage
        layer returns a view of its memory (valid until the next call on the cache); a quantized
        layer dequantizes its whole history into fresh tensors on every read; an offloaded layer
        copies its host copy (or packed blocks) to the compute device on every read. Reading
        ``keys`` and then ``values`` pays that twice: ``kv()`` returns both at once.
        """
        held = self._kv_or_empty()
        return None if held is None else held[0]

    @property
    def values(self) -> torch.Tensor | None:
        """The values the layer holds, ``[B, H, S, D]``: as ``keys`` (same cost, same rules)."""
        held = self._kv_or_empty()
        return None if held is None else held[1]

    def tier_nbytes(self) -> dict[str, int]:
        return {self.tier.kind: n for n in self.nbytes().values()}

    def batch_size(self) -> int | None:
        spec = self.layout()
        return None if spec is None else spec.batch

    def export(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        held = self._kv_or_empty()
        return None if held is None else (*held, self.seq_length())

    def max_length(self) -> int:
        return -1

    def validate_crop(self, n: int) -> None:
        check_crop(n, self.seq_length())

    @property
    def is_initialized(self) -> bool:
        """Whether the layer has had an update since it was built or reset (transformers' layer
        attribute; read-only): it has a layout."""
        return self.layout() is not None

    def reserve(self, tokens: int) -> None:
        """Hook: room for ``tokens`` tokens in all, when the layer allocates next (a capacity hint)."""

    def prefetch(self) -> None:
        """Hook: begin moving this layer to the compute device ahead of use."""

    def evict(self) -> None:
        """Hook: drop any device copy (an offloaded layer's mirror); the next use fetches it again."""

    def can_adopt(self, other: "KVLayer") -> bool:
        """Whether ``adopt(other)`` can take ``other``'s state as held (else use ``ingest(*other.export())``)."""
        return False

    def adopt(self, other: "KVLayer") -> None:
        raise CacheError(f"{type(self).__name__} cannot adopt the state of a {type(other).__name__}; "
                         "use ingest(*other.export())")

    def set_recording(self, on: bool) -> None:
        """Hook: keep tokens that would slide out until the next ``crop``."""

    @property
    def record_past(self) -> bool:
        """Whether the layer keeps tokens for a rollback (transformers' attribute; assignable)."""
        return bool(getattr(self, "recording", False))

    @record_past.setter
    def record_past(self, on: bool) -> None:
        self.set_recording(bool(on))

    def close(self) -> None:
        """Hook: release files and buffers for good."""


def move_state(old: KVLayer, new: KVLayer, recording: bool | None = None) -> None:
    """``new`` takes ``old``'s state: as held (``adopt``: the same block format, packed blocks move as
    they are, or host copy to host copy) when it can, else ``ingest(*old.export())``. Recording
    (``recording``, default ``old.record_past``) is set first: a recording sliding layer ingests all
    it is given, not ``window - 1``."""
    if old.record_past if recording is None else recording:
        new.set_recording(True)
    if new.can_adopt(old):
        new.adopt(old)
    else:
        held = old.export()
        if held is not None:
            new.ingest(*held)


def check_crop(n: int, seq_length: int) -> int:
    """Validate a crop count; returns the tokens it really removes: ``min(n, seq_length)``
    (cropping past the start empties the layer, as transformers' ``DynamicLayer``)."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CacheError(f"crop(n) needs an int n >= 0 (tokens to remove), got {n!r}")
    return min(n, seq_length)


def check_batch_indices(indices: torch.Tensor, batch: int, what: str) -> torch.Tensor:
    """Validate beam / select indices against the batch size; returns them as a long tensor."""
    idx = torch.as_tensor(indices)
    if idx.dtype == torch.bool:
        if idx.numel() != batch:
            raise CacheError(f"{what}: boolean mask has {idx.numel()} entries, batch is {batch}")
        idx = idx.nonzero().flatten()
    if idx.dim() != 1 or idx.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise CacheError(f"{what}: expected a 1-D integer index tensor, got shape {tuple(idx.shape)} {idx.dtype}")
    if idx.numel() and (int(idx.min()) < -batch or int(idx.max()) >= batch):
        raise CacheError(f"{what}: indices must lie in [-{batch}, {batch}) (batch {batch}), got {idx.tolist()}")
    if what == "reorder" and idx.numel() != batch:
        raise CacheError(f"reorder: a beam reorder keeps the batch of {batch}, got {idx.numel()} indices; "
                         "use batch_select_indices / batch_repeat_interleave to change it")
    return idx.long() % max(batch, 1)


def check_repeats(repeats: int) -> None:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise CacheError(f"repeat_interleave(repeats) needs an int >= 1, got {repeats!r}")
