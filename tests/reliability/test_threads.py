"""Two caches used from two threads at once give exactly what each gives alone.

Each cache owns its buffers, its disk files (a directory per layer tier) and its prefetcher
(device slots, side stream), so nothing is shared between caches but read-only module state.
Torch releases the GIL inside its kernels, so the two threads' tensor work really interleaves.

One cache is *not* meant to be shared by threads: its layers and its prefetcher hold mutable
state (write positions, the mirror in use) and its results are views valid until the next call
on that cache. A program that must share one cache serializes every call on it (a lock).
"""

from __future__ import annotations

import tempfile
import threading

import pytest
import torch

from kvmodel import Chain, tokens

# Pairs of policies run side by side (offload host and disk, quantized and not).
PAIRS = [
    pytest.param(Chain("full", "int4-g4-r4", "host-p1"), Chain("full", "fp", "disk-p1", window=3), id="int4-host+fp-disk"),
    pytest.param(Chain("static", "int2-g2-r0-tok", "host-p2"), Chain("full", "int8-g4-r3-swap", "disk-p1"), id="int2-static-host+int8-disk"),
    pytest.param(Chain("full", "fp", "host-p0"), Chain("full", "fp", "host-p1"), id="fp-host+fp-host"),
    pytest.param(Chain("full", "int4-g8-r5", "resident"), Chain("full", "int4-g8-r5", "resident"), id="same-policy-twice"),
]
STEPS = [23, *[1] * 30, 5, *[1] * 20]  # a prefill, then decode steps
B = 2


def drive(chain: Chain, path: str, seed: int, start: threading.Barrier | None = None) -> list[torch.Tensor]:
    """A model-like run: every layer per step, a crop and a beam reorder midway; every output kept."""
    cache = chain.build(path)
    outs = []
    if start is not None:
        start.wait()
    try:
        for step, t in enumerate(STEPS):
            if t + cache.get_seq_length() > 40 and chain.storage == "static":
                break
            for i in range(len(cache.layers)):
                k, v = tokens(B, t, chain.dtype, seed * 1000 + step * 10 + i)
                outs.extend(x.clone() for x in cache.update(k, v, i))
            if step == 20:
                cache.activate_past_recording()
            if step == 22:
                cache.crop(-2)
                cache.reorder_cache(torch.tensor([1, 0]))
        outs.append(torch.tensor(cache.get_seq_length()))
    finally:
        cache.close()
    return outs


@pytest.mark.parametrize("a,b", PAIRS)
def test_two_caches_two_threads_match_each_alone(a: Chain, b: Chain):
    with tempfile.TemporaryDirectory() as pa, tempfile.TemporaryDirectory() as pb:
        alone = [drive(a, pa, 1), drive(b, pb, 2)]
        for _ in range(3):  # a few rounds: the interleaving differs each time
            together(a, b, pa, pb, alone)


def together(a: Chain, b: Chain, pa: str, pb: str, alone) -> None:
    start, results, errors = threading.Barrier(2), [None, None], []

    def run(n, chain, path, seed):
        try:
            results[n] = drive(chain, path, seed, start)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(0, a, pa, 1)), threading.Thread(target=run, args=(1, b, pb, 2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    for got, want in zip(results, alone):
        assert len(got) == len(want)
        assert all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(got, want))


def test_caches_share_no_files_workspaces_or_prefetcher():
    a, b = Chain("full", "int4-g4-r4", "disk-p1"), Chain("full", "int4-g4-r4", "disk-p1")
    with tempfile.TemporaryDirectory() as path:
        ca, cb = a.build(path), b.build(path)  # the same policy, the same root directory
        for cache in (ca, cb):
            for i in range(3):
                cache.update(*tokens(B, 9, torch.float32, i), i)
        mine, theirs = ({t.data_ptr() for t in c.shared_buffers()} for c in (ca, cb))  # workspaces, prefetch slots
        assert mine and theirs and not mine & theirs
        from test_faults import disk_tiers

        ta, tb = disk_tiers(ca), disk_tiers(cb)
        assert ta and tb and not {t.dir for t in ta} & {t.dir for t in tb}
        assert not {p for t in ta for p in t.paths()} & {p for t in tb for p in t.paths()}
        oa, ob = ca.update(*tokens(B, 1, torch.float32, 7), 0), cb.update(*tokens(B, 1, torch.float32, 7), 0)
        assert oa[0].untyped_storage().data_ptr() != ob[0].untyped_storage().data_ptr()  # dequantization workspaces
        ca.close()
        cb.close()
