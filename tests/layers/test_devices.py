"""Devices are stored and compared in one canonical form (``runtime.canonical_device``).

``torch.device("cuda")`` names the current CUDA device, and a tensor made there reports it with
its index (``cuda:0``); ``cpu:0`` is ``cpu``. A layer loaded with ``device="cuda"`` (or
``"cpu:0"``) must take the next update's tensors, which report the indexed form.
"""

from __future__ import annotations

import pytest
import torch

import builders as models
from lifecycle.policies import filled, next_logits, policy
from tiercache import CacheError, TieredCache
from tiercache import runtime
from tiercache.layers import validate
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import spec_from
from tiercache.layers.tiers import place_of
from tiercache.runtime import canonical_device


@pytest.fixture
def cuda_index_2(monkeypatch):
    """The CUDA runtime says the current device is 2 (no GPU needed: nothing is allocated)."""
    monkeypatch.setattr(runtime.CudaRuntime, "current_device", lambda self: 2)


def test_canonical_device_gives_cuda_its_current_index_and_cpu_none(cuda_index_2):
    assert canonical_device("cuda") == torch.device("cuda", 2)
    assert canonical_device(torch.device("cuda")) == torch.device("cuda", 2)
    assert canonical_device("cuda:1") == torch.device("cuda", 1)
    assert canonical_device("cpu") == canonical_device("cpu:0") == canonical_device(torch.device("cpu", 3))
    assert str(canonical_device("cpu:0")) == "cpu"
    assert place_of("cuda") == "cuda:2" and place_of("cpu:0") == "cpu"
    assert runtime.device_key("cuda")[0] == runtime.device_key("cuda:2")[0]


def test_canonical_device_without_cuda_leaves_cuda_as_named(monkeypatch):
    def none(self):
        raise AssertionError("Torch not compiled with CUDA enabled")

    monkeypatch.setattr(runtime.CudaRuntime, "current_device", none)
    assert canonical_device("cuda") == torch.device("cuda")


def test_a_spec_loaded_from_a_state_is_canonical(cuda_index_2):
    state = {"batch": 1, "heads": 2, "key_dim": 4, "value_dim": 4, "dtype": "float32", "device": "cuda"}
    assert spec_from(state).device == torch.device("cuda", 2)
    assert spec_from({**state, "device": "cpu:0"}).device == torch.device("cpu")


class _Held:
    """A layer that holds ``spec`` (what ``check_update`` reads of a layer)."""

    is_sliding = False

    def __init__(self, spec):
        self.spec = spec

    def layout(self):
        return self.spec

    def max_length(self):
        return 0

    def seq_length(self):
        return 0


def _pair():
    return torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4)


def test_validate_takes_tensors_on_cuda_0_for_a_layer_held_on_cuda(cuda_index_2, monkeypatch):
    k, v = _pair()
    # the tensors of the update report cuda:2 (a CUDA tensor always carries its index)
    monkeypatch.setattr(validate.KVSpec, "read", classmethod(
        lambda cls, key, value: KVSpec(1, 2, 4, 4, torch.float32, torch.device("cuda", 2))))
    validate.check_update(_Held(KVSpec(1, 2, 4, 4, torch.float32, torch.device("cuda"))), k, v)
    with pytest.raises(CacheError, match="device: the layer holds cuda:1, the update has cuda:2"):
        validate.check_update(_Held(KVSpec(1, 2, 4, 4, torch.float32, torch.device("cuda", 1))), k, v)


def test_validate_takes_cpu_tensors_for_a_layer_held_on_cpu_0():
    k, v = _pair()
    validate.check_update(_Held(KVSpec(1, 2, 4, 4, torch.float32, torch.device("cpu", 0))), k, v)


@pytest.mark.parametrize("name", ["fp", "int4", "host", "int4-host", "static"])
def test_a_cache_loaded_onto_an_indexed_name_of_its_device_takes_the_next_update(name, tmp_path):
    model = models.build("llama")
    ids, nxt = models.prompt(1, 29), models.prompt(1, 2, seed=3)
    cache = filled(model, policy(name), ids)
    cache.save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", model.config, device="cpu:0")
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
    assert set(loaded.nbytes()) <= {"cpu"}


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["fp", "int4", "host", "static"])
def test_save_then_load_onto_cuda_then_update(name, tmp_path):
    model = models.build("llama").to("cuda")
    ids, nxt = models.prompt(1, 29).to("cuda"), models.prompt(1, 2, seed=3).to("cuda")
    cache = filled(model, policy(name), ids)
    cache.save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", model.config, device="cuda")
    torch.testing.assert_close(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
    assert f"cuda:{torch.cuda.current_device()}" in loaded.nbytes()
