"""Simulated decode of every offloaded policy in ``configs/`` on one and two simulated devices: the
offload chain runs its CUDA path (side streams, events, deferred write-backs, the deferred
non-finite check) on the simulator, with no hazard, no host wait in steady decoding, and every
step's K/V equal to the same policy without offload (the resident cache)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import yaml

import tiercache
from tiercache.models.spec import ModelSpec
from tests.offload.simdev import device_of_layer, kv, sim, sim2  # noqa: F401 (fixtures)

CONFIGS = sorted(p for p in (Path(__file__).parents[2] / "configs").glob("*.yaml")
                 if (yaml.safe_load(p.read_text()) or {}).get("offload") and not yaml.safe_load(p.read_text()).get("auto"))
SPEC = ModelSpec("sim", 5, ("full_attention",) * 4 + ("sliding_attention",), kv_heads=2, head_dim=8,
                 sliding_window=16, dtype="float32")
PREFILL, STEPS, WARM = 190, 70, 3


STATIC = {"name": "static-offload", "storage": "static", "max_length": 512,
          "offload": {"device": "cpu", "prefetch": 1}}


def policies(path):
    raw = dict(STATIC) if path == "static" else yaml.safe_load(path.read_text())
    raw.pop("budget", None)
    raw["offload"] = dict(raw["offload"])
    if raw["offload"].get("device") == "disk":
        raw["offload"]["path"] = None
    resident = {**raw, "name": raw["name"] + "-resident", "offload": None,
                "overrides": [{k: v for k, v in o.items() if k != "offload"} for o in raw.get("overrides", [])]}
    return raw, resident


def spec_for_policy(policy: dict) -> ModelSpec:
    """``SPEC``, with more full-attention layers when the policy's overrides name layers beyond it
    (a policy written for a 32-layer model names indices up to 31)."""
    named = max((i + 1 if i >= 0 else -i for o in policy.get("overrides") or () for i in (o.get("layers") or ())),
                default=0)
    if named <= SPEC.num_layers:
        return SPEC
    n = named + 4
    return dataclasses.replace(SPEC, num_layers=n, layer_types=("full_attention",) * (n - 1) + ("sliding_attention",))


def decode(sim, path: Path):
    policy, resident = policies(path)
    spec = spec_for_policy(policy)
    off = tiercache.TieredCache.from_policy(policy, spec)
    ref = tiercache.TieredCache.from_policy(resident, spec)
    g = torch.Generator().manual_seed(0)
    waits = None
    for step in range(STEPS + 1):
        t = PREFILL if step == 0 else 1
        if step == WARM:
            waits = off.offload_stats()["host_waits"]
        for i in range(spec.num_layers):
            dev = device_of_layer(sim, i, spec.num_layers)
            k, v = kv(sim, dev, (1, 2, t, 8), g)
            with sim.device(dev):  # (what a "cpu" factory means here: see simdevice's docstring)
                a, b = off.update(k, v, i), ref.update(k, v, i)
                # read on the layer's device, as its attention does: a quantized layer's decode step
                # returns PackedKV, dequantized on first use into that device's workspace
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (path, step, i)
    stats = off.offload_stats()
    assert stats["side_fetches"] > 0 and stats["bytes_d2h"] > 0
    assert stats["host_waits"] - waits == 0, stats  # steady decoding never blocks on a write-back
    for i in range(spec.num_layers):  # every token reached the host copy
        with sim.device(device_of_layer(sim, i, spec.num_layers)):
            a, b = off.layers[i].kv(fetch=True), ref.layers[i].kv()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert off.get_seq_length() == PREFILL + STEPS
    off.close()
    ref.close()


def test_configs_found():
    assert {p.stem for p in CONFIGS} >= {"offload-cpu", "tiered-int4-offload", "gpu-8gb", "disk"}


# and static storage offloaded (no config uses it); a config that needs a widened model decodes 3x the layers: slow
POLICIES = [pytest.param(p, marks=pytest.mark.slow) if isinstance(p, Path)
            and spec_for_policy(yaml.safe_load(p.read_text())) is not SPEC else p for p in [*CONFIGS, "static"]]
IDS = [p if isinstance(p, str) else (p.values[0] if hasattr(p, "values") else p).stem for p in POLICIES]


@pytest.mark.parametrize("path", POLICIES, ids=IDS)
def test_decode_one_device(sim, path):  # noqa: F811
    decode(sim, path)


@pytest.mark.parametrize("path", POLICIES, ids=IDS)
def test_decode_two_devices(sim2, path):  # noqa: F811
    decode(sim2, path)
