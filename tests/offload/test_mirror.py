"""The prefetcher's mirror records: ``acquire`` returns the layer's ``Mirror``, whose held K/V
equal a plain full-precision layer's (``torch.equal``); the prefetcher alone creates, regrows
and invalidates them (slot reuse by another layer, evict, close); the capacity rule the planner
uses (``steady_capacity``) is what a decoding layer's mirror holds."""

from __future__ import annotations

import pytest
import torch

from tiercache.cache.chain import make_storage
from tiercache.layers.buffer import CHUNK
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload.mirror import Mirror, mirror_capacity, row_stride, steady_capacity
from tiercache.offload.processor import Prefetcher, offloaded

STORAGES = {"full": dict(), "sliding": dict(window=6), "static": dict(max_length=40)}


def build(n: int, depth: int, **kw):
    pf = Prefetcher()
    policy = OffloadPolicy(device="cpu", prefetch=depth)
    off = [offloaded(lambda tier: make_storage(tier=tier, **kw), policy, pf, i) for i in range(n)]
    return off, [make_storage(**kw) for _ in range(n)], pf


def feed(off, ref, t: int, gen) -> None:
    for lo, lr in zip(off, ref):
        k, v = torch.randn(2, 2, t, 4, generator=gen), torch.randn(2, 2, t, 6, generator=gen)
        a, b = lo.update(k, v), lr.update(k, v)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def same(mirror: Mirror, ref) -> None:
    k, v = mirror.kv()
    want = ref.kv()
    assert torch.equal(k, want[0]) and torch.equal(v, want[1])


@pytest.mark.parametrize("storage", list(STORAGES))
def test_acquire_returns_the_mirror_holding_the_layer(storage):
    off, ref, pf = build(2, 1, **STORAGES[storage])
    gen = torch.Generator().manual_seed(0)
    for t in (9, 1, 1):
        feed(off, ref, t, gen)
    for lo, lr in zip(off, ref):
        mirror = pf.acquire(lo)
        assert mirror.valid and pf.mirror(lo) is mirror and mirror.slot.owner == lo.key
        same(mirror, lr)
        assert pf.acquire(lo) is mirror  # in use: the same record, nothing fetched again
        if storage == "static":
            assert mirror.capacity >= 40 and not mirror.k[:, :, mirror.lo + mirror.held :].any()


def test_slot_reuse_invalidates_the_previous_owners_mirror():
    off, ref, pf = build(2, 0)  # one slot: each use of a layer takes it from the other
    gen = torch.Generator().manual_seed(1)
    feed(off, ref, 5, gen)
    first = pf.acquire(off[0])
    slot = first.slot
    second = pf.acquire(off[1])
    assert second.slot is slot and len(pf.slots) == 1
    assert not first.valid and first.k is None and first.slot is None
    assert pf.mirror(off[0]) is None
    same(pf.acquire(off[0]), ref[0])  # fetched again, into the same slot


def test_evict_and_close_drop_the_mirror():
    off, ref, pf = build(2, 1)
    gen = torch.Generator().manual_seed(2)
    feed(off, ref, 5, gen)
    mirror = pf.acquire(off[0])
    off[0].evict()
    assert not mirror.valid and pf.mirror(off[0]) is None
    off[0].crop(3)
    ref[0].crop(3)
    same(pf.acquire(off[0]), ref[0])  # the host copy changed: a fresh record holds it
    ahead = pf.mirror(off[1])
    assert ahead is not None and ahead.valid  # fetched ahead of use
    pf.close()
    assert not ahead.valid and pf.mirror(off[1]) is None and pf.slots == []


def test_an_update_past_the_capacity_regrows_the_same_record():
    off, ref, pf = build(1, 0)
    gen = torch.Generator().manual_seed(3)
    feed(off, ref, CHUNK - 2, gen)
    mirror = pf.acquire(off[0])
    assert mirror.capacity == CHUNK
    feed(off, ref, 5, gen)  # CHUNK + 3 tokens: the held ones move to fresh, larger slot bytes
    assert pf.acquire(off[0]) is mirror and mirror.valid
    assert mirror.capacity == mirror_capacity(CHUNK + 3) == 2 * CHUNK
    assert mirror.slot.nbytes() >= 2 * 2 * mirror.capacity * (4 + 6) * 4
    same(mirror, ref[0])


@pytest.mark.parametrize("storage", ["full", "static"])
@pytest.mark.parametrize("prefill", [9, CHUNK - 1, CHUNK, 3 * CHUNK + 7])
def test_decoding_mirror_has_the_planned_capacity(storage, prefill):
    """The planner's rule (``steady_capacity``): the host rows, or whole chunks for kept + 1."""
    kw = dict(STORAGES[storage], max_length=4 * CHUNK) if storage == "static" else {}
    off, ref, pf = build(3, 1, **kw)
    gen = torch.Generator().manual_seed(4)
    feed(off, ref, prefill, gen)
    for _ in range(3):
        feed(off, ref, 1, gen)
    for lo, lr in zip(off, ref):
        mirror = pf.acquire(lo)
        same(mirror, lr)
        host_rows = row_stride(lo.inner.kv()[0])
        assert mirror.capacity <= steady_capacity(host_rows, mirror.held)
        slot_tokens = mirror.slot.nbytes() // (2 * 2 * (4 + 6) * 4)
        assert slot_tokens == steady_capacity(host_rows, mirror.held)


def test_mirror_capacity_rule():
    assert mirror_capacity(1) == CHUNK and mirror_capacity(CHUNK + 1) == 2 * CHUNK
    assert mirror_capacity(3, floor=1000) == 1000  # static: views span max_length
    assert steady_capacity(2 * CHUNK, CHUNK - 1) == 2 * CHUNK  # the host rows are larger
    assert steady_capacity(CHUNK, CHUNK) == 2 * CHUNK  # the next token needs a new chunk
