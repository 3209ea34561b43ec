"""One small test per bug the reliability work found, each failing without its fix."""

from __future__ import annotations

import shutil
import tempfile

import pytest
import torch

from kvmodel import same_snapshot, snapshot, spec
from tiercache.cache.tiered import TieredCache
from tiercache.cache.chain import make_storage
from tiercache.errors import CacheError
from tiercache.layers.sliding import SlidingLayer
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload.disk import DiskTier
from tiercache.offload.processor import Prefetcher, offloaded


def kv(b: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, t, 8, generator=g), torch.randn(b, 2, t, 8, generator=g)


def test_refused_crop_changes_no_layer():
    """cache.crop used to crop the full layers before the sliding one refused: half a rollback."""
    cache = TieredCache.from_policy({}, spec(window=5))
    for i in range(3):
        cache.update(*kv(1, 9, i), i)
    before = snapshot(cache)
    with pytest.raises(CacheError, match="layer 1: cannot crop 6 tokens from a sliding layer"):
        cache.crop(-6)
    assert same_snapshot(before, snapshot(cache))


def test_select_on_a_window_of_one_after_a_long_prefill():
    """A sliding layer of window 1 holds no token after a long prefill; select must still change its batch."""
    layer = SlidingLayer(1)
    layer.update(*kv(2, 300))
    layer.select(torch.tensor([1]))
    k, v = kv(1, 1, 1)
    out = layer.update(k, v)
    assert torch.equal(out[0], k) and torch.equal(out[1], v)


@pytest.mark.parametrize("policy", [{}, {"offload": {"device": "cpu"}}], ids=["resident", "offload"])
def test_batch_ops_on_an_empty_cache_are_no_ops(policy):
    """As in transformers (KV-sharing models leave layers empty): reorder / select of an unwritten layer."""
    cache = TieredCache.from_policy(policy, spec(window=5))
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_select_indices(torch.tensor([0]))
    cache.update(*kv(2, 3), 0)
    cache.reorder_cache(torch.tensor([1, 0]))  # layers 1 and 2 are still empty
    assert cache.get_seq_length(0) == 3 and cache.layers[1].kv() is None


def test_disk_tier_directory_made_again():
    """Its directory removed (a temp cleaner), the tier used to fail every later allocation."""
    with tempfile.TemporaryDirectory() as path:
        tier = DiskTier(path)
        a = tier.empty((4,), torch.float32, torch.device("cpu"))
        shutil.rmtree(tier.dir)
        b = tier.empty((4,), torch.float32, torch.device("cpu"))
        assert len(tier.paths()) == 2 and a.shape == b.shape
        tier.close()


def device_oom(monkeypatch, succeed: int = 0) -> None:
    """The prefetcher's device buffers (``torch.empty(nbytes, dtype=uint8)``) run out after ``succeed`` more."""
    real, left = torch.empty, [succeed]

    def empty(*args, **kwargs):
        if args and isinstance(args[0], int) and kwargs.get("dtype") is torch.uint8:
            left[0] -= 1
            if left[0] < 0:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)


def two_offloaded(depth: int = 1):
    pf = Prefetcher()
    policy = OffloadPolicy(device="cpu", prefetch=depth)
    return pf, [offloaded(lambda tier: make_storage(tier=tier), policy, pf, i) for i in range(2)]


def test_device_oom_while_fetching_is_a_cache_error_and_changes_nothing(monkeypatch):
    """The fetch used to claim a slot before allocating it, then raise a raw OutOfMemoryError,
    leaving the layer pointing at a mirror that was never filled."""
    pf, layers = two_offloaded()
    ref = make_storage()
    k, v = kv(1, 5)
    layers[0].update(k, v)
    ref.update(k, v)
    pf.close()  # every device buffer given back: the next use must fetch
    device_oom(monkeypatch)
    with pytest.raises(CacheError, match="offload: cannot allocate .* CUDA out of memory"):
        layers[0].update(*kv(1, 1, 1))
    monkeypatch.undo()
    assert layers[0].seq_length() == 5 and pf.mirror(layers[0]) is None
    k, v = kv(1, 1, 2)
    out, want = layers[0].update(k, v), ref.update(k, v)
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


def test_device_oom_growing_the_mirror_leaves_host_copy_unchanged(monkeypatch):
    """Growing the mirror used to happen after the host append: an OOM there left the host
    copy one update ahead of what the caller was told (the update raised)."""
    pf, (layer, _) = two_offloaded(depth=0)
    layer.update(*kv(1, 250))
    device_oom(monkeypatch)
    with pytest.raises(CacheError, match="CUDA out of memory"):
        layer.update(*kv(1, 10, 1))  # past the mirror's 256 tokens: it must grow
    monkeypatch.undo()
    assert layer.seq_length() == 250 and layer.inner.seq_length() == 250


