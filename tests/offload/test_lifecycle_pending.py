"""Lifecycle operations on layers with deferred work pending: the CUDA path, run on the simulated
device (``tiercache.simdevice``), where a staged copy lands only when its stream is
advanced past it and its destination holds poison until then.

- ``Offload``: a write-back is staged (a pinned copy on the side stream + an event) and joins the
  host layer once landed. Every operation that reads the host copy (state_dict, export: fork,
  save, retier) or replaces it (load_state_dict, ingest, evict) must see / drop nothing:
  compared with a ``DynamicCache``.
- ``Quantize``: the non-finite flag of an earlier update (copied to pinned memory on the compute
  stream, read once landed) must surface before a state dict, export or adopt: a poisoned layer
  is never saved, forked or moved silently, and the refused operation leaves the cache as it was.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import tiercache
from tiercache.errors import CacheError
from tiercache.models.spec import ModelSpec
from tiercache.offload.processor import Offload
from tiercache.quantize.processor import Quantize
from tests.offload.simdev import sim  # noqa: F401 (fixture)

SPEC = ModelSpec("pending", 3, ("full_attention",) * 3, kv_heads=2, head_dim=8, dtype="float32")
HOST = {"name": "host", "offload": {"device": "cpu", "prefetch": 1}}
Q = {"bits": 4, "group_size": 4, "residual_length": 4}


@pytest.fixture
def deferred(sim):  # noqa: F811
    """Offloaded full-storage layers stage their write-backs as on CUDA (the simulated device)."""
    return sim


def feed(caches, steps=(9, 1, 1, 1), seed=0):
    g = torch.Generator().manual_seed(seed)
    for t in steps:
        for i in range(SPEC.num_layers):
            k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
            for c in caches:
                c.update(k, v, i)


def pending(cache) -> int:
    return sum(len(layer.staged) for layer in cache.layers if isinstance(layer, Offload))


def same(cache, ref) -> None:
    for i, layer in enumerate(cache.layers):
        k, v = layer.kv()
        assert torch.equal(k.cpu(), ref.layers[i].keys) and torch.equal(v.cpu(), ref.layers[i].values), f"layer {i}"


def filled(deferred_policy=HOST):
    cache, ref = tiercache.TieredCache.from_policy(deferred_policy, SPEC), DynamicCache()
    feed([cache, ref])
    assert pending(cache) > 0  # write-backs are in flight when the operation starts
    return cache, ref


def test_fork_and_the_original_hold_every_staged_token(deferred):
    cache, ref = filled()
    twin = cache.fork()
    assert pending(cache) == 0
    same(twin, ref)
    same(cache, ref)
    twin.close()
    cache.close()


def test_save_then_load_holds_every_staged_token(deferred, tmp_path):
    cache, ref = filled()
    cache.save(tmp_path / "c.safetensors")
    back = tiercache.TieredCache.load(tmp_path / "c.safetensors", SPEC, policy=HOST)
    same(back, ref)
    assert back.get_seq_length() == ref.get_seq_length() == 12
    back.close()
    cache.close()


@pytest.mark.parametrize("target", [{"name": "fp"}, {"name": "int4-host", "quantize": Q, "offload": {"device": "cpu"}}])
def test_retier_moves_every_staged_token(deferred, target):
    cache, ref = filled()
    cache.retier(target)
    assert cache.get_seq_length() == 12
    if target["name"] == "fp":
        same(cache, ref)
    else:  # packed: every token is there, within int4 error of the reference
        for i, layer in enumerate(cache.layers):
            k, _ = layer.kv()
            assert k.shape == ref.layers[i].keys.shape
            assert (k - ref.layers[i].keys).abs().max() < 0.6
    cache.close()


@pytest.mark.parametrize("op", ["ingest", "load_state_dict"])
def test_replacing_the_host_copy_drops_nothing_into_the_new_state(deferred, op):
    cache, ref = filled()
    source, other = tiercache.TieredCache.from_policy({"name": "fp"}, SPEC), DynamicCache()
    feed([source, other], steps=(5,), seed=1)
    had = [bool(layer.staged) for layer in cache.layers]  # staged pairs that must not join the new state
    assert any(had)
    for i, layer in enumerate(cache.layers):
        if op == "ingest":
            layer.ingest(*source.layers[i].export())
        else:
            layer.load_state_dict({"kind": "offload", "device": "cpu",
                                   **{f"inner.{k}": v for k, v in source.layers[i].state_dict().items()}})
        assert not layer.staged
    same(cache, other)  # the next use would have appended the old staged tokens
    assert cache.get_seq_length() == 5
    cache.close()


def test_kv_reads_every_staged_token(deferred):
    cache, ref = filled()
    for i, layer in enumerate(cache.layers):
        k, v = layer.kv()
        assert torch.equal(k, ref.layers[i].keys) and torch.equal(v, ref.layers[i].values)
        assert layer.is_initialized
    cache.close()


def test_evict_and_tier_nbytes_settle(deferred):
    cache, ref = filled()
    plain = tiercache.TieredCache.from_policy(HOST, SPEC)
    feed([plain])
    assert cache.tier_nbytes() == plain.tier_nbytes()
    for layer in cache.layers:
        layer.evict()
        assert not layer.staged
        assert layer.inner.kv()[0].shape[2] == 12  # the host copy holds every token
    same(cache, ref)
    cache.close()
    plain.close()


# -- Quantize: a non-finite update whose flag has not been read yet ------------------------------

def quantized(layer) -> Quantize:
    while not isinstance(layer, Quantize):
        layer = layer.inner
    return layer


def poison(cache, index: int = 1) -> Quantize:
    """A non-finite update of one token to layer ``index``: accepted, its flag still in flight."""
    nan = torch.full((1, 2, 1, 8), float("nan"))
    cache.update(nan, nan, index)
    q = quantized(cache.layers[index])
    assert q.finite.pending() > 0
    return q


@pytest.mark.parametrize("policy", [{"name": "int4", "quantize": Q},
                                    {"name": "int4-host", "quantize": Q, "offload": {"device": "cpu"}}])
def test_a_poisoned_layer_is_not_forked_saved_or_retiered(sim, policy, tmp_path):  # noqa: F811
    cache, ref = tiercache.TieredCache.from_policy(policy, SPEC), DynamicCache()
    feed([cache, ref])
    before = [tuple(t.clone() for t in layer.kv()) for layer in cache.layers]
    q = poison(cache)
    with pytest.raises(CacheError, match="non-finite"):
        cache.fork()
    for op in (lambda: cache.save(tmp_path / "c.safetensors"), lambda: q.export(), lambda: q.state_dict()):
        with pytest.raises(CacheError, match="non-finite"):
            op()
    assert not (tmp_path / "c.safetensors").exists()

    def as_before(tol: float = 0.0):
        for i, layer in enumerate(cache.layers):  # the other layers are as they were; the poisoned one refuses
            if i == 1:
                with pytest.raises(CacheError):
                    layer.kv()
            else:
                assert all(torch.allclose(a, b, rtol=0, atol=tol) for a, b in zip(layer.kv(), before[i])), i

    as_before()
    with pytest.raises(CacheError, match="non-finite"):
        cache.retier({"name": "fp"})
    assert cache.policy.name == policy["name"]
    # layer 0 had moved when layer 1 refused: retier's roll-back re-quantizes its dequantized
    # values into the same blocks (cache/retier.py), equal up to float rounding
    as_before(1e-5)
    cache.layers[1].crop(1)  # dropping the bad update (its last token) makes it usable (and savable) again
    cache.save(tmp_path / "c.safetensors")
    back = tiercache.TieredCache.load(tmp_path / "c.safetensors", SPEC)
    assert back.get_seq_length() == 12
    back.close()
    cache.close()


def test_adopt_refuses_a_poisoned_source_and_changes_nothing(sim):  # noqa: F811
    cache = tiercache.TieredCache.from_policy({"name": "int4", "quantize": Q}, SPEC)
    feed([cache])
    src = poison(cache, 0)
    dst = tiercache.TieredCache.from_policy({"name": "int4", "quantize": Q}, SPEC)
    feed([dst], steps=(3,), seed=2)
    target = quantized(dst.layers[0])
    held = tuple(t.clone() for t in target.kv())
    assert target.can_adopt(src)
    with pytest.raises(CacheError, match="non-finite"):
        target.adopt(src)
    assert all(torch.equal(a, b) for a, b in zip(target.kv(), held))
    cache.close()
    dst.close()


def test_a_clean_flag_in_flight_is_waited_for_and_saved(sim):  # noqa: F811
    cache, ref = tiercache.TieredCache.from_policy({"name": "int4", "quantize": Q}, SPEC), DynamicCache()
    feed([cache, ref])
    q = quantized(cache.layers[2])
    assert q.finite.pending() > 0  # clean flags, not landed yet
    twin = cache.fork()
    assert q.finite.pending() == 0
    assert all(torch.equal(a, b) for a, b in zip(twin.layers[2].kv(), cache.layers[2].kv()))
    twin.close()
    cache.close()


def feed_bad(caches, bad: int, steps: int = 12):
    """One token per step; layer 1's token at position ``bad`` is NaN (its flag stays in flight)."""
    g = torch.Generator().manual_seed(3)
    for pos in range(steps):
        for i in range(SPEC.num_layers):
            k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 1, 8, generator=g)
            if i == 1 and pos == bad:
                k = torch.full_like(k, float("nan"))
            for c in caches:
                c.update(k, v, i)


