"""The simulated device's old import paths (``tiercache.offload.simdevice`` / ``simmemory``) still
work: the same objects as ``tiercache.simdevice``, with a ``DeprecationWarning`` naming the new path."""

import importlib
import sys

import pytest

import tiercache.simdevice.device as device
import tiercache.simdevice.memory as memory


@pytest.mark.parametrize("old, new, names", [
    ("tiercache.offload.simdevice", device, ["simulated", "Sim", "_Mode", "HOST_FACTORIES"]),
    ("tiercache.offload.simmemory", memory, ["SimDevice", "SimStream", "SimEvent", "poison_", "ALIGN"]),
], ids=["simdevice", "simmemory"])
def test_the_old_path_warns_and_gives_the_same_objects(old, new, names, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: import {new.__name__.rsplit('.', 1)[0]}"):
        module = importlib.import_module(old)
    assert all(getattr(module, name) is getattr(new, name) for name in names)
    with pytest.raises(AttributeError):
        module.not_a_name
    from tiercache.simdevice import simulated
    assert simulated is device.simulated
