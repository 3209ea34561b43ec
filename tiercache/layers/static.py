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

A padded layer's buffers (K, V, position) are marked static for dynamo (``mark_static_address``,
``mark_static``), as transformers' ``StaticCache`` does: their addresses never change, so a
``reduce-overhead`` compile captures CUDA graphs over them instead of copying them in per call.
An eager update reads nothing back from the device (the room check uses the host count).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import KVLayer, check_crop
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import check_ingest, expect, field, held_pair, spec_from, spec_state
from tiercache.layers.tiers import ComputeTier


def mark_static(*tensors: torch.Tensor) -> None:
    """Tell dynamo these preallocated buffers keep their address (``mark_static_address``,
    unguarded: a new address re-records a CUDA graph rather than recompiling). Eager only."""
    if not torch.compiler.is_compiling():
        for t in tensors:
            torch._dynamo.mark_static_address(t)


class StaticLayer(KVLayer):
    def __init__(self, max_length: int, tier=None, padded: bool = True):
        if not isinstance(max_length, int) or max_length < 1:
            raise CacheError(f"static storage needs max_length >= 1, got {max_length!r}")
        self.limit = max_length
        self.padded = bool(padded)
        self.tier = tier or ComputeTier()
        self.spec: KVSpec | None = None
        self.k: torch.Tensor | None = None  # [B, H, max_length, Dk]
        self.v: torch.Tensor | None = None  # [B, H, max_length, Dv]
        self.position: torch.Tensor | None = None  # [] int64 on the device: next write index
        self.length = 0  # host mirror of position, for checks

    @property
    def is_compileable(self) -> bool:
        return self.padded

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
        return (self.limit, 0) if self.padded else (self.length + query_length, 0)

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
        idx = index.to(self.k.device)
        self.k.copy_(self.k.index_select(0, idx))
        self.v.copy_(self.v.index_select(0, idx))

    def reset(self) -> None:
        if self.k is not None:
            self.tier.free(self.k)
            self.tier.free(self.v)
        self.spec = self.k = self.v = self.position = None
        self.length = 0

    def close(self) -> None:
        self.reset()
        self.tier.close()

    def kv(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec is None or not self.length:
            return None
        return self.peek()

    def peek(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.spec is None:
            return None
        return self.k[:, :, : self.length], self.v[:, :, : self.length]  # [B, H, S, D] views

    @property
    def is_initialized(self) -> bool:
        return self.spec is not None

    def nbytes(self) -> dict[str, int]:
        if self.k is None:
            return {}
        size = self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()
        return {self.tier.place(self.spec.device): size}

    def tier_nbytes(self) -> dict[str, int]:
        return {self.tier.kind: n for n in self.nbytes().values()}

    def batch_size(self) -> int | None:
        return None if self.spec is None else self.spec.batch

    def state_dict(self) -> dict:
        if self.spec is None:
            return {"kind": "static", "spec": None}
        return {"kind": "static", "spec": spec_state(self.spec), "length": self.length,
                "keys": self.k[:, :, : self.length], "values": self.v[:, :, : self.length]}

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, "static")
        spec = spec_from(sd.get("spec"))
        if spec is None:
            self.reset()
            return
        length = field(sd, "length", "static")
        k, v = held_pair(sd, spec, length, "static")
        self._room(length)
        self._fill(spec, k, v)

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        spec = check_ingest(key, value, seen, "static", whole=True)
        self._room(seen)
        self._fill(spec, key, value)

    def _room(self, tokens: int) -> None:
        if tokens > self.limit:
            raise CacheError(f"static storage holds at most max_length={self.limit} tokens, cannot take {tokens}; "
                             "raise max_length in the policy or use storage: full")

    def _fill(self, spec: KVSpec, key: torch.Tensor, value: torch.Tensor) -> None:
        self.reset()
        self._allocate(spec)
        n = key.shape[2]
        self.k[:, :, :n].copy_(key)
        self.v[:, :, :n].copy_(value)
        self.position.fill_(n)
        self.length = n

    def _allocate(self, spec: KVSpec) -> None:
        s = spec
        keys = None
        try:
            keys = self.tier.empty((s.batch, s.heads, self.limit, s.key_dim), s.dtype, s.device)
            values = self.tier.empty((s.batch, s.heads, self.limit, s.value_dim), s.dtype, s.device)
        except Exception as e:
            if keys is not None:
                self.tier.free(keys)
            if isinstance(e, RuntimeError):  # out of memory (torch.OutOfMemoryError is one), too large
                size = s.batch * s.heads * self.limit * (s.key_dim + s.value_dim) * torch.empty((), dtype=s.dtype).element_size()
                raise CacheError(
                    f"static storage: cannot allocate max_length={self.limit} tokens ({size} bytes for batch "
                    f"{s.batch}, {s.heads} kv heads) on {s.device}: {str(e).splitlines()[0]}; lower max_length "
                    "or use storage: full"
                ) from e
            raise
        # assigned only once both allocations succeeded: a failure leaves the layer as it was
        self.k, self.v = keys.zero_(), values.zero_()
        self.position = torch.zeros((), dtype=torch.long, device=s.device)
        if self.padded:
            mark_static(self.k, self.v, self.position)
        self.spec = spec

    def _regather(self, index: torch.Tensor) -> None:
        index = index.to(self.k.device)
        keys, values = self.k.index_select(0, index), self.v.index_select(0, index)
        position, length = self.position, self.length
        self.reset()
        self._allocate(KVSpec.of(keys, values))
        self.k.copy_(keys)
        self.v.copy_(values)
        self.position.copy_(position)
        self.length = length
