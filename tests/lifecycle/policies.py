"""Cache policies covering every storage / processor kind (ids readable), a feeder, and a model's
prefill (``filled``) and next logits (``next_logits``) through a cache."""

from __future__ import annotations

import torch
from tiercache.cache.compat import cache_arg

Q = {"bits": 4, "group_size": 4, "residual_length": 6}
POLICIES = {
    "fp": {},
    "static": {"storage": "static", "max_length": 96},
    "host": {"offload": {"device": "cpu"}},
    "disk": {"offload": {"device": "disk"}},
    "int4": {"quantize": Q},
    "int2-token": {"quantize": {**Q, "bits": 2, "key_axis": "token"}},
    "int2-sinks-clip": {"quantize": {**Q, "bits": 2, "sink_tokens": 3, "clip": "mse"}},
    "int2-sinks-clip-values": {"quantize": {**Q, "bits": 2, "sink_tokens": 3, "clip": "mse-values"}},
    "int2-keys4-layer0": {"quantize": {**Q, "bits": 2, "sink_tokens": 2}, "overrides": [
        {"layers": [0], "quantize": {"key_bits": 4}}]},
    "int2-meta8-keys4": {"quantize": {**Q, "bits": 2, "sink_tokens": 2, "meta_bits": 8}, "overrides": [
        {"layers": [0], "quantize": {"key_bits": 4}}]},
    "hqq": {"quantize": {**Q, "backend": "hqq"}},
    "int4-host": {"quantize": Q, "offload": {"device": "cpu"}},
    "int4-disk": {"quantize": Q, "offload": {"device": "disk"}},
    "static-int4": {"storage": "static", "max_length": 96, "quantize": Q},
    "mixed": {"quantize": Q, "offload": {"device": "cpu"}, "overrides": [
        {"layers": [0], "quantize": None},
        {"layer_type": "sliding_attention", "offload": {"device": "cpu"}}]},
}


def policy(name: str, tmp_path=None) -> dict:
    p = {"name": name, **POLICIES[name]}
    if tmp_path is not None and p.get("offload", {}).get("device") == "disk":
        p["offload"] = {**p["offload"], "path": str(tmp_path)}
    if name == "mixed":  # the sliding override only exists on models with sliding layers
        p = {**p, "overrides": p["overrides"][:1]}
    return p


def feed(cache, steps, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for t in steps:
        for i in range(len(cache.layers)):
            h, dk, dv = cache.model.kv_shape(i)
            cache.update(torch.randn(1, h, t, dk, generator=g), torch.randn(1, h, t, dv, generator=g), i)


def filled(model, pol, ids):
    """A cache of ``pol`` (a name of POLICIES, or what ``from_policy`` takes) that prefilled ``ids``."""
    from tiercache import TieredCache

    cache = TieredCache.from_policy(policy(pol) if isinstance(pol, str) else pol, model.config)
    with torch.no_grad():
        model(ids, **cache_arg(cache))
    return cache


def next_logits(model, cache, ids):
    with torch.no_grad():
        return model(ids, **cache_arg(cache)).logits
