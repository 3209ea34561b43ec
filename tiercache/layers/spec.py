"""What a layer learns from its first update: ``KVSpec`` (batch, heads, head dims, dtype, device).

``KVSpec.of(key, value)`` checks the pair on its own (``check_pair``) and reads its spec;
``KVSpec.read(key, value)`` reads the spec of a pair already checked. Whether an update matches
what a layer holds is checked once, by ``tiercache.layers.validate.check_update``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from tiercache.errors import CacheError


def check_pair(key: torch.Tensor, value: torch.Tensor) -> None:
    """Shape sanity of one update on its own: rank 4, same B/H/T, same dtype and device."""
    for name, t in (("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise CacheError(f"{name} must be a torch.Tensor [batch, heads, tokens, head_dim], got {type(t).__name__}")
        if t.dim() != 4:
            raise CacheError(f"{name} must have rank 4 [batch, heads, tokens, head_dim], got shape {tuple(t.shape)}")
    if key.shape[:3] != value.shape[:3]:
        raise CacheError(
            f"key and value must agree on [batch, heads, tokens], got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if key.dtype != value.dtype or key.device != value.device:
        raise CacheError(f"key and value differ: {key.dtype}@{key.device} vs {value.dtype}@{value.device}")


@dataclass(frozen=True)
class KVSpec:
    batch: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device | None  # None only in a layout(): an offloaded layer not bound to a device yet

    @classmethod
    def of(cls, key: torch.Tensor, value: torch.Tensor) -> "KVSpec":
        check_pair(key, value)
        return cls.read(key, value)

    def takes(self, key: torch.Tensor, value: torch.Tensor) -> bool:
        """Whether ``key`` / ``value`` are a well-formed pair of exactly this layout: a decode step's
        fast check, False for anything else (``check_update`` then says what is wrong, if anything)."""
        if type(key) is not torch.Tensor or type(value) is not torch.Tensor:
            return False
        try:
            (b, h, t, dk), (vb, vh, vt, dv) = key.shape, value.shape
        except ValueError:  # not rank 4
            return False
        return (b == vb == self.batch and h == vh == self.heads and t == vt and dk == self.key_dim
                and dv == self.value_dim and key.dtype == value.dtype == self.dtype
                and key.device == value.device == self.device)

    @classmethod
    def read(cls, key: torch.Tensor, value: torch.Tensor) -> "KVSpec":
        """The spec of a pair already checked by ``check_pair`` (an update checked by the cache)."""
        return cls(key.shape[0], key.shape[1], key.shape[3], value.shape[3], key.dtype, key.device)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-token keys and values of this layout, ``[B, H, 0, D]`` (an initialized empty layer)."""
        return (torch.empty((self.batch, self.heads, 0, self.key_dim), dtype=self.dtype, device=self.device),
                torch.empty((self.batch, self.heads, 0, self.value_dim), dtype=self.dtype, device=self.device))

    def with_batch(self, batch: int) -> "KVSpec":
        return replace(self, batch=batch)
