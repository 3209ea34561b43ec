"""The simulated device (``tiercache.simdevice``) and offload's CUDA path on it.

First the simulator itself: a side-stream copy lands only when its stream is advanced, its
destination is poison until then, freed device memory is poisoned and reused, a missing
``record_stream`` / ``wait_stream`` is a hazard. Then offload on it (the same code CUDA runs):
bit-exact sequences of every storage, slot bytes replaced while a fetch is in flight, one-row
(batch 1, one KV head) mirrors that do not regrow per token, two devices with a side stream
each, the deferred non-finite check."""

from __future__ import annotations

import pytest
import torch

import tiercache
from tiercache.cache.chain import make_storage
from tiercache.errors import CacheError
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload.mirror import row_stride, steady_capacity
from tiercache.offload.processor import Prefetcher, offloaded
from tiercache.simdevice import simulated
from tests.offload import test_offload as plain
from tests.offload.simdev import sim, sim2  # noqa: F401 (fixtures)

# -- the simulator ------------------------------------------------------------------------------


def test_a_side_copy_lands_only_when_its_stream_is_advanced(sim):  # noqa: F811
    dev = sim.devices[0]
    src = torch.arange(6.0)
    with sim.host():
        host = torch.arange(6.0) + 10
    side, done = sim.new_stream(dev), sim.event()
    side.wait_stream(sim.current_stream(dev))
    with sim.use(side):
        src.copy_(host, non_blocking=True)
    done.record(side)
    assert not done.query()  # nothing lands by itself
    done.synchronize()
    assert done.query() and torch.equal(src, host)


def test_reading_a_destination_before_its_copy_lands_sees_poison():
    with simulated() as sim:
        dev = sim.devices[0]
        dst = torch.zeros(4)
        src = torch.ones(4)
        side = sim.new_stream(dev)
        side.wait_stream(sim.current_stream(dev))
        with sim.use(side):
            dst.copy_(src, non_blocking=True)
        assert torch.isnan(dst).all()  # no wait_event: poison
        assert any("before that landed" in h for h in sim.hazards)
        sim.current_stream(dev).wait_event(_recorded(sim, side))
        assert torch.equal(dst, torch.ones(4))


def _recorded(sim, stream):
    e = sim.event()
    e.record(stream)
    return e


def test_freed_device_memory_is_poisoned_and_reused(sim):  # noqa: F811
    a = torch.ones(64)
    ptr = a.data_ptr()
    del a
    b = torch.empty(64)  # first fit: the same bytes
    assert b.data_ptr() == ptr and torch.isnan(b).all()


@pytest.mark.parametrize("record", [True, False])
def test_memory_a_side_stream_still_reads_needs_record_stream(record):
    with simulated() as sim:
        dev = sim.devices[0]
        key = torch.full((8,), 3.0)
        host = sim.pinned_empty((8,), torch.float32)
        side = sim.new_stream(dev)
        side.wait_stream(sim.current_stream(dev))
        with sim.use(side):
            host.copy_(key, non_blocking=True)
        if record:
            sim.record_stream(key, side)
        del key  # the model drops its key: the caching allocator may hand the bytes out again
        other = torch.full((8,), 7.0)  # noqa: F841 (reuses them unless recorded)
        side.synchronize()
        assert torch.equal(host, torch.full((8,), 3.0)) == record
        assert bool(sim.hazards) != record


def test_a_side_copy_not_ordered_after_the_compute_stream_is_a_hazard():
    with simulated() as sim:
        dev = sim.devices[0]
        key = torch.randn(8)  # written on the compute stream
        host = sim.pinned_empty((8,), torch.float32)
        side = sim.new_stream(dev)  # no wait_stream
        with sim.use(side):
            host.copy_(key, non_blocking=True)
        side.synchronize()
        assert torch.isnan(host).all() and any("wait_stream missing" in h for h in sim.hazards)


def test_ops_mixing_two_devices_raise(sim2):  # noqa: F811
    with sim2.device(0):
        a = torch.ones(3)
    with sim2.device(1):
        b = torch.ones(3)
    with pytest.raises(RuntimeError, match="one device"):
        a + b
    assert sim2.device_of(a).index == 0 and sim2.device_of(a * 2).index == 0 and sim2.device_of(b + 1).index == 1


# -- offload on the simulated device ------------------------------------------------------------


@pytest.mark.parametrize("device", plain.DEVICES)
@pytest.mark.parametrize("prefetch", plain.PREFETCH, ids=[f"prefetch{p}" for p in plain.PREFETCH])
@pytest.mark.parametrize("storage", list(plain.STORAGES))
def test_bit_exact_sequence(sim, storage, prefetch, device, tmp_path):  # noqa: F811
    """test_offload's sequence (prefill, decode, speculative crop, reorder, select, repeat,
    reset) with the layers' CUDA path: side-stream fetches, deferred write-backs, events."""
    plain.test_bit_exact_sequence(storage, prefetch, device, torch.float32, tmp_path)


@pytest.mark.parametrize("storage", ["full", "sliding"])
def test_long_prefill_and_growth(sim, storage, tmp_path):  # noqa: F811
    plain.test_long_prefill_and_growth(storage, tmp_path)


def test_a_long_sliding_update_does_not_grow_the_mirror(sim, tmp_path):  # noqa: F811
    plain.test_a_long_sliding_update_does_not_grow_the_mirror(1, "cpu", tmp_path)


