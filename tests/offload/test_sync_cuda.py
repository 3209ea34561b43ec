"""The GPU path without host syncs: a decode step of a resident, quantized (native), offloaded or
quantized+offloaded cache runs under ``torch.cuda.set_sync_debug_mode("error")``; offload
write-backs are deferred (staged on the side stream) yet every result equals the resident cache;
non-finite updates to a quantized layer surface at its next use. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiercache.cache.tiered import TieredCache
from tiercache.errors import CacheError
from tiercache.models.spec import ModelSpec

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SPEC = ModelSpec("sync", 4, ("full_attention",) * 4, kv_heads=2, head_dim=64, dtype="bfloat16")
Q = {"bits": 4, "group_size": 32, "residual_length": 64}
POLICIES = {
    "resident": {"name": "resident"},
    "int4": {"name": "int4", "quantize": Q},
    "offload": {"name": "offload", "offload": {"device": "cpu", "prefetch": 1}},
    "int4-offload": {"name": "int4-offload", "quantize": Q, "offload": {"device": "cpu", "prefetch": 1}},
}


def step(cache, t: int, g, heads: int = 4):
    """One model step as attention sees it: each layer updates, then SDPA reads what it returned."""
    outs = []
    for i in range(SPEC.num_layers):
        k = torch.randn(1, 2, t, 64, generator=g, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(1, 2, t, 64, generator=g, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, heads, t, 64, generator=g, device="cuda", dtype=torch.bfloat16)
        ks, vs = cache.update(k, v, i)
        outs.append(F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True, is_causal=t > 1 and ks.shape[2] == t))
    return torch.stack([o.float().sum() for o in outs])  # [layers], on the device


@pytest.mark.parametrize("name", list(POLICIES))
def test_decode_step_has_no_host_sync(name):
    cache = TieredCache.from_policy(POLICIES[name], SPEC)
    g = torch.Generator(device="cuda").manual_seed(0)
    step(cache, 300, g)
    for _ in range(3):  # warm: streams, slots, workspaces, pinned staging blocks exist
        step(cache, 1, g)
    for _ in range(2):
        torch.cuda.synchronize()  # what generate's per-step stopping check does between steps
        torch.cuda.set_sync_debug_mode("error")
        try:
            step(cache, 1, g)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert cache.offload_stats()["host_waits"] == 0
    assert cache.get_seq_length() == 305


@pytest.mark.parametrize("name", ["offload", "int4-offload"])
def test_deferred_write_back_equals_resident(name):
    resident = TieredCache.from_policy({**POLICIES[name], "offload": None}, SPEC)
    off = TieredCache.from_policy(POLICIES[name], SPEC)
    g1, g2 = (torch.Generator(device="cuda").manual_seed(1) for _ in range(2))
    for t in (100, *([1] * 300)):  # crosses full-storage regrows (256 tokens) and quantized flushes
        a, b = step(resident, t, g1), step(off, t, g2)
        assert torch.equal(a, b)
    assert off.get_seq_length() == resident.get_seq_length() == 400
    off.crop(-17)  # host-side operations settle the staged write-backs first
    resident.crop(-17)
    for i in range(SPEC.num_layers):
        x, y = off.layers[i].kv(), resident.layers[i].kv()
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
    assert off.nbytes().get("cpu", 0) > 0


def test_non_finite_surfaces_at_the_next_use_and_crop_clears_it():
    cache = TieredCache.from_policy(POLICIES["int4"], SPEC)
    g = torch.Generator(device="cuda").manual_seed(2)
    step(cache, 80, g)
    k = torch.full((1, 2, 1, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
    cache.update(k, k, 0)  # accepted without a sync: the flag is read later
    torch.cuda.synchronize()
    ok = torch.zeros(1, 2, 1, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(CacheError, match=r"layer 0: non-finite values .*\(positions 80\.\.80\)"):
        cache.update(ok, ok, 0)
    with pytest.raises(CacheError, match="layer 0: .*crop"):
        cache.update(ok, ok, 0)
    cache.layers[0].crop(1)  # back to 80 tokens: usable again
    cache.update(ok, ok, 0)
