"""Offload write-backs: failures that surface late, the layer's batch while a write-back is staged,
and the order of the host copy's changes against the layer's own fetch (the GPU path, run on the
simulated device as in ``test_lifecycle_pending``: a staged write-back is *in flight* until its
stream is advanced).

- A staged write-back that the host layer cannot take (disk full, a pinned buffer that cannot
  grow) surfaces when it lands and joins the host layer, maybe while *another* layer fetches this
  one ahead, where the fetch is optional
  and its error is dropped: the layer must still refuse every later use (``CacheError``, "reset
  the cache"), never go on silently without those tokens; ``reset`` makes it usable again.
- A layer whose only update is staged knows its batch (as it knows it is initialized).
- Non-deferred write-backs (sliding and disk host layers) change the host copy in place
  (a sliding window slides down): the one host sync of such an update must come after the
  layer's mirror was acquired (on CUDA the compute stream has then waited for its fetch), so the
  host copy never changes under a fetch still reading it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import tiercache
from tiercache.errors import CacheError
from tiercache.models.spec import ModelSpec
from tiercache.offload import writeback
from tiercache.offload.prefetch import Prefetcher
from tests.offload.test_offload import Pair, build, tokens
from tests.offload.simdev import sim  # noqa: F401 (fixture)
from tests.offload.test_lifecycle_pending import HOST, SPEC, deferred, feed  # noqa: F401 (fixture)

FAILURES = {"cache-error": lambda: CacheError("disk full"), "out-of-memory": lambda: torch.OutOfMemoryError("pinned")}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_write_back_dropped_by_a_fetch_ahead_still_refuses_the_layer(deferred, failure):  # noqa: F811
    cache, ref = tiercache.TieredCache.from_policy(HOST, SPEC), DynamicCache()
    feed([cache, ref], steps=(5, 1))
    layer = cache.layers[1]
    assert len(layer.staged) == 1  # its last write-back is in flight

    def refuse(key, value):
        raise FAILURES[failure]()

    layer.inner.append = refuse  # the host layer cannot take it
    deferred.synchronize()  # it lands: the next use of the layer (a fetch ahead) joins it
    k, v = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)
    try:  # layer 0's update fetches layer 1 ahead: its write-back surfaces there
        cache.update(k, v, 0)
    except CacheError:
        pass  # (refusing is allowed; any other error is not)
    del layer.inner.append
    assert cache.nbytes()["cpu"] > 0  # bytes are still reported (what is held)
    for use in (lambda: cache.update(k, v, 1), lambda: layer.kv(), lambda: cache.fork()):
        with pytest.raises(CacheError, match="reset the cache"):
            use()  # never the layer without the lost tokens
    cache.reset()
    fresh = DynamicCache()
    feed([cache, fresh], steps=(3, 1), seed=4)
    for i, layer in enumerate(cache.layers):
        k, v = layer.kv()
        assert torch.equal(k, fresh.layers[i].keys) and torch.equal(v, fresh.layers[i].values)
    cache.close()


def test_a_staged_first_update_knows_its_batch(deferred):  # noqa: F811
    one = ModelSpec("one", 1, ("full_attention",), kv_heads=2, head_dim=8, dtype="float32")
    cache = tiercache.TieredCache.from_policy(HOST, one)
    cache.update(torch.randn(3, 2, 4, 8), torch.randn(3, 2, 4, 8), 0)
    layer = cache.layers[0]
    assert len(layer.staged) == 1 and layer.is_initialized
    assert layer.batch_size() == 3
    assert cache.batch_size == 3
    cache.close()


@pytest.mark.parametrize("storage,device", [("sliding", "cpu"), ("static", "disk")])
def test_a_synchronous_write_back_waits_after_the_layer_fetch(storage, device, monkeypatch, tmp_path):
    off, ref, _ = build(storage, device, 1, tmp_path)
    order: list[str] = []
    acquire, to_host = Prefetcher.acquire, writeback.to_host

    def acquired(self, layer, room=0):
        order.append(f"acquire {layer.index}")
        return acquire(self, layer, room)

    def synced(key, value):
        order.append("host sync")
        return to_host(key, value)

    monkeypatch.setattr(Prefetcher, "acquire", acquired)
    monkeypatch.setattr(writeback, "to_host", synced)
    pair, g = Pair(off, ref, storage), torch.Generator().manual_seed(5)
    for t in (7, 1, 1, 1):  # the window slides down its host rows in place
        order.append("step")
        for i, layer in enumerate(off):
            order.append(f"update {i}")
            k, v = tokens(t, torch.float32, 1, g)
            pair.same(layer.update(k, v), ref[i].update(k, v))
    syncs = 0
    for at, what in enumerate(order):
        if what == "host sync":  # this update's own acquire came first
            syncs += 1
            update = max(j for j in range(at) if order[j].startswith("update"))
            assert f"acquire {order[update].split()[1]}" in order[update:at], order[update : at + 1]
    assert syncs == 4 * len(off)
    pair.check()
