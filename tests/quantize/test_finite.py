"""FiniteGuard: the immediate CPU refusal, and the deferred (CUDA) flags' bookkeeping, driven here
with landed / in-flight events stood in by objects with ``query()`` (the CUDA path itself is in
test_sync_cuda.py)."""

import types

import pytest
import torch

from tiercache import runtime
from tiercache.errors import CacheError
from tiercache.quantize.finite import SLOTS, FiniteGuard


class Landed:
    def __init__(self, done: bool = True):
        self.done = done

    def query(self) -> bool:
        return self.done


def test_cpu_refuses_at_once_and_stays_usable():
    g = FiniteGuard()
    ok = torch.randn(1, 2, 3, 4)
    g.check(ok, ok, 0, lambda: "never")
    bad = ok.clone()
    bad[0, 1, 2, 3] = float("inf")
    with pytest.raises(CacheError, match="where"):
        g.check(bad, ok, 3, lambda: "where")
    g.check(ok, ok, 3, lambda: "never")  # nothing was stored: no poisoning on the CPU
    assert g.pending() == 0


def test_deferred_flag_surfaces_once_landed_then_poisons_until_cropped_back():
    g = FiniteGuard()
    g.flags = [(10, 1, torch.tensor(False), Landed()), (11, 2, torch.tensor(True), Landed(False))]
    g.surface()  # the bad flag has not landed: nothing to say yet, no wait
    assert g.pending() == 1
    g.flags[0][3].done = True
    with pytest.raises(CacheError, match="positions 11..12"):
        g.surface()
    with pytest.raises(CacheError, match="crop\\(\\) it back to 11"):
        g.surface()
    g.crop_to(12)  # not back far enough
    with pytest.raises(CacheError):
        g.surface()
    g.crop_to(11)
    g.surface()
    g.flags = [(20, 1, torch.tensor(True), Landed())]
    g.reset()
    g.surface()


class Deferred:
    """A runtime with streams (as CUDA's): the guard defers its flags; events land at once;
    counts the pinned allocations the guard asks for."""

    def __init__(self):
        self.pinned = 0

    def device_of(self, t):
        return t.device

    def pinned_empty(self, shape, dtype):
        self.pinned += 1
        return torch.empty(shape, dtype=dtype)

    def event(self):
        return types.SimpleNamespace(record=lambda stream: None, query=lambda: True, synchronize=lambda: None)

    def current_stream(self, home):
        return None


def test_deferred_checks_reuse_their_pinned_slots_and_still_catch_a_nan():
    """The deferred check copies ``max |x|`` into a slot of the guard's own (no pinned allocation,
    no ``isfinite`` per update) and a landed non-finite value still surfaces with its positions."""
    rt, g = Deferred(), FiniteGuard()
    ok = torch.randn(1, 2, 1, 4, dtype=torch.bfloat16)
    with runtime.installed(rt):
        for step in range(3 * SLOTS):
            g.check(ok, ok, step, lambda: "never")
        assert rt.pinned == 1 and g.pending() == 1  # one allocation of SLOTS slots; read flags free theirs
        bad = ok.clone()
        bad[0, 1, 0, 2] = float("nan")
        g.check(bad, ok, 500, lambda: "never")  # stored, flagged on the device
        with pytest.raises(CacheError, match="positions 500..500"):
            g.surface()
        g.crop_to(500)
        g.check(ok, ok, 500, lambda: "never")
        g.surface()
    assert rt.pinned == 1
