"""Policy loading: every bad input raises PolicyError naming the field path, value and what is allowed."""

import pytest

from tiercache import PolicyError, Policy, load_policy
from tiercache.models.spec import PRESETS, ModelSpec
from tiercache.policy.schema import UNSET
from tiercache.policy.fields import parse_size

GEMMA = PRESETS["gemma-2-9b"]

BAD = [
    ("unknown-key", {"storage": "full", "colour": 1}, r"policy\.colour: unknown field; allowed: name"),
    ("unknown-nested-key", {"quantize": {"bitz": 4}}, r"policy\.quantize\.bitz: unknown field"),
    ("wrong-type", {"max_length": "long"}, r"policy\.max_length: expected an integer, got 'long'"),
    ("bool-for-int", {"quantize": {"bits": True}}, r"policy\.quantize\.bits: expected an integer"),
    ("bad-literal", {"storage": "paged"}, r"policy\.storage: 'paged' is not allowed; allowed: 'full' \| 'static'"),
    ("negative-size", {"budget": {"device": "-3GiB"}}, r"policy\.budget\.device: expected a size"),
    ("negative-int-size", {"budget": {"host": -5}}, r"policy\.budget\.host: a size must be >= 0"),
    ("bad-unit", {"budget": {"device": "3 parsecs"}}, r"unknown unit 'parsecs'"),
    ("negative-residual", {"quantize": {"residual_length": -1}}, r"policy\.quantize\.residual_length: must be >= 0, got -1"),
    ("zero-group", {"quantize": {"group_size": 0}}, r"policy\.quantize\.group_size: must be >= 1"),
    ("negative-prefetch", {"offload": {"prefetch": -1}}, r"policy\.offload\.prefetch: must be >= 0"),
    ("static-without-max", {"storage": "static"}, r"policy\.max_length: storage 'static' needs max_length"),
    ("negative-max-length", {"max_length": -4}, r"policy\.max_length: must be >= 1"),
    ("unknown-backend", {"quantize": {"backend": "gguf"}}, r"policy\.quantize\.backend: 'gguf' is not allowed"),
    ("override-both", {"overrides": [{"layers": [0], "layer_type": "full_attention"}]}, r"overrides\[0\]: give exactly one"),
    ("override-neither", {"overrides": [{"quantize": None}]}, r"overrides\[0\]: give exactly one"),
    ("unknown-layer-type", {"overrides": [{"layer_type": "mamba"}]}, r"overrides\[0\]\.layer_type: unknown layer type 'mamba'"),
    ("override-list-type", {"overrides": [{"layers": "all"}]}, r"overrides\[0\]\.layers: expected a list of an integer"),
    ("not-a-mapping", ["storage"], r"policy: expected a mapping"),
    ("auto-without-budget", {"auto": True}, r"auto: true needs a device budget"),
    ("path-without-disk", {"offload": {"device": "cpu", "path": "/tmp"}}, r"offload\.path: only used with device: disk"),
    ("key-bits-unsupported", {"quantize": {"bits": 2, "key_bits": 3}},
     r"policy\.quantize\.key_bits: backend 'native' supports bits 2, 4, 8 .*got bits 3"),
    ("value-bits-fp8", {"quantize": {"bits": 8, "format": "fp8", "value_bits": 4}},
     r"policy\.quantize\.value_bits: backend 'native' format 'fp8' is 8 bits"),
    ("override-key-bits", {"quantize": {"bits": 2}, "overrides": [{"layers": [0], "quantize": {"key_bits": 5}}]},
     r"policy\.overrides\[0\]\.quantize\.key_bits: .*got bits 5"),
    ("key-bits-type", {"quantize": {"key_bits": "4"}}, r"policy\.quantize\.key_bits: expected an integer"),
]


