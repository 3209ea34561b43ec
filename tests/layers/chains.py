"""Every chain kind the chain builder makes, as a grid with readable ids (shared by lifecycle tests).

``CHAINS`` maps an id to a ``LayerPolicy`` factory taking a tmp path (for disk); ``build(lp)``
returns the chain with a fresh ``Shared``. ``feed(layer, steps)`` updates a chain with random
K/V, one update per entry of ``steps`` (token counts), and returns the pairs fed.
"""

from __future__ import annotations

import dataclasses

import torch

from tiercache.cache.chain import Shared, build_layer
from tiercache.policy.schema import LayerPolicy, OffloadPolicy, QuantizePolicy

Q4 = QuantizePolicy(bits=4, group_size=4, residual_length=6)
Q2T = QuantizePolicy(bits=2, group_size=4, residual_length=4, key_axis="token")
HOST, DISK = OffloadPolicy(device="cpu"), OffloadPolicy(device="disk")


def lp(storage="full", window=None, max_length=None, quantize=None, offload=None):
    return LayerPolicy(0, "sliding_attention" if window else "full_attention", storage, window, max_length,
                       quantize, offload)


CHAINS = {
    "full": lambda p: lp(),
    "sliding": lambda p: lp("sliding", window=7),
    "static": lambda p: lp("static", max_length=64),
    "host": lambda p: lp(offload=HOST),
    "disk": lambda p: lp(offload=OffloadPolicy(device="disk", path=str(p))),
    "sliding-host": lambda p: lp("sliding", window=7, offload=HOST),
    "static-host": lambda p: lp("static", max_length=64, offload=HOST),
    "int4": lambda p: lp(quantize=Q4),
    "int2-token": lambda p: lp(quantize=Q2T),
    "int4-sliding": lambda p: lp("sliding", window=7, quantize=Q4),
    "int4-static": lambda p: lp("static", max_length=64, quantize=Q4),
    "int4-host": lambda p: lp(quantize=Q4, offload=HOST),
    "int4-disk": lambda p: lp(quantize=Q4, offload=OffloadPolicy(device="disk", path=str(p))),
    "int4-sliding-host": lambda p: lp("sliding", window=7, quantize=Q4, offload=HOST),
    "int2-sinks-clip": lambda p: lp(quantize=dataclasses.replace(Q2T, sink_tokens=3, clip="mse")),
    "int2-keys4-host": lambda p: lp(quantize=dataclasses.replace(Q4, bits=2, key_bits=4), offload=HOST),
}


def build(policy: LayerPolicy):
    return build_layer(policy, Shared())


def kv(t: int, batch: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, t, 8, generator=g), torch.randn(batch, 2, t, 6, generator=g)


def feed(layer, steps, seed: int = 0):
    fed = []
    for i, t in enumerate(steps):
        k, v = kv(t, seed=seed * 1000 + i)
        layer.update(k, v)
        fed.append((k, v))
    return fed
