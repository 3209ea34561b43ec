"""The roles table of a cache (``tiercache.cache.layer_roles``) is made once, at construction."""

from __future__ import annotations

import torch

from tiercache import TieredCache
from tiercache.cache import layer_roles
from tiercache.models.spec import ModelSpec


def test_the_roles_table_is_built_once_and_not_per_update(monkeypatch):
    made = []
    real = layer_roles.LayerRoles.__init__

    def counted(self, *args):
        made.append(1)
        real(self, *args)

    monkeypatch.setattr(layer_roles.LayerRoles, "__init__", counted)
    spec = ModelSpec("probe", 6, ("full_attention",) * 6, kv_heads=2, head_dim=8, dtype="float32")
    cache = TieredCache.from_policy({"name": "fp"}, spec)
    assert len(made) == 1
    k = torch.randn(1, 2, 3, 8)  # [B, H, T, D]
    for _ in range(3):
        for i in range(6):
            cache.update(k, k, i)
    assert len(made) == 1 and cache.get_seq_length() == 9
    assert cache.is_dummy == cache.is_linear == [False] * 6
