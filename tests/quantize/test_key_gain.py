"""``key_gain``: attention reads the packed keys times the gain, and nothing else changes.

Against the same layer without a gain (the reference), with a gain of 2 (a power of two: the
scaled codes and metadata are exact, so every comparison is bit for bit): the packed keys are
twice the reference's, the sinks, the residual and every value are identical; a crop's
residual, an export and a retier hand the tokens back as given (no gain, none applied twice);
save / load keeps the gain; the planner counts the same bytes; bad gains are refused.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig

from tiercache import TieredCache
from tiercache.cache.chain import Shared
from tiercache.errors import PolicyError
from tiercache.planner.api import plan
from tiercache.policy.schema import QuantizePolicy, load_policy
from tests.quantize.quantized import quantized

B, H, D = 2, 3, 16
G, R = 16, 32
GAIN = 2.0  # a power of two: gained codes and metadata are exact
FORMS = {  # the native backend's range rules: min/max, the clipping search, byte metadata, fp8's absmax
    "int2": dict(bits=2),
    "int4-clip": dict(bits=4, clip="mse"),
    "int2-meta8": dict(bits=2, meta_bits=8),
    "K4V2-sinks": dict(bits=2, key_bits=4, sink_tokens=4),
    "fp8": dict(bits=8, format="fp8"),
}


def kv(t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, H, t, D, generator=g), torch.randn(B, H, t, D, generator=g)  # [B, H, t, D]


def pair(form):
    q = QuantizePolicy(group_size=G, residual_length=R, **FORMS[form])
    return quantized(dataclasses.replace(q, key_gain=GAIN), Shared()), quantized(q, Shared())


def packed(layer) -> slice:
    """The token positions of ``layer.kv()`` that are packed blocks (after the sinks, before the residual)."""
    return slice(len(layer.sinks), layer.seq_length() - len(layer.residual))


def check(gained, plain):
    (kg, vg), (kp, vp) = gained.kv(), plain.kv()  # [B, H, S, D]
    p = packed(gained)
    assert p == packed(plain) and p.stop > p.start, "the case must pack something"
    assert torch.equal(vg, vp)
    assert torch.equal(kg[:, :, p], GAIN * kp[:, :, p])
    assert torch.equal(kg[:, :, : p.start], kp[:, :, : p.start]) and torch.equal(kg[:, :, p.stop :], kp[:, :, p.stop :])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("steps", [[100, 1, 1, 1, 40], [1] * 70, [5, 64, 3]], ids=["prefill", "steps", "mixed"])
def test_packed_keys_are_gained_and_nothing_else_changes(form, steps):
    gained, plain = pair(form)
    for i, t in enumerate(steps):
        k, v = kv(t, i)
        (og, ovg), (op, ovp) = gained.update(k, v), plain.update(k, v)
        assert torch.equal(ovg, ovp)
        for s in range(og.shape[2]):  # each token as given or gained, never anything else
            assert torch.equal(og[:, :, s], op[:, :, s]) or torch.equal(og[:, :, s], GAIN * op[:, :, s])
    check(gained, plain)
    assert gained.nbytes() == plain.nbytes()
    assert gained.config.key_gain == GAIN and plain.config.key_gain == 1.0


@pytest.mark.parametrize("form", ["int2", "int2-meta8", "K4V2-sinks"])
@pytest.mark.parametrize("cut", [5, 20, 50])
def test_a_crop_hands_the_tokens_back_as_given_and_repacks_them_once(form, cut):
    gained, plain = pair(form)
    k, v = kv(120, 0)
    gained.update(k, v), plain.update(k, v)
    gained.crop(gained.seq_length() - cut), plain.crop(plain.seq_length() - cut)  # into the packed blocks
    (kg, _), (kp, _) = gained.kv(), plain.kv()
    tail = slice(packed(gained).stop, kg.shape[2])
    assert torch.equal(kg[:, :, tail], kp[:, :, tail])  # back in the residual: no gain
    for i in range(4):  # the moved-back tokens leave the residual again: gained once (2x), not twice (4x)
        k, v = kv(G, 10 + i)
        gained.update(k, v), plain.update(k, v)
    check(gained, plain)


@pytest.mark.parametrize("form", ["int2", "int2-meta8", "fp8"])
def test_export_hands_back_the_tokens_as_given(form):
    gained, plain = pair(form)
    k, v = kv(150, 3)
    gained.update(k, v), plain.update(k, v)
    kg, vg, ng = gained.export()
    kp, vp, np_ = plain.export()
    assert ng == np_ == 150 and torch.equal(kg, kp) and torch.equal(vg, vp)


CFG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
INT2 = {"bits": 2, "group_size": G, "residual_length": R, "sink_tokens": 4}


def fed(policy):
    cache = TieredCache.from_policy(policy, CFG)
    for i in range(2):
        k, v = kv(130, 20 + i)
        cache.update(k[:1, :2], v[:1, :2], i)  # [1, 2, 130, 16]
    return cache


def test_retier_and_save_load_keep_the_keys_straight(tmp_path):
    gained = fed({"name": "g", "quantize": {**INT2, "key_gain": 2.0}})
    plain = fed({"name": "p", "quantize": INT2})
    path = tmp_path / "g.safetensors"
    gained.save(path)
    loaded = TieredCache.load(path, CFG)
    for a, b in zip(loaded.layers, gained.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert loaded.layers[0].config.key_gain == 2.0
    ref = [layer.keys for layer in plain.layers]  # [1, 2, 130, 16]: the packed tokens as given
    assert not any(torch.equal(layer.keys, k) for layer, k in zip(gained.layers, ref))
    gained.retier({"name": "fp"})  # to full precision: the tokens as given (quantized once), not gained
    assert all(torch.equal(layer.keys, k) for layer, k in zip(gained.layers, ref))


def test_a_gain_per_layer_through_an_override_gains_that_layer_only():
    gained = fed({"name": "g", "quantize": INT2, "overrides": [{"layers": [1], "quantize": {"key_gain": GAIN}}]})
    plain = fed({"name": "p", "quantize": INT2})
    assert [layer.config.key_gain for layer in gained.layers] == [1.0, GAIN]
    assert torch.equal(gained.layers[0].keys, plain.layers[0].keys)
    kg, kp = gained.layers[1].keys, plain.layers[1].keys  # [1, 2, 130, 16]
    differ = [s for s in range(kg.shape[2]) if not torch.equal(kg[:, :, s], kp[:, :, s])]
    p = slice(4, 4 + len(differ))  # whole blocks after the sinks, before the residual
    assert differ == list(range(p.start, p.stop)) and len(differ) % G == 0 and 0 < p.stop < 130
    assert torch.equal(kg[:, :, p], GAIN * kp[:, :, p])
    assert all(torch.equal(a.values, b.values) for a, b in zip(gained.layers, plain.layers))


def test_the_planner_counts_the_same_bytes_and_names_the_gain():
    a = plan({"name": "g", "quantize": {**INT2, "key_gain": 1.5}}, CFG, context_length=4096)
    b = plan({"name": "p", "quantize": INT2}, CFG, context_length=4096)
    assert a.bytes == b.bytes and [r.bytes for r in a.layers] == [r.bytes for r in b.layers]
    assert all("gain1.5" in r.form for r in a.layers) and not any("gain" in r.form for r in b.layers)


@pytest.mark.parametrize("bad", [0, -1.0, 4.5, math.nan, math.inf, "2", True, None])
def test_bad_gains_are_refused_with_what_is_allowed(bad):
    with pytest.raises(PolicyError) as e:
        load_policy({"name": "x", "quantize": {"bits": 2, "key_gain": bad}})
    assert "key_gain" in str(e.value)


def test_an_integer_gain_is_a_number():
    assert load_policy({"name": "x", "quantize": {"bits": 2, "key_gain": 2}}).quantize.key_gain == 2.0
