"""Fixtures and drivers for the simulated-device tests (``tiercache.simdevice``).

``sim`` / ``sim2``: one / two simulated devices for the test; a test fails if the simulator saw a
hazard (a race a missing wait, ``record_stream`` or sync would be on CUDA). ``decode`` drives
caches like a model: each layer updates on its device, then attention-like work reads what it
returned (compared with a resident reference)."""

from __future__ import annotations

import pytest
import torch

from tiercache.simdevice import simulated


def _fixture(devices: int):
    with simulated(devices=devices) as sim:
        yield sim
        assert not sim.hazards, "\n".join(sim.hazards[:5])


@pytest.fixture
def sim():
    yield from _fixture(1)


@pytest.fixture
def sim2():
    yield from _fixture(2)


def device_of_layer(sim, layer: int, layers: int) -> int:
    """Layers split over the devices in order (a model split over GPUs)."""
    return layer * len(sim.devices) // layers


def kv(sim, dev: int, shape, g):
    """A key and a value made on simulated device ``dev`` (as the model's projections would)."""
    with sim.device(dev):
        return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