@pytest.mark.parametrize("drop", [1, 8, 11, 12])  # the residual, into the blocks, all after the sinks, the sinks too
def test_every_crop_path_clears_a_flag_it_drops(sim, drop):  # noqa: F811
    """With attention sinks a crop takes one of several paths; each forgets the flags it drops."""
    policy = {"name": "int4-sinks", "quantize": {**Q, "sink_tokens": 1}}
    cache, ref = tiercache.TieredCache.from_policy(policy, SPEC), DynamicCache()
    feed_bad([cache, ref], bad=12 - drop)  # the bad update: the first dropped token
    q = quantized(cache.layers[1])
    assert q.finite.pending() > 0
    cache.crop(-drop)
    ref.crop(-drop)
    q.finite.settle()  # nothing left to raise
    assert q.finite.pending() == 0 and q.finite.bad_at is None
    assert cache.get_seq_length() == 12 - drop
    held = cache.layers[1].kv()  # usable again: what a DynamicCache cropped alike holds
    assert (0 if held is None else held[0].shape[2]) == ref.get_seq_length(1) == 12 - drop
    cache.close()


def test_a_kept_flag_still_refuses_after_a_crop(sim):  # noqa: F811
    cache = tiercache.TieredCache.from_policy({"name": "int4", "quantize": Q}, SPEC)
    feed_bad([cache], bad=5)  # an update at position 5 stays
    cache.crop(-2)
    with pytest.raises(CacheError, match="positions 5..5"):
        cache.fork()
    cache.close()
