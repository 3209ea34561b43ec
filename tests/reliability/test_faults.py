"""Injected faults: a full disk, a removed backing file or directory, lost permission, and an
allocation failure on the device while prefetching.

Each fault is injected by monkeypatching the one call that would fail for real
(``disk.reserve``: ``posix_fallocate``; ``tempfile.mkstemp``; ``torch.empty`` of the prefetcher's device
buffer). A sweep injects it at the 1st, 2nd, ... call during a fixed run, one shot each: the
update that meets it either succeeds (the fault hit an optional prefetch) or raises a clear
``CacheError`` naming the layer and changes nothing; afterwards every update matches the
full-precision reference again, and the tier directory holds exactly the files of live
buffers (no temporary file is left behind).
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile

import pytest
import torch

from kvmodel import CHAINS, Chain, assert_update, files_under, same_snapshot, snapshot, tokens
from tiercache.errors import CacheError
from tiercache.offload import disk as disk_module
from tiercache.offload.disk import DiskTier

B = 2
STEPS = [9, 1, 4, 1, 1, 17, 1, 2, 1, 250, 1, 1]  # tokens per model step (every layer); 250: a full buffer regrows
DISK = [pytest.param(c, id=c.id) for c in CHAINS if c.on_disk and c.dtype == torch.float32]
SOME_DISK = [p for p in DISK if p.id in ("full-fp-disk-p1-w5", "full-int4-g4-r4-disk-p1-w3", "static-fp-disk-p1-w3",
                                         "static-int8-g4-r3-swap-disk-p1-w5")]
HOST = [pytest.param(c, id=c.id) for c in CHAINS if c.offload.startswith("host") and c.quantize in ("fp", "int4-g4-r4")]


class OneShot:
    """Wraps ``target`` so that its ``at``-th call (while armed) raises ``error()`` instead."""

    def __init__(self, target, at: int, error):
        self.target, self.at, self.error = target, at, error
        self.calls, self.fired, self.armed = 0, False, True

    def __call__(self, *args, **kwargs):
        if self.armed and not self.fired:
            self.calls += 1
            if self.calls == self.at:
                self.fired = True
                raise self.error()
        return self.target(*args, **kwargs)


def disk_tiers(cache) -> list[DiskTier]:
    out = []
    for layer in cache.layers:
        while True:
            tier = getattr(getattr(layer, "buffer", None), "tier", None) or getattr(layer, "tier", None)
            if isinstance(tier, DiskTier):
                out.append(tier)
                break
            nxt = getattr(layer, "store", None) or getattr(layer, "inner", None)
            if nxt is None:
                break
            layer = nxt
    return out


def assert_no_stray_files(cache, path: str) -> None:
    live = {p for tier in disk_tiers(cache) for p in tier.paths()}
    stray = set(files_under(path)) - live
    assert not stray, f"files left behind that no buffer uses: {sorted(stray)}"


def sweep(chain: Chain, path: str, inject, fault: OneShot, message: str) -> bool:
    """Run STEPS with ``fault`` installed by ``inject``; returns whether it fired."""
    cache = chain.build(path)
    refs = chain.refs(cache)
    inject(fault)
    failed = False
    for step, t in enumerate(STEPS):
        for i, ref in enumerate(refs):
            if ref.overflows(t):
                continue
            k, v = tokens(B, t, chain.dtype, 10 * step + i)
            fault.armed = False
            before = None if fault.fired else snapshot(cache)  # one shot: later updates cannot fail
            fault.armed = True
            try:
                out = cache.update(k, v, i)
            except CacheError as e:
                fault.armed = False
                assert str(e).startswith(f"layer {i}: ") and message in str(e), str(e)
                assert same_snapshot(before, snapshot(cache)), "a failed update changed the layer"
                if chain.on_disk:
                    assert_no_stray_files(cache, path)
                failed = True
                continue
            assert_update(out, ref.update(k, v), ref.out_length())
            ref.sync_packed()
    fault.armed = False
    skipped = cache.offload_stats().get("skipped_fetches", 0)  # a fetch ahead that failed is skipped, by design
    for i, ref in enumerate(refs):
        ref.check_held(cache.layers[i].kv())
    if chain.on_disk:
        assert_no_stray_files(cache, path)
    cache.close()
    assert files_under(path) == []
    assert failed or skipped or not fault.fired, "the fault fired but no update reported it nor a fetch ahead skipped it"
    return fault.fired


def _no_space():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _denied():
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES))


@pytest.mark.parametrize("chain", DISK)
def test_disk_full_at_any_allocation(chain, monkeypatch):
    """ENOSPC from the block reservation at the 1st, 2nd, ... file: at a first write, a regrow,
    or between the keys' and the values' files of one regrow (half done)."""
    fired = 0
    for at in range(1, 12):
        with tempfile.TemporaryDirectory() as path:
            fault = OneShot(disk_module.reserve, at, _no_space)
            fired += sweep(chain, path, lambda f: monkeypatch.setattr(disk_module, "reserve", f), fault, "No space left on device")
            monkeypatch.undo()
    assert fired >= 4  # the sweep really met the fault


@pytest.mark.parametrize("chain", SOME_DISK)
def test_permission_lost_at_any_allocation(chain, monkeypatch):
    """Creating a file is refused (a read-only directory, simulated: the suite may run as root)."""
    fired = 0
    for at in (1, 3, 6):
        with tempfile.TemporaryDirectory() as path:
            fault = OneShot(tempfile.mkstemp, at, _denied)
            fired += sweep(chain, path, lambda f: monkeypatch.setattr(tempfile, "mkstemp", f), fault, "Permission denied")
            monkeypatch.undo()
    assert fired >= 1  # static mirrors are allocated once, so few calls can fail


def feed_disturbed(chain: Chain, cache, refs, disturb) -> None:
    """Run STEPS through ``cache`` and its references, calling ``disturb()`` before step 3."""
    for step, t in enumerate(STEPS):
        if step == 3:
            disturb()
        for i, ref in enumerate(refs):
            if not ref.overflows(t):
                k, v = tokens(B, t, chain.dtype, 10 * step + i)
                assert_update(cache.update(k, v, i), ref.update(k, v), ref.out_length())
                ref.sync_packed()


@pytest.mark.parametrize("chain", SOME_DISK)
def test_backing_files_removed_while_in_use(chain):
    """Unlinking the files of live buffers (a temp cleaner) loses nothing: the mappings hold the data."""
    with tempfile.TemporaryDirectory() as path:
        cache = chain.build(path)
        refs = chain.refs(cache)
        feed_disturbed(chain, cache, refs, lambda: [os.unlink(f) for f in files_under(path)])
        for i, ref in enumerate(refs):
            ref.check_held(cache.layers[i].kv())
        cache.close()
        assert files_under(path) == []


@pytest.mark.parametrize("chain", SOME_DISK)
def test_tier_directory_removed_while_in_use(chain):
    """The whole directory removed: later allocations make it again, and the cache goes on."""
    with tempfile.TemporaryDirectory() as path:
        cache = chain.build(path)
        feed_disturbed(chain, cache, chain.refs(cache),
                       lambda: [shutil.rmtree(tier.dir) for tier in disk_tiers(cache) if tier.dir is not None])
        assert_no_stray_files(cache, path)
        cache.close()
        assert files_under(path) == []


def test_disk_blocks_are_reserved_up_front():
    """Why a copy into a disk buffer cannot fail with ENOSPC later: its blocks exist once allocated."""
    with tempfile.TemporaryDirectory() as path:
        tier = DiskTier(path)
        t = tier.empty((64, 1024), torch.float32, torch.device("cpu"))
        (name,) = tier.paths()
        assert os.stat(name).st_blocks * 512 >= t.numel() * t.element_size()
        tier.close()


OOM = [pytest.param(lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"), "CUDA out of memory", id="oom"),
       pytest.param(lambda: RuntimeError("allocation failed"), "allocation failed", id="runtime-error")]


def device_buffer_calls(fault: OneShot):
    """``torch.empty`` with the prefetcher's device-buffer signature goes through ``fault``."""
    real = torch.empty

    def empty(*args, **kwargs):
        if args and isinstance(args[0], int) and kwargs.get("dtype") is torch.uint8:
            return fault(*args, **kwargs)
        return real(*args, **kwargs)

    fault.target = real
    return empty


@pytest.mark.parametrize("error,message", OOM)
@pytest.mark.parametrize("chain", HOST)
def test_device_allocation_fails_while_prefetching(chain, error, message, monkeypatch):
    """The prefetcher cannot get a device buffer (for the layer in use, for one fetched ahead, or
    to grow a mirror): the update that needs it raises CacheError; one only fetched ahead is
    skipped (it is fetched again when used)."""
    fired = 0
    for at in range(1, 10):
        fault = OneShot(None, at, error)
        monkeypatch.setattr(torch, "empty", device_buffer_calls(fault))
        fired += sweep(chain, "", lambda f: None, fault, message)  # "layer i: offload: cannot allocate ...: <message>"
        monkeypatch.undo()
    assert fired >= 1  # static mirrors are allocated once, so few calls can fail