def test_fetch_ahead_failure_does_not_fail_the_update(monkeypatch):
    """Prefetching the next layer is optional: no device memory for it must not fail this layer's update."""
    pf, layers = two_offloaded()
    for i, layer in enumerate(layers):
        layer.update(*kv(1, 5, i))
    pf.close()
    device_oom(monkeypatch, succeed=1)  # the layer in use gets its buffer, the one ahead does not
    layers[0].update(*kv(1, 1, 9))
    assert layers[0].seq_length() == 6 and pf.mirror(layers[1]) is None


def test_refused_first_update_leaves_a_quantized_layer_as_new(monkeypatch):
    import errno
    import os

    from tiercache.offload import disk as disk_module

    with tempfile.TemporaryDirectory() as path:
        policy = {"quantize": {"bits": 4, "group_size": 4, "residual_length": 4}, "offload": {"device": "disk", "path": path}}
        cache = TieredCache.from_policy(policy, spec(window=5))

        def full(fd, nbytes):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(disk_module, "reserve", full)
        with pytest.raises(CacheError, match="No space left"):
            cache.update(*kv(4, 9), 0)  # packs blocks: the disk store refuses
        monkeypatch.undo()
        assert cache.layers[0].kv() is None and cache.get_seq_length(0) == 0
        cache.update(*kv(1, 9), 0)  # a smaller batch, as for a new layer
        cache.close()


def test_quantized_sliding_layer_validates_crops_like_it_crops():
    from tiercache.cache.chain import build_layers
    from tiercache.models.spec import ModelSpec
    from tiercache.policy.schema import Policy

    model = ModelSpec("m", 1, ("sliding_attention",), kv_heads=2, head_dim=4, sliding_window=6)
    layers, _ = build_layers(Policy.from_dict({"quantize": {"bits": 4, "group_size": 2, "residual_length": 2}}).resolve(model))
    layer = layers[0]
    g = torch.Generator().manual_seed(0)
    for t in (9, 1, 1, 1):
        layer.update(torch.randn(1, 2, t, 4, generator=g), torch.randn(1, 2, t, 4, generator=g))
    outcomes = []
    for n in range(layer.seq_length() + 1):
        snapshot = [x.clone() for x in layer.kv()], layer.seq_length(), layer.nbytes()
        try:
            layer.validate_crop(n)
            allowed = True
        except CacheError:
            allowed = False
        k, v = snapshot[0]
        assert torch.equal(layer.kv()[0], k) and torch.equal(layer.kv()[1], v)
        assert (layer.seq_length(), layer.nbytes()) == snapshot[1:]
        outcomes.append(allowed)
        if not allowed:
            with pytest.raises(CacheError):
                layer.crop(n)  # refused by crop too
    # crop(0) is fine; past the window is refused; removing every token empties the layer (exact)
    assert outcomes[0] and not outcomes[-2] and outcomes[-1]


BAD_FOR_OFFLOAD = [
    ("dtype", lambda: torch.randn(1, 2, 10, 8).half()),
    ("batch", lambda: torch.randn(2, 2, 10, 8)),
    ("heads", lambda: torch.randn(1, 3, 10, 8)),
    ("head_dim", lambda: torch.randn(1, 2, 10, 6)),
]


@pytest.mark.parametrize("name,make", BAD_FOR_OFFLOAD, ids=[b[0] for b in BAD_FOR_OFFLOAD])
def test_refused_update_at_a_mirror_chunk_boundary_leaves_the_offloaded_layer_exact(name, make):
    """The update is checked before the device mirror is regrown (it used to be rebuilt in the bad
    update's dtype / batch first, so the next valid update returned wrong K/V)."""
    from tiercache.models.spec import ModelSpec

    model = ModelSpec("m", 1, ("full_attention",), kv_heads=2, head_dim=8, dtype="float32")
    cache = TieredCache.from_policy({"offload": {"device": "cpu"}}, model)
    ref = TieredCache.from_policy({}, model)
    k0 = torch.randn(1, 2, 250, 8, generator=torch.Generator().manual_seed(0))
    for c in (cache, ref):
        c.update(k0, k0, 0)
    nbytes = cache.nbytes()
    bad = make()
    with pytest.raises(CacheError, match="layer 0"):
        cache.update(bad, bad, 0)  # 250 + 10 passes the mirror's 256-token chunk
    assert cache.nbytes() == nbytes
    k1 = torch.randn(1, 2, 1, 8)
    out, expected = cache.update(k1, k1, 0), ref.update(k1, k1, 0)
    assert torch.equal(out[0], expected[0]) and torch.equal(out[1], expected[1])
