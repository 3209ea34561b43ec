"""The disk tier: files live only while needed, never shared, and failures are clean errors."""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tiercache.cache.chain import make_storage
from tiercache.cache.compat import cache_arg
from tiercache.errors import CacheError
from tiercache.policy.schema import OffloadPolicy
from tiercache.offload import disk as disk_module
from tiercache.offload.disk import DiskTier
from tiercache.offload.processor import Prefetcher, offloaded


def kv(t: int, batch: int = 1, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, t, 4, generator=g), torch.randn(batch, 2, t, 4, generator=g)


def disk_layer(path, storage: dict | None = None, pf=None, index: int = 0):
    policy = OffloadPolicy(device="disk", prefetch=1, path=str(path))
    return offloaded(lambda tier: make_storage(tier=tier, **(storage or {})), policy, pf or Prefetcher(), index)


def files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def test_files_live_while_used_and_go_on_reset(tmp_path):
    layer = disk_layer(tmp_path)
    layer.update(*kv(5))
    tier = layer.inner.buffer.tier
    assert len(tier.paths()) == 2 and all(p.startswith(str(tmp_path)) for p in tier.paths())
    assert files_under(tmp_path) == tier.paths()
    layer.reset()
    assert files_under(tmp_path) == []
    layer.update(*kv(300))  # usable again after reset; regrowth frees the old files
    assert len(files_under(tmp_path)) == 2


def test_close_removes_directory(tmp_path):
    layer = disk_layer(tmp_path)
    layer.update(*kv(5))
    layer.close()
    assert os.listdir(tmp_path) == []


def test_garbage_collection_removes_files(tmp_path):
    layer = disk_layer(tmp_path)
    layer.update(*kv(5))
    assert files_under(tmp_path)
    del layer
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_cache_garbage_collected(tmp_path):
    pytest.importorskip("transformers")
    from tests.builders import build

    import tiercache

    model = build("llama")
    cache = tiercache.TieredCache.from_policy({"offload": {"device": "disk", "path": str(tmp_path)}}, model.config)
    model(torch.tensor([[3, 4, 5]]), **cache_arg(cache))
    assert len(files_under(tmp_path)) == 2 * model.config.num_hidden_layers
    del cache
    gc.collect()
    assert os.listdir(tmp_path) == []


def test_interpreter_exit_removes_files(tmp_path):
    script = textwrap.dedent(f"""
        import torch
        from tiercache.offload.disk import DiskTier
        tier = DiskTier({str(tmp_path)!r})
        t = tier.empty((2, 3), torch.float32, torch.device("cpu"))
        t.fill_(1.0)
        print(tier.dir)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip().startswith(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_two_caches_never_share_files(tmp_path):
    a, b = disk_layer(tmp_path), disk_layer(tmp_path)
    a.update(*kv(5))
    b.update(*kv(5))
    ta, tb = a.inner.buffer.tier, b.inner.buffer.tier
    assert ta.dir != tb.dir and not set(ta.paths()) & set(tb.paths())
    a.close()
    assert len(files_under(tmp_path)) == 2 and os.path.isdir(tb.dir)


def test_data_is_on_disk(tmp_path):
    tier = DiskTier(tmp_path)
    t = tier.empty((4, 8), torch.float32, torch.device("cpu"))
    t.copy_(torch.arange(32.0).view(4, 8))
    (name,) = tier.paths()
    assert torch.equal(torch.from_file(name, size=32, dtype=torch.float32).view(4, 8), t)
    assert tier.place(torch.device("cpu")) == "disk"
    tier.free(t)
    assert tier.paths() == [] and os.listdir(tier.dir) == []
    tier.close()


def _no_space(fd, nbytes):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("storage", [{}, {"max_length": 32}], ids=["full", "static"])
def test_full_disk_at_first_write(storage, tmp_path, monkeypatch):
    layer = disk_layer(tmp_path, storage)
    monkeypatch.setattr(disk_module, "reserve", _no_space)
    with pytest.raises(CacheError, match="No space left on device"):
        layer.update(*kv(5))
    assert layer.kv() is None and layer.seq_length() == 0
    monkeypatch.undo()
    k, v = kv(5)
    out = layer.update(k, v)
    assert torch.equal(out[0][:, :, :5], k) and torch.equal(out[1][:, :, :5], v)


def test_full_disk_when_growing_keeps_prior_state(tmp_path, monkeypatch):
    layer, ref = disk_layer(tmp_path), make_storage()
    for t, seed in ((200, 0), (1, 1)):
        layer.update(*kv(t, seed=seed))
        ref.update(*kv(t, seed=seed))
    monkeypatch.setattr(disk_module, "reserve", _no_space)
    with pytest.raises(CacheError, match="No space left on device"):
        layer.update(*kv(100, seed=2))  # past the first chunk: the disk buffer must grow
    assert layer.seq_length() == ref.seq_length() == 201
    assert all(torch.equal(a, b) for a, b in zip(layer.kv(), ref.kv()))
    monkeypatch.undo()
    out, want = layer.update(*kv(100, seed=2)), ref.update(*kv(100, seed=2))
    assert all(torch.equal(a, b) for a, b in zip(out, want))


def test_unwritable_path(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    layer = disk_layer(blocker / "cache")
    with pytest.raises(CacheError, match="disk tier: cannot store"):
        layer.update(*kv(3))
    assert layer.kv() is None


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        layer = disk_layer(ro)
        with pytest.raises(CacheError, match="Permission denied"):
            layer.update(*kv(3))
        ro.chmod(0o700)
        layer.update(*kv(3))
        assert layer.seq_length() == 3
    finally:
        ro.chmod(0o700)


def test_permission_denied_by_injection(tmp_path, monkeypatch):
    """What a read-only directory does, injected (the suite may run as root)."""
    import tempfile

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    layer = disk_layer(tmp_path)
    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    with pytest.raises(CacheError, match="Permission denied"):
        layer.update(*kv(3))
    assert layer.kv() is None and layer.nbytes() == {}
    monkeypatch.undo()
    layer.update(*kv(3))
    assert layer.seq_length() == 3


def test_half_done_allocation_leaves_no_file(tmp_path, monkeypatch):
    """Keys allocated, values not (disk full in between): the keys' file goes too."""
    layer = disk_layer(tmp_path)
    layer.update(*kv(5))
    calls = []

    def second_fails(fd, nbytes):
        calls.append(nbytes)
        if len(calls) == 2:
            _no_space(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)

    monkeypatch.setattr(disk_module, "reserve", second_fails)
    with pytest.raises(CacheError):
        layer.update(*kv(300))
    gc.collect()
    assert len(files_under(tmp_path)) == 2 and layer.seq_length() == 5
