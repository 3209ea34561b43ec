"""FiniteGuard: the immediate CPU refusal, and the deferred (CUDA) flags' bookkeeping, driven here
with landed / in-flight events stood in by objects with ``query()`` (the CUDA path itself is in
test_sync_cuda.py)."""

import pytest
import torch

from tiercache.errors import CacheError
from tiercache.quantize.finite import FiniteGuard


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
