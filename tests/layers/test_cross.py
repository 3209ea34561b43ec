"""``CrossAttention``: the read-back attributes ``keys`` / ``values`` over every chain the
cross-attention section can build, against a plain full-precision layer fed the same tokens.

Resident and offloaded chains give the reference's K/V bit for bit (layers read in model order,
so offloaded ones share prefetch slots); quantized ones within the int8 / int4 error; batch
operations act on what is read back; everything else is the wrapped chain's.
"""

import pytest
import torch

from tiercache.cache.chain import Shared, build_layer, make_storage
from tiercache.planner.cross_attention import cross_layer_policies
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import Policy
from tiercache.layers.cross import CrossAttention

SPEC = ModelSpec("enc-dec", 3, ("full_attention",) * 3, kv_heads=2, head_dim=8, cross_attention=True)
Q = {"group_size": 8, "residual_length": 0}
SECTIONS = {  # name: (cross_attention section, bound on relative error; 0 means bit-exact)
    "fp": ({}, 0),
    "host": ({"offload": {"device": "cpu", "prefetch": 1}}, 0),
    "disk": ({"offload": {"device": "disk"}}, 0),
    "int8": ({"quantize": {**Q, "bits": 8}}, 0.01),
    "int4-host": ({"quantize": {**Q, "bits": 4}, "offload": {"device": "cpu"}}, 0.12),
}


def chains(section):
    shared = Shared()
    lps = cross_layer_policies(Policy.from_dict({"cross_attention": section}), SPEC)
    return [build_layer(lp, shared) for lp in lps]


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("name", list(SECTIONS))
def test_read_back_equals_a_full_precision_layer(name):
    section, bound = SECTIONS[name]
    layers, refs = chains(section), [make_storage() for _ in range(3)]
    g = torch.Generator().manual_seed(0)
    for layer, ref in zip(layers, refs):
        assert isinstance(layer, CrossAttention) and layer.keys is None and layer.values is None
        k, v = torch.randn(2, 2, 40, 8, generator=g), torch.randn(2, 2, 40, 8, generator=g)  # [B, H, S_enc, D]
        out, want = layer.update(k, v), ref.update(k, v)
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])  # the write step: exact
    for step in range(3):  # decode steps: the model reads every layer back, in order
        for layer, ref in zip(layers, refs):
            (rk, rv), k, v = ref.kv(), layer.keys, layer.values  # [B, H, 40, D]
            assert k.shape == rk.shape and v.shape == rv.shape and layer.seq_length() == 40
            if bound == 0:
                assert torch.equal(k, rk) and torch.equal(v, rv)
            else:
                assert 0 < rel(k, rk) < bound and 0 < rel(v, rv) < bound
    beams = torch.tensor([1, 0])
    for layer, ref in zip(layers, refs):  # beam reorder / batch select reach the read-back
        layer.reorder(beams), ref.reorder(beams)
        layer.select(torch.tensor([1])), ref.select(torch.tensor([1]))
        assert layer.keys.shape[0] == 1 and rel(layer.values, ref.kv()[1]) <= bound
        assert layer.nbytes() == layer.inner.nbytes()
        layer.reset()
        assert layer.keys is None and layer.seq_length() == 0
        layer.close()


def test_cross_layers_ignore_self_attention_storage_and_overrides():
    policy = Policy.from_dict({"storage": "static", "max_length": 16, "quantize": {"bits": 4},
                               "overrides": [{"layers": [0], "offload": {"device": "cpu"}}]})
    lps = cross_layer_policies(policy, SPEC)
    assert [(lp.layer_type, lp.storage, lp.quantize, lp.offload) for lp in lps] == \
        [("cross_attention", "full", None, None)] * 3  # default: full precision, on the compute device


def test_cross_attention_section_round_trips_and_validates(tmp_path):
    from tiercache.cli import main

    data = {"name": "x", "cross_attention": {"quantize": {"bits": 8}, "offload": {"device": "cpu"}}}
    policy = Policy.from_dict(data)
    assert Policy.from_dict(policy.to_dict()) == policy and policy.cross_attention.quantize.bits == 8
    path = tmp_path / "p.yaml"
    path.write_text("cross_attention:\n  quantize: {bits: 5}\n")
    assert main(["validate", str(path)]) == 1


@pytest.mark.parametrize("name,reads", [("int8", 1), ("int4-host", 1), ("fp", 2), ("host", 2)])
def test_a_quantized_layer_is_dequantized_once_per_keys_values_read(name, reads, monkeypatch):
    """Fresh (dequantized) tensors serve the values read after keys; views are read again."""
    layer = chains(SECTIONS[name][0])[0]
    k = torch.randn(1, 2, 24, 8)
    layer.update(k, -k)
    calls = []
    inner_kv = layer.inner.kv
    monkeypatch.setattr(layer.inner, "kv", lambda fetch=False: calls.append(1) or inner_kv(fetch))
    keys, values = layer.keys, layer.values
    want = inner_kv()
    assert len(calls) == reads and torch.equal(keys, want[0]) and torch.equal(values, want[1])
    layer.keys  # noqa: B018 - a keys read, then a change: values must show the change
    layer.select(torch.tensor([0]))
    layer.reorder(torch.tensor([0]))
    layer.crop(4)
    assert layer.values.shape[2] == 20 and layer.keys.shape[2] == 20
