"""``Delegating``: the one base of wrappers (processors, cross-attention, side states).

    class Mine(Delegating):            Delegating(inner): every call of the layer protocol
        def changing(self): ...        (``tiercache.layers.base``), of the lifecycle protocol and
                                       every hook goes to ``inner`` unchanged

A wrapper states only what it changes. ``changing()`` runs before every call that changes the
wrapped layer (append, crop, gather, reset, load_state_dict, ingest, evict, adopt,
set_recording, close): the place to drop what a wrapper derived from it (a kept read, a device
mirror). ``can_adopt`` / ``adopt``: another wrapper of the same class, by its ``inner``.
"""

from __future__ import annotations

import torch

from tiercache.layers.base import KVLayer
from tiercache.layers.spec import KVSpec


class Delegating(KVLayer):
    def __init__(self, inner: KVLayer):
        self.inner = inner
        self.is_sliding = inner.is_sliding

    def changing(self) -> None:
        """Hook: the wrapped layer is about to change."""

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.changing()
        return self.inner.append(key, value)

    def layout(self) -> KVSpec | None:
        return self.inner.layout()

    def seq_length(self) -> int:
        return self.inner.seq_length()

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.inner.mask_sizes(query_length)

    def max_length(self) -> int:
        return self.inner.max_length()

    def validate_crop(self, n: int) -> None:
        self.inner.validate_crop(n)

    def crop(self, n: int) -> None:
        self.changing()
        self.inner.crop(n)

    def gather(self, index: torch.Tensor) -> None:
        self.changing()
        self.inner.gather(index)

    def reset(self) -> None:
        self.changing()
        self.inner.reset()

    def kv(self, fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.inner.kv(fetch)

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def tier_nbytes(self) -> dict[str, int]:
        return self.inner.tier_nbytes()

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.changing()
        self.inner.load_state_dict(sd)

    def export(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return self.inner.export()

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        self.changing()
        self.inner.ingest(key, value, seen)

    def reserve(self, tokens: int) -> None:
        self.inner.reserve(tokens)

    def prefetch(self) -> None:
        self.inner.prefetch()

    def evict(self) -> None:
        self.changing()
        self.inner.evict()

    def can_adopt(self, other: KVLayer) -> bool:
        return type(other) is type(self) and self.inner.can_adopt(other.inner)

    def adopt(self, other: KVLayer) -> None:
        if not self.can_adopt(other):
            super().adopt(other)
        self.changing()
        self.inner.adopt(other.inner)

    def set_recording(self, on: bool) -> None:
        self.changing()
        self.inner.set_recording(on)

    @property
    def recording(self) -> bool:
        return self.inner.record_past

    def close(self) -> None:
        self.changing()
        self.inner.close()
