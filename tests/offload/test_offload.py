"""Offload vs a resident layer: bit-exact (torch.equal) through update sequences and batch ops.

Several offloaded layers share one Prefetcher and are driven like a model drives them (layer
0, 1, 2, then wrap around), so the prefetch schedule, slot reuse and eviction all take part.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.cache.chain import make_storage
from tiercache.errors import CacheError
from tiercache.layers.buffer import CHUNK
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload.processor import Offload, Prefetcher, offloaded, row_stride

LAYERS = 3
STORAGES = {"full": dict(), "sliding": dict(window=5), "static": dict(max_length=64)}
PREFETCH = [0, 1, 2]
DEVICES = ["cpu", "disk"]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "u8": torch.uint8}


def tokens(t: int, dtype: torch.dtype, batch: int = 2, gen=None):
    """A key [B, 2, T, 4] and a value [B, 2, T, 6] (different head dims)."""
    if dtype == torch.uint8:
        return (torch.randint(0, 256, (batch, 2, t, 4), dtype=dtype, generator=gen),
                torch.randint(0, 256, (batch, 2, t, 6), dtype=dtype, generator=gen))
    return torch.randn(batch, 2, t, 4, generator=gen).to(dtype), torch.randn(batch, 2, t, 6, generator=gen).to(dtype)


def build(storage: str, device: str, prefetch: int, tmp_path, layers: int = LAYERS):
    kw = STORAGES[storage]
    policy = OffloadPolicy(device=device, prefetch=prefetch, path=str(tmp_path) if device == "disk" else None)
    pf = Prefetcher()
    off = [offloaded(lambda tier: make_storage(tier=tier, **kw), policy, pf, i) for i in range(layers)]
    ref = [make_storage(**kw) for _ in range(layers)]
    return off, ref, pf


class Pair:
    """Drives offloaded and resident layers in lockstep and checks they agree."""

    def __init__(self, off, ref, storage):
        self.off, self.ref, self.static = off, ref, storage == "static"

    def same(self, a, b):
        assert a[0].shape == b[0].shape and a[1].shape == b[1].shape
        if self.static:  # positions past the length are masked: compare what is held
            n = self.ref[0].seq_length()
            a, b = [x[:, :, :n] for x in a], [x[:, :, :n] for x in b]
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])

    def step(self, t, dtype, batch, gen):
        for lo, lr in zip(self.off, self.ref):
            k, v = tokens(t, dtype, batch, gen)
            self.same(lo.update(k, v), lr.update(k, v))
        self.check()

    def op(self, name, *args):
        for lo, lr in zip(self.off, self.ref):
            getattr(lo, name)(*args)
            getattr(lr, name)(*args)
        self.check()

    def check(self):
        for lo, lr in zip(self.off, self.ref):
            assert lo.seq_length() == lr.seq_length()
            assert lo.mask_sizes(1) == lr.mask_sizes(1)
            a, b = lo.kv(), lr.kv()
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", PREFETCH, ids=[f"prefetch{p}" for p in PREFETCH])
@pytest.mark.parametrize("storage", list(STORAGES))
def test_bit_exact_sequence(storage, prefetch, device, dtype, tmp_path):
    off, ref, pf = build(storage, device, prefetch, tmp_path)
    pair, gen = Pair(off, ref, storage), torch.Generator().manual_seed(0)
    pair.step(7, dtype, 2, gen)  # prefill
    for _ in range(4):
        pair.step(1, dtype, 2, gen)
    pair.op("set_recording", True)
    pair.step(3, dtype, 2, gen)  # a speculative block ...
    pair.op("crop", 2)  # ... partly rejected
    pair.op("set_recording", False)
    pair.step(1, dtype, 2, gen)
    pair.op("reorder", torch.tensor([1, 0]))
    pair.step(1, dtype, 2, gen)
    pair.op("select", torch.tensor([1]))
    pair.step(2, dtype, 1, gen)
    pair.op("repeat_interleave", 3)
    pair.step(1, dtype, 3, gen)
    pair.op("reset")
    pair.step(4, dtype, 1, gen)
    pair.step(1, dtype, 1, gen)
    assert len(pf.slots) <= prefetch + 1


@pytest.mark.parametrize("storage", ["full", "sliding"])
def test_long_prefill_and_growth(storage, tmp_path):
    """A prefill past one chunk (sliding's long path) and decoding across a chunk boundary."""
    off, ref, _ = build(storage, "cpu", 1, tmp_path)
    pair, gen = Pair(off, ref, storage), torch.Generator().manual_seed(1)
    pair.step(CHUNK + 40, torch.float32, 1, gen)
    for _ in range(3):
        pair.step(1, torch.float32, 1, gen)
    pair.step(CHUNK, torch.float32, 1, gen)  # regrow in the middle of a session
    pair.step(1, torch.float32, 1, gen)


def test_single_layer_stays_resident(tmp_path):
    """One offloaded layer (nothing to rotate with): its mirror carries over between steps."""
    off, ref, pf = build("sliding", "cpu", 2, tmp_path, layers=1)
    pair, gen = Pair(off, ref, "sliding"), torch.Generator().manual_seed(2)
    for t in (6, 1, 1, 1, 2, 1):
        pair.step(t, torch.float32, 2, gen)
    assert pf.fetches == 1  # fetched once (empty), then kept: no refetch per step


def test_only_new_tokens_go_to_host(tmp_path):
    off, ref, pf = build("full", "cpu", 1, tmp_path)
    pair, gen = Pair(off, ref, "full"), torch.Generator().manual_seed(3)
    pair.step(10, torch.float32, 2, gen)
    pair.step(1, torch.float32, 2, gen)  # (checks read every layer: kv() fetches too)
    d2h, h2d = pf.bytes_d2h, pf.bytes_h2d
    for layer in off:  # one decode step, as a model runs it
        layer.update(*tokens(1, torch.float32))
    per_token = 2 * 2 * 1 * (4 + 6) * 4  # B * H * T * (Dk + Dv) * float32
    assert pf.bytes_d2h - d2h == LAYERS * per_token
    # layers 1 and 2 (11 tokens) are fetched ahead, then layer 0 (12 tokens) for the next step, each
    # as one flat span per tensor: the first B * H - 1 rows whole (capacity 256), the last one's held tokens
    row = (4 + 6) * 4  # one token of one head row, K and V
    assert pf.bytes_h2d - h2d == sum((2 * 2 - 1) * 256 + s for s in (11, 11, 12)) * row


@pytest.mark.parametrize("prefetch", PREFETCH)
def test_device_slots_bounded_and_reused(prefetch, tmp_path):
    off, ref, pf = build("full", "cpu", prefetch, tmp_path, layers=5)
    pair, gen = Pair(off, ref, "full"), torch.Generator().manual_seed(4)
    pair.step(5, torch.float32, 1, gen)
    datas = {id(s): s.data.data_ptr() for s in pf.slots}
    for _ in range(6):
        pair.step(1, torch.float32, 1, gen)
    assert len(pf.slots) == prefetch + 1
    assert {id(s): s.data.data_ptr() for s in pf.slots} == datas  # no reallocation per token
    assert sum(pf.nbytes().values()) == sum(s.nbytes() for s in pf.slots)


def test_nbytes_reports_host_tier(tmp_path):
    off, _, pf = build("full", "cpu", 1, tmp_path)
    off[0].update(*tokens(3, torch.float32))
    assert set(off[0].nbytes()) == {"cpu"}
    disk, _, _ = build("full", "disk", 1, tmp_path)
    disk[0].update(*tokens(3, torch.float32))
    assert set(disk[0].nbytes()) == {"disk"} and disk[0].nbytes()["disk"] > 0


def test_rejected_update_leaves_layer_unchanged(tmp_path):
    off, ref, _ = build("static", "cpu", 1, tmp_path)
    pair, gen = Pair(off, ref, "static"), torch.Generator().manual_seed(5)
    pair.step(60, torch.float32, 2, gen)
    with pytest.raises(CacheError, match="static storage is full"):
        off[0].update(*tokens(5, torch.float32))
    with pytest.raises(CacheError, match="dtype"):
        off[1].update(*tokens(1, torch.float64))
    pair.check()
    pair.step(1, torch.float32, 2, gen)


def test_prefetch_hook_and_close(tmp_path):
    off, _, pf = build("full", "cpu", 0, tmp_path)
    for layer in off:
        layer.update(*tokens(3, torch.float32))
    off[1].prefetch()  # layer 2 is in use; a second slot is free only if one exists
    mirror = pf.mirror(off[1])
    assert mirror is None or (mirror.valid and mirror.slot.owner == off[1].key)
    for layer in off:
        layer.close()
    assert pf.layers == {} and all(s.owner is None for s in pf.slots)
    pf.close()
    assert pf.slots == []


def test_row_stride():
    base = torch.zeros(2, 3, 10, 4)
    assert row_stride(base[:, :, :7]) == 10
    assert row_stride(base[:, :, 2:7]) == 10
    assert row_stride(base.transpose(1, 2)) is None
    assert row_stride(torch.zeros(1, 1, 5, 4)) == 5


def test_negative_depth_rejected():
    with pytest.raises(CacheError, match="prefetch depth"):
        Offload(make_storage(), Prefetcher(), 0, depth=-1)


ADOPT = [("full", "cpu", "full", "disk"), ("full", "disk", "static", "cpu"), ("sliding", "cpu", "sliding", "disk"),
         ("static", "cpu", "full", "cpu")]


@pytest.mark.parametrize("src,src_device,dst,dst_device", ADOPT, ids=["-".join(a) for a in ADOPT])
def test_adopt_moves_the_host_copy_host_to_host(src, src_device, dst, dst_device, tmp_path, monkeypatch):
    """An offloaded layer takes another's host copy (retier between offload policies) without
    ``export`` (which brings it to the compute device): then it holds what a plain layer of its
    storage holds after ``ingest(*export())`` of the reference, and continues exactly like it."""
    old, ref, _ = build(src, src_device, 1, tmp_path, layers=2)
    pair, gen = Pair(old, ref, src), torch.Generator().manual_seed(6)
    for t in (9, 1, 1):
        pair.step(t, torch.float32, 2, gen)
    new, want, pf = build(dst, dst_device, 2, tmp_path, layers=2)
    assert all(n.can_adopt(o) for n, o in zip(new, old)) and not new[0].can_adopt(ref[0])

    def through_the_device(self):
        raise AssertionError("adopt must not export through the compute device")

    monkeypatch.setattr(Offload, "export", through_the_device)
    for n, o, w, r in zip(new, old, want, ref):
        n.adopt(o)
        w.ingest(*r.export())
    monkeypatch.undo()
    moved = Pair(new, want, dst)
    moved.check()
    assert pf.stats()["bytes_d2h"] == 0  # nothing was written back to a host: it was copied there
    for t in (1, 2, 1):
        moved.step(t, torch.float32, 2, gen)
        pair.step(t, torch.float32, 2, gen)  # the source is untouched and goes on by itself
    empty, _, _ = build("full", "cpu", 1, tmp_path, layers=1)
    new[0].adopt(empty[0])  # an empty source: the layer is emptied
    assert new[0].kv() is None and new[0].seq_length() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_long_sliding_update_does_not_grow_the_mirror(prefetch, device, tmp_path):
    """A prompt longer than a window's mirror (300 tokens, window 5) is answered in fresh tensors,
    exactly as a resident sliding layer answers it; the mirror keeps only the window, so the
    device slots stay at the size the planner counts (``steady_capacity``), however long the prompt."""
    off, ref, pf = build("sliding", device, prefetch, tmp_path)
    pair, gen = Pair(off, ref, "sliding"), torch.Generator().manual_seed(9)
    for t in (300, 1, 1, 280, 2, 1, 300):
        pair.step(t, torch.float32, 2, gen)
        window_bytes = 2 * 2 * 256 * (4 + 6) * 4  # B * H * capacity_for(window) * (Dk + Dv) * float32
        assert max(slot.nbytes() for slot in pf.slots) <= window_bytes  # never the prompt's 512 tokens
    pair.op("set_recording", True)  # recording keeps every token: then the mirror does grow
    pair.step(300, torch.float32, 2, gen)
    pair.op("crop", 200)
