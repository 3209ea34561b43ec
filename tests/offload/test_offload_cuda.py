"""Offload on a CUDA GPU: the side stream carries the prefetch, outputs stay bit-exact, device
memory for offloaded layers stays within prefetch + 1 layers. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from tiercache.cache.chain import make_storage
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload.processor import Prefetcher, offloaded
from tiercache.cache.compat import cache_arg

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"


def layers(n: int, prefetch: int, device: str = "cpu", path=None):
    pf = Prefetcher()
    policy = OffloadPolicy(device=device, prefetch=prefetch, path=path)
    return [offloaded(lambda tier: make_storage(tier=tier), policy, pf, i) for i in range(n)], pf


def run(off, ref, steps: int, prefill: int = 64, dtype=torch.float16):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    for step in range(steps):
        t = prefill if step == 0 else 1
        for lo, lr in zip(off, ref):
            k = torch.randn(2, 4, t, 64, generator=g, device=DEVICE).to(dtype)
            v = torch.randn(2, 4, t, 64, generator=g, device=DEVICE).to(dtype)
            a, b = lo.update(k, v), lr.update(k, v)
            # Read through attention-like work on the compute stream, as a model does.
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_side_stream_prefetch_bit_exact(prefetch):
    off, pf = layers(4, prefetch)
    ref = [make_storage() for _ in off]
    run(off, ref, steps=6)
    assert len(pf.streams) == 1 and pf.side_fetches > 0  # (fetches of empty layers copy nothing)
    assert len(pf.slots) <= prefetch + 1
    assert all(m is None or m.k.is_cuda for m in map(pf.mirror, off))
    assert off[0].inner.buffer.keys.is_pinned()
    torch.cuda.synchronize()


def test_overlap_with_compute():
    """A long compute on the default stream while the side stream fetches: results still exact."""
    off, pf = layers(3, 1)
    ref = [make_storage() for _ in off]
    run(off, ref, steps=2, prefill=2048)
    busy = torch.randn(4096, 4096, device=DEVICE)
    for _ in range(3):
        for lo, lr in zip(off, ref):
            torch.mm(busy, busy)  # keeps the compute stream busy while the next layer is fetched
            k = torch.randn(2, 4, 1, 64, device=DEVICE, dtype=torch.float16)
            a, b = lo.update(k, k), lr.update(k, k)
            assert torch.equal(a[0], b[0])
    assert pf.side_fetches > 0
    torch.cuda.synchronize()


def test_device_memory_bounded_by_prefetch_depth():
    n, prefetch = 8, 1
    off, pf = layers(n, prefetch)
    ref = [make_storage() for _ in off]
    run(off, ref, steps=3, prefill=1024)
    layer_bytes = sum(off[0].inner.kv()[i].numel() * 2 for i in (0, 1))
    mirror = pf.nbytes().get(f"cuda:{torch.cuda.current_device()}", 0)
    assert mirror <= (prefetch + 1) * (layer_bytes * 2 + (2 << 20))  # chunk rounding and slot alignment


def test_disk_tier_on_gpu(tmp_path):
    off, pf = layers(3, 1, "disk", str(tmp_path))
    ref = [make_storage() for _ in off]
    run(off, ref, steps=4)
    for lo in off:
        lo.close()
    assert list(tmp_path.iterdir()) == []


def test_generate_same_tokens_on_gpu():
    pytest.importorskip("transformers")
    import tiercache
    from tests.builders import build, prompt

    model = build("llama").to(DEVICE)
    ids = prompt(2, 12).to(DEVICE)
    out = {}
    for name, policy in (("resident", {}), ("offload", {"offload": {"device": "cpu", "prefetch": 1}})):
        cache = tiercache.TieredCache.from_policy(policy, model.config)
        out[name] = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache),
                                   do_sample=False, num_beams=2, max_new_tokens=10)
    assert torch.equal(out["resident"], out["offload"])
