"""The compiled static cache's buffers, as CUDA graphs need them, and its eager updates, without a sync.

- every preallocated buffer (K/V or packed rows and the residual ring, position, overflow) is marked
  static for dynamo (``torch._dynamo.mark_static_address``: the ``_dynamo_static_input_type``
  attribute), so a ``reduce-overhead`` compile can capture CUDA graphs over them;
- an eager update (the prefill, a manual loop) reads nothing back from the device: no
  ``int()`` / ``bool()`` / ``.item()`` / ``.tolist()`` of a tensor (on CUDA: ``set_sync_debug_mode``);
  after compiled steps the count is read once, at the next eager use.
"""

from __future__ import annotations

import pytest
import torch

from builders import build
from tiercache import CacheError
from tiercache.cache.compileable import CompileableCache

POLICIES = {
    "fp": {"storage": "static", "max_length": 96},
    "int4": {"storage": "static", "max_length": 96, "quantize": {"bits": 4, "group_size": 16, "residual_length": 32}},
}


def _cache(name, device="cpu"):
    return CompileableCache.from_policy({"name": name, **POLICIES[name]}, build("llama").config)


def _buffers(layer):
    if hasattr(layer, "krows"):
        return [layer.krows, layer.vrows, layer.rk, layer.rv, layer.position, layer.overflow]
    return [layer.k, layer.v, layer.position]


def _pair(t, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 16, generator=g).to(device), torch.randn(1, 2, t, 16, generator=g).to(device)


class HostReads:
    """Counts reads of a tensor's value into Python (each one a device -> host sync on CUDA)."""

    NAMES = ("__int__", "__bool__", "__index__", "__float__", "item", "tolist")

    def __init__(self, monkeypatch):
        self.calls = []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def read(t, *a, _real=real, _name=name, **k):
                self.calls.append(_name)
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, read)


@pytest.mark.parametrize("name", POLICIES)
def test_preallocated_buffers_are_marked_static_for_dynamo(name):
    cache = _cache(name)
    for i in range(len(cache.layers)):
        cache.update(*_pair(40, seed=i), i)
    for layer in cache.layers:
        bufs = _buffers(layer)
        assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in bufs), name
    cache.batch_repeat_interleave(2)  # new buffers: marked too
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in _buffers(cache.layers[0]))


@pytest.mark.parametrize("name", POLICIES)
def test_an_eager_update_reads_nothing_back_from_the_device(name, monkeypatch):
    cache = _cache(name)
    n = len(cache.layers)
    for i in range(n):  # the first update allocates (and reads its shapes); not counted
        cache.update(*_pair(1, seed=i), i)
    reads = HostReads(monkeypatch)
    for step, t in enumerate((37, 1, 1, 5, 1)):  # a prefill, decode steps, a short chunk
        for i in range(n):
            cache.update(*_pair(t, seed=10 * step + i), i)
    assert reads.calls == [], reads.calls
    monkeypatch.undo()
    assert cache.get_seq_length() == 1 + 37 + 1 + 1 + 5 + 1


@pytest.mark.parametrize("name", POLICIES)
def test_the_host_count_follows_crop_reset_and_refusals(name):
    cache = _cache(name)
    cache.update(*_pair(40), 0)
    cache.crop(-2)
    assert cache.get_seq_length() == 38
    with pytest.raises(CacheError, match="max_length=96"):
        cache.update(*_pair(59), 0)
    assert cache.get_seq_length() == 38
    cache.update(*_pair(3), 0)
    assert cache.get_seq_length() == 41 and cache.layers[0].position.item() == 41
    cache.reset()
    assert cache.get_seq_length() == 0
    cache.update(*_pair(5), 0)
    assert cache.get_seq_length() == 5 and cache.layers[0].position.item() == 5


@pytest.mark.cuda
@pytest.mark.parametrize("name", POLICIES)
def test_an_eager_update_on_cuda_does_not_sync(name):
    model = build("llama").to("cuda")
    cache = CompileableCache.from_policy({"name": name, **POLICIES[name]}, model.config)
    n = len(cache.layers)
    for i in range(n):
        cache.update(*_pair(1, "cuda", seed=i), i)
    # the inputs are copied to the GPU before the check: a copy from pageable host memory syncs
    steps = [[_pair(t, "cuda", seed=10 * step + i) for i in range(n)] for step, t in enumerate((37, 1, 1))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for pairs in steps:
            for i, pair in enumerate(pairs):
                cache.update(*pair, i)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert cache.get_seq_length() == 40