@pytest.mark.parametrize("data,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_policies_name_the_field(data, match):
    with pytest.raises(PolicyError, match=match):
        Policy.from_dict(data)


MODEL_BAD = [
    ("index-out-of-range", {"overrides": [{"layers": [0, 42], "quantize": None}]}, r"index 42 is out of range for a model with 42 layers; allowed: -42\.\.41"),
    ("negative-out-of-range", {"overrides": [{"layers": [-43], "quantize": None}]}, r"index -43 is out of range"),
    ("type-not-in-model", {"overrides": [{"layer_type": "chunked_attention", "quantize": None}]}, r"'chunked_attention' is not a layer type of this model; it has: full_attention, sliding_attention"),
]


@pytest.mark.parametrize("data,match", [b[1:] for b in MODEL_BAD], ids=[b[0] for b in MODEL_BAD])
def test_policies_are_checked_against_the_model(data, match):
    with pytest.raises(PolicyError, match=match):
        Policy.from_dict(data).resolve(GEMMA)


def test_overrides_apply_in_order_and_sliding_layers_stay_resident():
    policy = Policy.from_dict({
        "quantize": {"bits": 4, "group_size": 32},
        "offload": {"device": "cpu"},
        "overrides": [
            {"layers": [0, -1], "quantize": None},
            {"layer_type": "full_attention", "quantize": {"bits": 2}},
            {"layers": [1], "quantize": {"bits": 8}},
        ],
    })
    layers = policy.resolve(GEMMA)
    assert len(layers) == 42
    assert layers[0].quantize is None and layers[0].storage == "sliding" and layers[0].window == 4096
    assert layers[0].offload is None  # sliding: resident by default
    assert layers[1].quantize.bits == 8 and layers[1].quantize.group_size == 32  # merged over the base
    assert layers[3].quantize.bits == 2 and layers[3].offload.device == "cpu"
    assert layers[2].quantize.bits == 4
    # layer 41 (full attention) is named by [0, -1] and then by full_attention: the later one wins
    assert layers[41].quantize.bits == 2
    assert Policy.from_dict({"overrides": [{"layers": [-1], "quantize": None}]}).overrides[0].offload is UNSET


def test_a_later_override_replaces_an_earlier_ones_quantize_not_merges_into_it():
    policy = Policy.from_dict({"quantize": {"bits": 4, "group_size": 32}, "overrides": [
        {"layers": [0, 1], "quantize": {"group_size": 16}},
        {"layers": [1], "quantize": {"bits": 2}},
    ]})
    first, second = policy.resolve(GEMMA)[:2]
    assert (first.quantize.bits, first.quantize.group_size) == (4, 16)
    assert (second.quantize.bits, second.quantize.group_size) == (2, 32)  # over the top level only (README)


def test_sliding_layers_can_be_offloaded_by_override():
    policy = Policy.from_dict({"offload": {}, "overrides": [{"layer_type": "sliding_attention", "offload": {"prefetch": 2}}]})
    layers = policy.resolve(GEMMA)
    assert layers[0].offload.prefetch == 2 and layers[1].offload.prefetch == 1


def test_yaml_roundtrip_and_sizes(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: x\nstorage: static\nmax_length: 64\nbudget:\n  device: 1.5GiB\n  host: 512MB\n")
    policy = load_policy(path)
    assert policy.budget.device == int(1.5 * 2**30) and policy.budget.host == 512 * 10**6
    assert Policy.from_dict(policy.to_dict()) == policy
    assert parse_size("20GiB", "x") == 20 * 2**30 and parse_size(7, "x") == 7


def test_missing_and_invalid_yaml(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        load_policy(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("storage: [full\n")
    with pytest.raises(PolicyError, match="not valid YAML"):
        load_policy(bad)


def test_model_spec_from_config():
    from transformers import Gemma2Config

    spec = ModelSpec.from_config(Gemma2Config(num_hidden_layers=4, sliding_window=16, num_key_value_heads=2, head_dim=8))
    assert spec.layer_types == ("sliding_attention", "full_attention") * 2
    assert spec.sliding_window == 16 and spec.kv_heads == 2 and spec.head_dim == 8


def test_empty_yaml_sections_mean_none(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("quantize:\noffload:\noverrides:\nbudget:\n")
    policy = load_policy(path)
    assert policy.quantize is None and policy.offload is None and policy.overrides == () and policy.budget is None
