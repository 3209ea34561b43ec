"""What a layer learns from its first update, and the check every later update must pass.

``KVSpec.of(key, value)`` records batch, heads, head dims, dtype and device; ``spec.check(key,
value)`` raises ``CacheError`` naming what was expected when an update does not match, before
anything is written (so a rejected update leaves the layer unchanged).
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
    device: torch.device

    @classmethod
    def of(cls, key: torch.Tensor, value: torch.Tensor) -> "KVSpec":
        check_pair(key, value)
        return cls._read(key, value)

    @classmethod
    def _read(cls, key: torch.Tensor, value: torch.Tensor) -> "KVSpec":
        """The spec of a pair already checked by ``check_pair``."""
        return cls(key.shape[0], key.shape[1], key.shape[3], value.shape[3], key.dtype, key.device)

    def empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-token keys and values of this layout, ``[B, H, 0, D]`` (an initialized empty layer)."""
        return (torch.empty((self.batch, self.heads, 0, self.key_dim), dtype=self.dtype, device=self.device),
                torch.empty((self.batch, self.heads, 0, self.value_dim), dtype=self.dtype, device=self.device))

    def with_batch(self, batch: int) -> "KVSpec":
        return replace(self, batch=batch)

    def check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        check_pair(key, value)
        got = KVSpec._read(key, value)
        for field, what in (
            ("batch", "batch size (use select / repeat_interleave / reorder to change it)"),
            ("heads", "kv head count"),
            ("key_dim", "key head dim"),
            ("value_dim", "value head dim"),
            ("dtype", "dtype"),
            ("device", "device"),
        ):
            if getattr(got, field) != getattr(self, field):
                raise CacheError(f"{what}: the layer holds {getattr(self, field)}, the update has {getattr(got, field)}")
