"""A contiguous, growable K/V buffer with chunked capacity: the memory behind ``full`` and ``sliding``.

It holds tokens ``[start, end)`` of two tensors ``[B, H, capacity, D]`` allocated on a tier.
Appending writes into spare capacity; only when that runs out is a larger buffer allocated and
the held tokens copied once. So per-token cost does not grow with history, and readers get
views, never a concatenation.

How much a regrowth allocates (``layers/capacity.py``; the planner predicts ``nbytes()`` by the
same functions): ``geometric`` (full-precision ``full`` storage) grows on the ladder of
``grown_capacity`` (2^k and 1.5 x 2^k whole chunks: growing to a capacity ``C`` copies about
``2.4 C`` tokens at most, however the tokens arrive, instead of the whole history at every chunk); otherwise
(sliding buffers, quantized stores: chunk 1, exact packed size) ``capacity_for``, whole chunks.
``reserve(tokens)`` grows once to ``capacity_for(tokens)`` when the context is known (chunked
prefill), so filling up to it copies nothing. Each regrowth's copy is counted by
``layers/regrowth.py`` under the tier's kind.

``state_dict()`` is ``spec``, ``capacity`` and the held ``keys`` / ``values`` (views, ``[B, H, n,
D]``); ``load_state_dict(sd)`` allocates the same capacity on this buffer's own tier and copies
the held tokens in (so a loaded buffer reports the same ``nbytes()``). A buffer whose tensors are
*lent* memory (``lent``: views of a step workspace's slot, ``tiercache.serve.workspace``) reports
``own_capacity()`` instead: the room its tokens take in memory of their own, so a copy of it (a
fork) allocates that, never the workspace's padding.

The decode step (``append_view``; ``step``, the same write with no check before it, for the
cache's ``full`` layers) is the hot path of a model's forward, once per layer: it makes four torch
calls, the fewest the write allows.
Each tensor takes its token with one ``index_copy_`` (no destination view to make first), at a
one-element position tensor shared by every buffer on that device (``_Positions``: the layers of
a step write at the same position, so it is made once per step), and is read back with one
``as_strided`` of the geometry kept at allocation (``_bind``). Anything else (several tokens, a
full buffer, a dropped front, memory on another device than the tokens) takes ``append`` and
``view``: ``narrow`` and ``copy_``. Memory lent by another owner (the serve workspace's slots)
comes and goes through ``lend`` / ``detach``, so the kept geometry follows it.
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers import regrowth
from tiercache.layers.base import KVLayer
from tiercache.layers.capacity import CHUNK, capacity_for, grown_capacity  # the allocation rules (also the planner's)
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import field, held_pair, spec_from, spec_state
from tiercache.layers.tiers import nbytes_of


class _Positions(dict):
    """``positions[i]``: a one-element int64 tensor holding ``i`` on one device (the index of a
    one-token ``index_copy_``), made on first use and kept while few are: the buffers of one
    model's layers write their decode step's token at the same position. Each is a view of a
    ``torch.arange`` made on the device (``[n]``, doubled when a position passes it), never a
    tensor copied from the host: on CUDA such a copy from pageable memory would wait for the
    device once per decode step."""

    KEEP = 64

    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.table = torch.arange(0, dtype=torch.long, device=device)  # [n]: 0 .. n-1

    def __missing__(self, i: int) -> torch.Tensor:
        if len(self) >= self.KEEP:
            self.clear()
        if i >= len(self.table):
            self.table = torch.arange(max(2 * len(self.table), i + 1, 256), dtype=torch.long, device=self.device)
        at = self[i] = self.table.narrow(0, i, 1)
        return at


_POSITIONS: dict[torch.device, _Positions] = {}  # one per device


def _positions(device: torch.device) -> _Positions:
    table = _POSITIONS.get(device)
    if table is None:
        table = _POSITIONS[device] = _Positions(device)
    return table


class Buffer:
    def __init__(self, tier, chunk: int = CHUNK, geometric: bool = False):
        self.tier = tier
        self.chunk = chunk
        self.geometric = bool(geometric)  # regrow on grown_capacity's ladder (else whole chunks)
        self.reserved = 0  # tokens of room asked by ``reserve`` (0: none)
        self.spec: KVSpec | None = None
        self.keys: torch.Tensor | None = None  # [B, H, capacity, Dk]
        self.values: torch.Tensor | None = None  # [B, H, capacity, Dv]
        self.start = 0
        self.end = 0
        self.lent = False  # keys / values are views of memory it does not own (a workspace slot)
        self._geometry = None  # (capacity, B, H, Dk, Dv, key stride, value stride, positions): see _bind

    # -- reading ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def view(self, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of held tokens ``[lo, hi)`` (relative to the oldest held token)."""
        n = (self.end - self.start if hi is None else hi) - lo
        a = self.start + lo
        return self.keys.narrow(2, a, n), self.values.narrow(2, a, n)  # [B, H, hi-lo, D] (narrow: cheaper than [:, :, a:b])

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of every held token, zero-token tensors when none (needs a spec)."""
        return self.view() if self.keys is not None else self.spec.empty()  # [B, H, S, D]

    def nbytes(self) -> dict[str, int]:
        if self.keys is None:
            return {}
        return {self.tier.place(self.spec.device): nbytes_of(self.keys, self.values)}

    def state_dict(self) -> dict:
        if self.spec is None:
            return {"spec": None}
        k, v = self.held()
        capacity = self.own_capacity() if self.lent else self.capacity
        return {"spec": spec_state(self.spec), "capacity": capacity, "keys": k, "values": v}

    def own_capacity(self) -> int:
        """The capacity the held tokens take in memory of this buffer's own (what ``ingest`` of
        them allocates: the regrowth rule, its reservation honoured)."""
        if self.keys is None:
            return 0
        return self._capacity_for(len(self))

    def load_state_dict(self, sd: dict, kind: str) -> None:
        """Replace the held tokens by the state's (copied onto this tier); ``CacheError`` when the
        state is malformed, checked before anything changes."""
        spec = spec_from(sd.get("spec"))
        if spec is None:
            self.clear()
            return
        capacity = field(sd, "capacity", kind)
        k, v = sd.get("keys"), sd.get("values")
        n = k.shape[2] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
        k, v = held_pair(sd, spec, n, kind)
        if n > capacity:
            raise CacheError(f"state of a {kind} layer: {n} tokens held in a capacity of {capacity}")
        self.clear()
        self.spec = spec
        if capacity:
            self._replace(self._alloc(spec.batch, capacity, spec.key_dim), self._alloc(spec.batch, capacity, spec.value_dim))
            self.keys[:, :, :n].copy_(k)
            self.values[:, :, :n].copy_(v)
        self.start, self.end = 0, n

    def ingest(self, key: torch.Tensor, value: torch.Tensor, spec: KVSpec, slack: int = 0) -> None:
        """Hold exactly ``key`` / ``value``, allocated as an append of them to an empty buffer."""
        self.clear()
        self.spec = spec
        self.append(key, value, slack)

    # -- writing ------------------------------------------------------------------------------
    def append(self, key: torch.Tensor, value: torch.Tensor, slack: int = 0) -> None:
        """Write ``T`` tokens after the held ones; ``slack`` extra tokens of room when regrowing."""
        keys, end, t = self.keys, self.end, key.shape[2]
        if keys is None or end + t > keys.shape[2]:  # (a first update may have no tokens)
            self._make_room(key, value, t + slack)
            keys, end = self.keys, self.end
        keys.narrow(2, end, t).copy_(key, True)  # non_blocking (positional: a keyword costs a parse per call)
        self.values.narrow(2, end, t).copy_(value, True)
        self.end = end + t

    def append_view(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``append(key, value)`` then ``view()``: the decode step's path (module docstring)."""
        out = self.step(key, value) if key.shape[2] == 1 else None
        if out is None:
            self.append(key, value)
            return self.view()
        return out

    def step(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The one-token write of ``append_view`` into spare room, checked by torch alone: ``None``
        (nothing written) where there is no room, a front is dropped or nothing is allocated yet.
        ``index_copy_`` takes only a source of exactly the held layout's shape with one token
        (same batch, heads, head dim), dtype and device, and raises otherwise, before this buffer
        counts the token (a key written before a refused value lies past ``end``: never read), so
        the cache's decode step can write first and explain a refusal afterwards."""
        end, geometry = self.end, self._geometry
        if geometry is None or self.start or end >= geometry[0]:
            return None
        _, b, h, dk, dv, ks, vs, positions = geometry
        at = positions[end]
        keys = self.keys.index_copy_(2, at, key)
        values = self.values.index_copy_(2, at, value)
        self.end = n = end + 1
        return keys.as_strided((b, h, n, dk), ks), values.as_strided((b, h, n, dv), vs)  # [B, H, n, D]

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` held tokens in all: the next allocation (now, when tokens are held)
        takes ``capacity_for(tokens)``, so appends up to it copy nothing. The largest asked stays
        until ``reset_reserve()`` (a layer's ``reset``)."""
        self.reserved = max(self.reserved, int(tokens))
        if self.keys is not None and self.reserved > self.capacity:
            self._regrow(self.reserved)

    def reset_reserve(self) -> None:
        self.reserved = 0

    def truncate(self, n: int) -> None:
        """Forget the newest ``n`` held tokens."""
        self.end -= n

    def drop_front(self, n: int) -> None:
        """Forget the oldest ``n`` held tokens (their room is reclaimed at the next regrow)."""
        self.start = min(self.start + n, self.end)

    def gather(self, index: torch.Tensor) -> None:
        """Batch rows ``index`` (beam reorder, select, repeat-interleave), into fresh memory."""
        if self.keys is not None:  # (nothing held, a window of 1 keeping no token: the batch still changes)
            index = index.to(self.keys.device)
            held = len(self)
            k, v = self.view()
            new_k = self._alloc(index.numel(), self.capacity, self.spec.key_dim)
            new_v = self._alloc(index.numel(), self.capacity, self.spec.value_dim)
            new_k[:, :, :held].copy_(k.index_select(0, index))
            new_v[:, :, :held].copy_(v.index_select(0, index))
            self._replace(new_k, new_v)
            self.start, self.end = 0, held
        if self.spec is not None:
            self.spec = self.spec.with_batch(index.numel())

    def clear(self) -> None:
        self._replace(None, None)
        self.spec = None

    def lend(self, keys: torch.Tensor, values: torch.Tensor, held: int) -> None:
        """Hold the first ``held`` tokens of memory another owns (``[B, H, C, D]`` views of the
        spec's layout: a serve workspace slot), in place of this buffer's own; nothing is freed.
        It is ``lent`` until it has memory of its own again (or none)."""
        self.keys, self.values, self.start, self.end = keys, values, 0, held
        self.lent = True  # a copy of it (a fork) allocates its own room, not the lender's padding
        self._bind()

    def detach(self) -> None:
        """Let go of lent memory holding no token: no memory, the spec kept (nothing is freed)."""
        self.keys = self.values = None
        self.start = self.end = 0
        self.lent = False
        self._bind()

    # -- internals ----------------------------------------------------------------------------
    def _make_room(self, key: torch.Tensor, value: torch.Tensor, more: int) -> None:
        """Regrow for ``more`` tokens after the held ones; a first write learns the spec first."""
        first = self.spec is None
        if first:
            self.spec = KVSpec.read(key, value)  # (checked by the caller: tiercache.layers.validate)
        try:
            self._regrow(len(self) + more)
        except Exception:
            if first:  # a refused first write leaves the buffer as new (free to take another shape)
                self.spec = None
            raise

    def _alloc(self, batch: int, capacity: int, dim: int) -> torch.Tensor:
        s = self.spec
        return self.tier.empty((batch, s.heads, capacity, dim), s.dtype, s.device)

    def _capacity_for(self, needed: int) -> int:
        if needed <= self.reserved:
            return capacity_for(self.reserved, self.chunk)
        return (grown_capacity if self.geometric else capacity_for)(needed, self.chunk)

    def _regrow(self, needed: int) -> None:
        capacity = self._capacity_for(needed)
        held = len(self)
        if self.keys is not None and capacity <= self.capacity and self.start > 0:
            # Room enough once the dropped front is reclaimed: slide the held tokens down.
            k, v = self.view()
            self.keys[:, :, :held].copy_(k.clone())
            self.values[:, :, :held].copy_(v.clone())
        else:
            new_k = self._alloc(self.spec.batch, capacity, self.spec.key_dim)
            new_v = self._alloc(self.spec.batch, capacity, self.spec.value_dim)
            if held:
                k, v = self.view()
                new_k[:, :, :held].copy_(k)
                new_v[:, :, :held].copy_(v)
                regrowth.record(self.tier.kind, nbytes_of(k, v))
            self._replace(new_k, new_v)
        self.start, self.end = 0, held

    def _replace(self, keys: torch.Tensor | None, values: torch.Tensor | None) -> None:
        old = (self.keys, self.values)
        self.keys, self.values = keys, values
        self.lent = False  # its own memory (or none) from now on
        for t in old:
            if t is not None:
                self.tier.free(t)
        if keys is None:
            self.start = self.end = 0
        self._bind()

    def _bind(self) -> None:
        """Keep what ``append_view`` needs of the memory now held: capacity, batch, heads, head
        dims and strides (its ``as_strided`` views), and the position table of the memory's
        device. None (``append`` and ``view`` then) without memory, or when the tokens do not
        arrive on the memory's device in its dtype (the layout's): ``index_copy_`` cannot take them."""
        k, v, spec = self.keys, self.values, self.spec
        if k is None or spec is None or not (spec.device == k.device == v.device and spec.dtype == k.dtype == v.dtype):
            self._geometry = None
            return
        b, h, capacity, dk = k.shape
        self._geometry = (capacity, b, h, dk, v.shape[3], k.stride(), v.stride(), _positions(k.device))


class BufferedLayer(KVLayer):
    """A storage layer over one ``Buffer`` (``self.buffer``: ``full``, ``sliding``): the answers
    that come from the buffer alone. A subclass writes, crops and keeps its own counts."""

    buffer: Buffer

    def layout(self):
        return self.buffer.spec

    def gather(self, index: torch.Tensor) -> None:
        if self.buffer.spec is not None:
            self.buffer.gather(index)

    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.buffer.view() if self.buffer.spec is not None and len(self.buffer) else None

    def nbytes(self) -> dict[str, int]:
        return self.buffer.nbytes()

    def close(self) -> None:
        self.reset()
        self.tier.close()

