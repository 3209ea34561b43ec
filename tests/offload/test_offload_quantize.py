"""Quantize over Offload: packed blocks live on the host tier and cross the bus compressed.

The offloaded quantized chain must equal the resident quantized chain exactly (offload adds
no error of its own), and move fewer bytes than full precision would.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("tiercache.quantize.processor")

from tiercache.cache.chain import build_layers  # noqa: E402
from tiercache.policy.schema import LayerPolicy, OffloadPolicy, QuantizePolicy  # noqa: E402

Q = QuantizePolicy(backend="native", bits=4, group_size=8, residual_length=4)
STORAGES = {"full": ("full", None, None), "sliding": ("sliding", 12, None), "static": ("static", None, 96)}


def chains(storage: str, offload: OffloadPolicy | None, layers: int = 3, q: QuantizePolicy = Q):
    kind, window, max_length = STORAGES[storage]
    lps = [LayerPolicy(i, "full_attention", kind, window, max_length, q, offload) for i in range(layers)]
    return build_layers(lps)


@pytest.mark.parametrize("device", ["cpu", "disk"])
@pytest.mark.parametrize("storage", list(STORAGES))
def test_offloaded_quantized_equals_resident_quantized(storage, device, tmp_path):
    policy = OffloadPolicy(device=device, prefetch=1, path=str(tmp_path) if device == "disk" else None)
    off, shared = chains(storage, policy)
    ref, _ = chains(storage, None)
    g = torch.Generator().manual_seed(0)

    def step(t: int, batch: int = 2):
        for lo, lr in zip(off, ref):
            k, v = torch.randn(batch, 2, t, 16, generator=g), torch.randn(batch, 2, t, 16, generator=g)
            a, b = lo.update(k, v), lr.update(k, v)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    step(20)
    for _ in range(12):
        step(1)
    for lo, lr in zip(off, ref):
        for layer in (lo, lr):
            layer.reorder(torch.tensor([1, 0]))
            layer.crop(3) if storage != "sliding" else None
    for _ in range(3):
        step(1)
    stats = shared.prefetcher.stats()
    assert stats["bytes_d2h"] > 0 and stats["bytes_h2d"] > 0
    assert all(set(layer.store.nbytes()) == {device} for layer in off)


def test_bus_carries_packed_bytes():
    """int4, groups of 32: about 0.75 byte per value with metadata, vs 4 for float32."""
    q = QuantizePolicy(backend="native", bits=4, group_size=32, residual_length=4)
    off, shared = chains("full", OffloadPolicy(prefetch=1), q=q)
    g = torch.Generator().manual_seed(1)
    for t in (128, *[1] * 16):
        for layer in off:
            layer.update(torch.randn(1, 2, t, 32, generator=g), torch.randn(1, 2, t, 32, generator=g))
    packed_tokens = 128  # 4 blocks of 32 left the residual
    fp_bytes = 3 * 2 * packed_tokens * 32 * 2 * 4  # layers * heads * tokens * dim * (K, V) * float32
    assert 0 < shared.prefetcher.stats()["bytes_d2h"] < fp_bytes / 3
