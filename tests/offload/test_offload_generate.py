"""generate() gives exactly the same tokens with an offloaded policy as with a resident one."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import tiercache  # noqa: E402
from tests.builders import build, prompt  # noqa: E402
from tiercache.cache.compat import cache_arg

FAMILIES = ["llama", "mistral", "gemma2", "qwen2"]
RESIDENT = {"name": "resident"}
POLICIES = {
    "cpu": {"offload": {"device": "cpu", "prefetch": 1}},
    "cpu-prefetch0": {"offload": {"device": "cpu", "prefetch": 0}},
    "cpu-sliding-too": {"offload": {"device": "cpu", "prefetch": 2},
                        "overrides": [{"layer_type": "sliding_attention", "offload": {"device": "cpu"}}]},
}
MODES = {
    "greedy": dict(batch=2, kwargs=dict(do_sample=False)),
    "beam": dict(batch=2, kwargs=dict(do_sample=False, num_beams=3)),
    "assisted": dict(batch=1, kwargs=dict(do_sample=False), assisted=True),
}

_models: dict = {}


def model(name: str, seed: int = 0):
    if (name, seed) not in _models:
        _models[name, seed] = build(name, seed)
    return _models[name, seed]


def generate(name: str, policy: dict, mode: str, tmp_path=None):
    m, spec = model(name), MODES[mode]
    kwargs = dict(spec["kwargs"], max_new_tokens=10, min_new_tokens=10)
    if spec.get("assisted"):
        kwargs["assistant_model"] = model(name, seed=1)
    cache = tiercache.TieredCache.from_policy(policy, m.config)
    ids = prompt(spec["batch"], 12)
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), **kwargs)
    return out, cache


_resident: dict = {}


def resident(family: str, mode: str):
    if (family, mode) not in _resident:
        _resident[family, mode] = generate(family, RESIDENT, mode)[0]
    return _resident[family, mode]


CASES = [(f, "cpu", m) for f in FAMILIES for m in MODES]
CASES += [(f, "cpu-sliding-too", m) for f in ("mistral", "gemma2") for m in MODES]
CASES += [("qwen2", "cpu-prefetch0", m) for m in ("greedy", "assisted")]


@pytest.mark.parametrize("family,policy,mode", CASES, ids=["-".join(c) for c in CASES])
def test_same_tokens(family, policy, mode):
    got, cache = generate(family, POLICIES[policy], mode)
    assert torch.equal(got, resident(family, mode))
    offloaded = [type(layer).__name__ == "Offload" for layer in cache.layers]
    assert any(offloaded) or family == "mistral"  # mistral: every layer slides, resident by default
    if policy == "cpu-sliding-too":
        assert all(offloaded)
    cache.close()


def test_disk_policy_same_tokens(tmp_path):
    want = resident("gemma2", "beam")
    got, cache = generate("gemma2", {"offload": {"device": "disk", "path": str(tmp_path)}}, "beam")
    assert torch.equal(got, want)
    assert cache.nbytes().get("disk", 0) > 0
    cache.close()
    assert list(tmp_path.iterdir()) == []


def test_cache_nbytes_counts_mirrors_once():
    _, cache = generate("llama", POLICIES["cpu"], "greedy")
    layers = sum(sum(layer.nbytes().values()) for layer in cache.layers)
    mirrors = sum(cache.shared_nbytes().values())
    assert mirrors > 0 and sum(cache.nbytes().values()) == layers + mirrors
    cache.close()


@pytest.mark.parametrize("mode", ["greedy", "assisted"])
def test_quantized_offload_same_tokens_as_quantized(mode):
    """Offload adds no error to a quantized cache: same tokens as the resident quantized one."""
    pytest.importorskip("tiercache.quantize.processor")
    q = {"quantize": {"backend": "native", "bits": 4, "group_size": 8, "residual_length": 4}}
    want, _ = generate("llama", q, mode)
    got, cache = generate("llama", {**q, "offload": {"device": "cpu", "prefetch": 1}}, mode)
    assert torch.equal(got, want)
    assert cache.offload_stats()["bytes_d2h"] > 0
    cache.close()


def test_offload_stats_count_the_bus_traffic():
    """``cache.offload_stats()``: zeros for a resident cache; for an offloaded one, the bytes of
    every update sent to the host and of every fetch, with outputs equal to the resident ones."""
    from tiercache.models.spec import ModelSpec

    spec = ModelSpec("stats", 3, ("full_attention",) * 3, kv_heads=2, head_dim=8, dtype="float32")
    res = tiercache.TieredCache.from_policy(RESIDENT, spec)
    off = tiercache.TieredCache.from_policy({"name": "host", **POLICIES["cpu"]}, spec)
    zeros = {"bytes_h2d": 0, "bytes_d2h": 0, "fetches": 0, "side_fetches": 0, "host_waits": 0, "skipped_fetches": 0}
    assert res.offload_stats() == zeros and off.offload_stats() == zeros
    g, sent = torch.Generator().manual_seed(0), 0
    for t in (10, 1):
        for i in range(3):
            k, v = torch.randn(1, 2, t, 8, generator=g), torch.randn(1, 2, t, 8, generator=g)
            a, b = off.update(k, v, i), res.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            sent += 2 * k.numel() * 4
    per_token = 2 * 8 * 4  # K and V, one head row of 8, float32
    stats = off.offload_stats()
    assert stats["bytes_d2h"] == sent
    # prefetch 1 over 3 layers: layer 0 (10 tokens) while 2 is used, then 1 and 2, then 0 (11);
    # each fetch is one flat span per tensor: head 0's whole row of 256 (capacity) then head 1's held tokens
    assert stats["bytes_h2d"] == sum(256 + s for s in (10, 10, 10, 11)) * per_token
    assert stats["fetches"] == 7 and stats["side_fetches"] == 0 and stats["host_waits"] == 0  # CPU: no stream
    assert res.offload_stats() == zeros
    off.close()
