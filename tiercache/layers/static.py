"""``static`` storage: preallocated to ``max_length`` tokens, written by index.

Addresses never change after the first update (beam reorder copies in place) and the write
position is a device tensor. ``padded`` (the default): the returned K/V always span
``max_length`` and the attention mask hides the unused tail, so a model step using it can be
captured by ``torch.compile`` / CUDA graphs. That relies on the mask: transformers builds it
for every step only when the *whole cache* is compileable, and drops it on one-token steps
otherwise (then attention would read the zero tail). So a cache that mixes static layers with
sliding, offloaded or quantized ones builds them with ``padded=False``: they return exactly the
held tokens (mask sizes as ``full``), still from the preallocated buffer, and are not
compileable. An update that would pass ``max_length`` raises ``CacheError`` and writes nothing.

Token count (``length``): under ``torch.compile`` the device position itself (a host int would
make dynamo guard on it and recompile every token); eagerly a host count that eager writes keep,
so an eager update never reads the device. A compiled step only marks that count stale (an
attribute store, replayed after the graph: no guard); the next eager read takes the device
position once (``_sync``: one read after a run of compiled steps).

A padded layer's buffers (``_buffers()``, and the position) are marked static for dynamo
(``mark_static_address``), as transformers' ``StaticCache`` does: their addresses never change,
so a ``reduce-overhead`` compile captures CUDA graphs over them instead of copying them in per
call. ``StaticQuantized`` (``tiercache.quantize.static_layer``) is this layer with packed buffers:
it shares the count, the batch operations and the accounting.
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer, check_crop
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import check_ingest, expect, field, held_pair, spec_from, spec_state
from tiercache.layers.allowance import size_of
from tiercache.layers.tiers import ComputeTier, nbytes_of


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these preallocated buffers keep their address (``mark_static_address``,
    unguarded: a new address re-records a CUDA graph rather than recompiling). Eager only."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class StaticLayer(KVLayer):
    kind = "static"  # what its state dict says it is

    def __init__(self, max_length: int, tier=None, padded: bool = True):
        if not isinstance(max_length, int) or max_length < 1:
            raise CacheError(f"static storage needs max_length >= 1, got {max_length!r}")
        self.limit = self.slots = max_length  # slots: what a padded update returns
        self.padded = bool(padded)
        self.tier = tier or ComputeTier()
        self.spec: KVSpec | None = None
        self.k: torch.Tensor | None = None  # [B, H, max_length, Dk]
        self.v: torch.Tensor | None = None  # [B, H, max_length, Dv]
        self.position: torch.Tensor | None = None  # [] int64 on the device: next write index
        self._count, self._stale = 0, False  # host view of position (module docstring)

    @property
    def is_compileable(self) -> bool:
        return self.padded

    @property
    def length(self):
        """Tokens held (module docstring): a tensor under ``torch.compile``, else an int."""
        if self.position is None:
            return 0
        if torch.compiler.is_compiling():
            return self.position.clone()  # a copy: += on it
        self._sync()
        return self._count

    @length.setter
    def length(self, value) -> None:
        # every writer of ``length`` has moved ``position`` to the same count
        if torch.compiler.is_compiling():
            self._stale = True
        else:
            self._count, self._stale = value, False

    def _sync(self) -> None:
        """After compiled steps: the device position into the host count (one read)."""
        if self._stale:
            self._count, self._stale = int(self.position), False

    def layout(self):
        return self.spec

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = key.shape[2]  # room checked by check_update (max_length() / seq_length())
        if self.spec is None:
            self._allocate(KVSpec.read(key, value))
        index = self.position + torch.arange(t, device=self.position.device)  # [T]
        self.k.index_copy_(2, index, key)
        self.v.index_copy_(2, index, value)
        self.position.add_(t)
        self.length += t
        if not self.padded:
            return self.k[:, :, : self.length], self.v[:, :, : self.length]  # [B, H, S, D]
        return self.k, self.v  # [B, H, max_length, D]; positions >= length are masked

    def seq_length(self) -> int:
        return self.length

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return (self.slots, 0) if self.padded else (self.length + query_length, 0)

    def max_length(self) -> int:
        return self.limit

    def crop(self, n: int) -> None:
        n = check_crop(n, self.length)
        if n:
            self.position.sub_(n)
            self.length -= n

    def gather(self, index: torch.Tensor) -> None:
        """Same batch: in place (the buffers keep their addresses, as a compiled step needs); else anew."""
        if self.spec is None:
            return
        if index.numel() != self.spec.batch:
            return self._regather(index)
        idx = index.to(self.position.device)
        for buf in self._buffers():
            buf.copy_(buf.index_select(0, idx))

    def reset(self) -> None:
        if self.spec is not None:
            for buf in self._buffers():
                self.tier.free(buf)
        self.spec = self.k = self.v = self.position = None
        self._count, self._stale = 0, False

    def close(self) -> None:
        self.reset()
        self.tier.close()

    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec is None or not self.length:
            return None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]  # [B, H, S, D] views

    def nbytes(self) -> dict[str, int]:
        if self.spec is None:
            return {}
        return {self.tier.place(self.spec.device): nbytes_of(*self._buffers())}

    def state_dict(self) -> dict:
        if self.spec is None:
            return {"kind": self.kind, "spec": None}
        return {"kind": self.kind, "spec": spec_state(self.spec), "length": self.length, **self._held()}

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, self.kind)
        spec = spec_from(sd.get("spec"))
        if spec is None:
            self.reset()
            return
        length = field(sd, "length", self.kind)
        self._room(length)
        self._load(spec, length, sd)

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        spec = check_ingest(key, value, seen, self.kind, whole=True)
        self._room(seen)
        self._fill(spec, key, value)

    def _room(self, tokens: int) -> None:
        if tokens > self.limit:
            raise CacheError(f"static storage holds at most max_length={self.limit} tokens, cannot take {tokens}; "
                             "raise max_length in the policy or use storage: full")

    # -- buffers (what StaticQuantized replaces) --------------------------------------------------
    def _buffers(self) -> list[torch.Tensor]:
        return [self.k, self.v]

    def _held(self) -> dict:
        """The tensors of the state dict: views of the held tokens."""
        return {"keys": self.k[:, :, : self.length], "values": self.v[:, :, : self.length]}

    def _load(self, spec: KVSpec, length: int, sd: dict) -> None:
        self._fill(spec, *held_pair(sd, spec, length, self.kind))

    def _fill(self, spec: KVSpec, key: torch.Tensor, value: torch.Tensor) -> None:
        self._refill(spec, [key, value], key.shape[2])

    def _refill(self, spec: KVSpec, held: list[torch.Tensor], count: int) -> None:
        """New buffers for ``spec``, each starting with its tensor of ``held``; ``count`` tokens held."""
        self.reset()
        self._allocate(spec)
        for buf, t in zip(self._buffers(), held):
            buf[:, :, : t.shape[2]].copy_(t)
        self.position.fill_(count)
        self.length = count

    def _shapes(self, s: KVSpec) -> list[tuple[tuple, torch.dtype]]:
        """(shape, dtype) of each buffer of ``_buffers()`` for ``s``."""
        return [((s.batch, s.heads, self.limit, s.key_dim), s.dtype), ((s.batch, s.heads, self.limit, s.value_dim), s.dtype)]

    def _set_buffers(self, bufs: list[torch.Tensor]) -> None:
        self.k, self.v = bufs

    def _allocate(self, spec: KVSpec) -> None:
        """Zeroed buffers for ``spec`` and a zero position; a failure leaves the layer as it was."""
        s, bufs = spec, []
        try:
            for shape, dtype in self._shapes(s):
                bufs.append(self.tier.empty(shape, dtype, s.device))
        except Exception as e:
            for buf in bufs:
                self.tier.free(buf)
            if isinstance(e, RuntimeError):  # out of memory (torch.OutOfMemoryError is one), too large
                size = sum(size_of(shape, d) for shape, d in self._shapes(s))
                raise CacheError(
                    f"{self.kind} storage: cannot allocate max_length={self.limit} tokens ({size} bytes for batch "
                    f"{s.batch}, {s.heads} kv heads) on {s.device}: {str(e).splitlines()[0]}; lower max_length "
                    "or use storage: full"
                ) from e
            raise
        self._set_buffers([buf.zero_() for buf in bufs])
        self.position = torch.zeros((), dtype=torch.long, device=s.device)
        self._count, self._stale = 0, False
        if self.padded:
            mark_static(*self._buffers(), self.position)
        self.spec = spec

    def _regather(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (select, repeat_interleave): new buffers (the batch changes)."""
        held = [t.index_select(0, index.to(t.device)) for t in self._buffers()]
        self._refill(self.spec.with_batch(index.numel()), held, self.length)