def test_slot_bytes_replaced_while_a_fetch_is_in_flight(sim, tmp_path):  # noqa: F811
    """Layer 1 is fetched ahead (in flight) when layer 2 takes its slot and needs more bytes: the
    old bytes are freed while the side stream still writes them (record_stream keeps them)."""
    off, ref, pf = plain.build("full", "cpu", 1, tmp_path)
    pair, g = plain.Pair(off, ref, "full"), torch.Generator().manual_seed(7)
    for lo, lr in zip(off, ref):
        k, v = plain.tokens(4, torch.float32, 2, g)
        pair.same(lo.update(k, v), lr.update(k, v))
    k, v = plain.tokens(1, torch.float32, 2, g)
    pair.same(off[0].update(k, v), ref[0].update(k, v))  # fetches layer 1 ahead
    assert any(s.ready is not None and not s.ready.query() for s in pf.slots)
    k, v = plain.tokens(300, torch.float32, 2, g)  # layer 2 grows past the slot's bytes
    pair.same(off[2].update(k, v), ref[2].update(k, v))
    pair.check()


@pytest.mark.parametrize("storage,syncs", [("full", False), ("static", False), ("sliding", True)])
def test_which_host_layers_write_back_without_a_host_sync(sim, storage, syncs, tmp_path):  # noqa: F811
    """Full and static host layers stage their write-backs (no host sync while decoding); sliding
    ones copy synchronously (the reason is in ``writeback.py``)."""
    off, ref, pf = plain.build(storage, "cpu", 1, tmp_path)
    pair, g = plain.Pair(off, ref, storage), torch.Generator().manual_seed(6)
    before = None
    for step in range(8):
        if step == 3:
            before = sim.host_syncs
        for lo, lr in zip(off, ref):
            k, v = plain.tokens(5 if step == 0 else 1, torch.float32, 2, g)
            pair.same(lo.update(k, v), lr.update(k, v))
    assert (sim.host_syncs > before) == syncs
    assert pf.stats()["host_waits"] == 0
    pair.check()


def one_row_layers(n: int = 3, storage: str = "full"):
    pf = Prefetcher()
    kw = {"max_length": 512} if storage == "static" else {}
    policy = OffloadPolicy(device="cpu", prefetch=1)
    off = [offloaded(lambda tier: make_storage(tier=tier, **kw), policy, pf, i) for i in range(n)]
    return off, [make_storage(**kw) for _ in range(n)], pf


@pytest.mark.parametrize("storage", ["full", "static"])
def test_one_kv_head_at_batch_one_does_not_regrow_per_token(sim, storage):  # noqa: F811
    """One row ([1, 1, S, D]: batch 1, one KV head) is one span whatever its capacity: a fetch
    gives it room for the next token, so decoding allocates no device memory and the mirror
    holds what ``steady_capacity`` says."""
    off, ref, pf = one_row_layers(storage=storage)
    g = torch.Generator().manual_seed(8)
    allocs = None
    for step in range(20):
        if step == 4:
            allocs = sim.device_allocs
        for lo, lr in zip(off, ref):
            k, v = torch.randn(1, 1, 10 if step == 0 else 1, 8, generator=g), torch.randn(1, 1, 10 if step == 0 else 1, 8, generator=g)
            a, b = lo.update(k, v), lr.update(k, v)
            n = lr.seq_length()
            assert torch.equal(a[0][:, :, :n], b[0][:, :, :n]) and torch.equal(a[1][:, :, :n], b[1][:, :, :n])
            torch.equal(a[0], a[0])  # attention reads them
            del k, v, a, b
    assert sim.device_allocs == allocs  # no slot bytes allocated while decoding
    floor = 512 if storage == "static" else 0
    for lo in off:
        mirror = pf.acquire(lo)
        host_rows = row_stride(lo.inner.kv()[0])
        assert mirror.capacity == steady_capacity(host_rows, mirror.held, rows=1, floor=floor)


def test_two_devices_get_a_side_stream_each(sim2):  # noqa: F811
    spec = ModelSpec("two", 4, ("full_attention",) * 4, kv_heads=2, head_dim=8, dtype="float32")
    off = tiercache.TieredCache.from_policy({"name": "o", "offload": {"device": "cpu", "prefetch": 1}}, spec)
    ref = tiercache.TieredCache.from_policy({"name": "r"}, spec)
    g = torch.Generator().manual_seed(9)
    for t in (6, 1, 1, 1):
        for i in range(4):
            with sim2.device(i // 2):
                k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
                a, b = off.update(k, v, i), ref.update(k, v, i)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                assert sim2.device_of(a[0]) is sim2.devices[i // 2]
    pf = off._shared.prefetcher
    assert set(pf.streams) == set(sim2.devices)
    assert off.offload_stats()["host_waits"] == 0


def test_non_finite_surfaces_at_the_next_use_after_it_lands(sim):  # noqa: F811
    spec = ModelSpec("nan", 1, ("full_attention",), kv_heads=2, head_dim=8, dtype="float32")
    cache = tiercache.TieredCache.from_policy({"name": "int4", "quantize": {"bits": 4, "group_size": 4,
                                                                            "residual_length": 8}}, spec)
    cache.update(torch.randn(1, 2, 80, 8), torch.randn(1, 2, 80, 8), 0)
    nan = torch.full((1, 2, 1, 8), float("nan"))
    cache.update(nan, nan, 0)  # accepted: the flag is still in flight (no host sync)
    ok = torch.zeros(1, 2, 1, 8)
    sim.synchronize()  # (what generate's per-step stopping check does)
    with pytest.raises(CacheError, match="non-finite values .*positions 80..80"):
        cache.update(ok, ok, 0)
    cache.layers[0].crop(1)  # back to 80 tokens: usable again
    cache.update(ok, ok, 0)
