"""Planner: storage formulas against the real layers, verdicts, table, models, CLI entry point."""

import io
import json

import pytest
import torch

import tiercache
from tiercache.errors import PolicyError
from tiercache.planner.footprint import quantize_split, quantized_bytes, storage_capacity
from tiercache.layers.full import FullLayer
from tiercache.layers.sliding import SlidingLayer
from tiercache.layers.static import StaticLayer
from tiercache.models.spec import PRESETS, ModelSpec
from tiercache.planner.api import human, main_plan, plan, resolve_model, tier_bytes
from tiercache.policy.schema import LayerPolicy, QuantizePolicy

TINY = ModelSpec("tiny", 2, ("full_attention", "sliding_attention"), kv_heads=2, head_dim=8,
                 sliding_window=40, dtype="float32")
LLAMA8B = PRESETS["llama-3-8b"]


def _fill(layer, prefill: int, steps: int, batch: int = 2):
    k = torch.randn(batch, 2, prefill, 8)
    layer.update(k, k)
    for _ in range(steps):
        k = torch.randn(batch, 2, 1, 8)
        layer.update(k, k)
    return layer


# prefill, decode steps
FILLS = [(1, 0), (5, 300), (255, 1), (256, 0), (300, 0), (700, 100), (1000, 5)]
FILL_IDS = [f"p{p}+{s}" for p, s in FILLS]


@pytest.mark.parametrize("prefill,steps", FILLS, ids=FILL_IDS)
def test_full_storage_bytes_exact(prefill, steps):
    lp = LayerPolicy(0, "full_attention", "full", None, None, None, None)
    real = _fill(FullLayer(), prefill, steps).nbytes()["cpu"]
    assert real == 2 * 2 * 2 * 8 * 4 * storage_capacity(lp, prefill + steps)


@pytest.mark.parametrize("prefill,steps", FILLS, ids=FILL_IDS)
def test_static_storage_bytes_exact(prefill, steps):
    lp = LayerPolicy(0, "full_attention", "static", None, 2048, None, None)
    real = _fill(StaticLayer(2048), prefill, steps).nbytes()["cpu"]
    assert real == 2 * 2 * 2 * 8 * 4 * storage_capacity(lp, prefill + steps)


@pytest.mark.parametrize("window", [8, 40, 300])
@pytest.mark.parametrize("prefill,steps", [(300, 0), (700, 100), (1000, 300), (5, 300)])
def test_sliding_storage_bytes_within_a_chunk(window, prefill, steps):
    lp = LayerPolicy(0, "sliding_attention", "sliding", window, None, None, None)
    real = _fill(SlidingLayer(window), prefill, steps).nbytes()["cpu"] // (2 * 2 * 2 * 8 * 4)
    predicted = storage_capacity(lp, prefill + steps)
    assert abs(real - predicted) <= 256 and predicted >= real


def test_quantize_byte_math_4_5_bits_per_element():
    q = QuantizePolicy(bits=4, group_size=64)
    spec = ModelSpec("m", 1, ("full_attention",), kv_heads=8, head_dim=128, dtype="bfloat16")
    elements = 2 * 8 * 128 * 1024  # K and V of 1024 tokens
    assert quantized_bytes(q, spec, 1, 1024) * 8 / elements == pytest.approx(4.5)
    # KIVI: the residual fills to 128 tokens, then its two blocks of 64 are packed
    assert quantize_split(q, 1000) == (896, 104)
    assert quantize_split(q, 3000) == (2944, 56)  # 46 blocks packed, 56 exact
    assert [quantize_split(q, n) for n in (100, 127, 128, 129)] == [(0, 100), (0, 127), (128, 0), (128, 1)]
    odd = QuantizePolicy(bits=4, group_size=64, residual_length=100)  # one block per flush, 36 stay
    assert [quantize_split(odd, n) for n in (99, 100, 163, 164)] == [(0, 99), (64, 36), (64, 99), (128, 36)]
    short = QuantizePolicy(bits=4, group_size=8, residual_length=4)  # R < G: flushed at a whole block
    assert [quantize_split(short, n) for n in (7, 8, 15, 16)] == [(0, 7), (8, 0), (8, 7), (16, 0)]


def test_plan_full_precision_llama_128k_is_16_gib():
    p = plan({"name": "fp"}, "Llama-3-8B", 1, 131072)
    assert p.bytes == {"device": 16 * 2**30, "host": 0, "disk": 0}
    assert p.fits and p.workspace == 0


def test_sliding_layers_keep_their_window():
    p = plan({"name": "fp"}, "gemma-2-9b", 1, 131072)
    sliding = [r for r in p.layers if r.layer_type == "sliding_attention"]
    full = [r for r in p.layers if r.layer_type == "full_attention"]
    assert all(r.tokens == 4095 for r in sliding) and all(r.tokens == 131072 for r in full)
    assert sliding[0].bytes["device"] < full[0].bytes["device"] / 20


def test_overrides_change_the_named_layers():
    policy = {"name": "o", "quantize": {"bits": 4}, "overrides": [{"layers": [0, -1], "quantize": None}]}
    rows = plan(policy, LLAMA8B, 1, 8192).layers
    assert rows[0].form.startswith("bf16") and rows[-1].form.startswith("bf16")
    assert rows[1].form.startswith("int4") and rows[1].bytes["device"] < rows[0].bytes["device"] / 3


def test_offload_moves_history_to_host_and_keeps_mirrors_on_device():
    p = plan({"name": "off", "offload": {"prefetch": 2}}, LLAMA8B, 1, 8000)
    per_layer = 8192 * 8 * 128 * 2 * 2  # capacity: 8000 tokens in whole chunks of 256
    assert p.bytes["host"] == 32 * per_layer
    assert p.mirrors == 3 * per_layer and p.bytes["device"] == 3 * per_layer
    disk = plan({"name": "d", "offload": {"device": "disk"}}, LLAMA8B, 1, 8000)
    assert disk.bytes["disk"] == 32 * per_layer and disk.bytes["host"] == 0


def test_budget_verdicts_and_workspace():
    q = {"name": "q", "quantize": {"bits": 4, "packed_attention": False}, "budget": {"device": "4.6GiB"}}
    p = plan(q, LLAMA8B, 1, 131072)
    assert p.workspace == 131072 * 8 * 128 * 2 * 2  # one layer's K and V at 128k (bf16), shared, held
    assert p.bytes["device"] - p.workspace < 4.6 * 2**30 < p.bytes["device"]  # the workspace tips it
    assert p.verdicts()["device"] == (p.bytes["device"], int(4.6 * 2**30), False)
    assert not p.fits and "DOES NOT FIT" in p.table()
    p = plan({**q, "budget": {"device": "6GiB", "host": "1GiB"}}, LLAMA8B, 1, 131072)
    assert p.fits and set(p.verdicts()) == {"device", "host"}
    packed = plan({**q, "quantize": {"bits": 4}}, LLAMA8B, 1, 131072)  # packed attention: decode reads the codes
    assert packed.workspace == 0 and packed.bytes["device"] == p.bytes["device"] - p.workspace and packed.fits


def test_static_max_length_shorter_than_context_does_not_fit():
    p = plan({"name": "s", "storage": "static", "max_length": 4096}, LLAMA8B, 1, 8192)
    assert not p.fits and "max_length" in p.table()
    ok = plan({"name": "s", "storage": "static", "max_length": 8192}, LLAMA8B, 1, 100)
    assert ok.fits and ok.bytes["device"] == 32 * 8192 * 8 * 128 * 2 * 2


def test_table_groups_layers_and_uses_human_units():
    text = plan({"name": "fp"}, "gemma-2-9b", 1, 32768).table()
    assert "0-40/2" in text and "1-41/2" in text and "GiB" in text and "verdict: fits" in text
    assert human(1536) == "1.5 KiB" and human(3 * 2**20) == "3.0 MiB" and human(12) == "12 B"


def test_resolve_model_presets_and_local_config(tmp_path):
    assert resolve_model("LLAMA-3-8B") is PRESETS["llama-3-8b"]
    cfg = {"num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "torch_dtype": "float16", "sliding_window": None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert (spec.num_layers, spec.kv_heads, spec.head_dim, spec.dtype) == (3, 2, 16, "float16")
    assert resolve_model(str(tmp_path / "config.json")) == spec


def test_resolve_model_unknown_names_presets(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PolicyError, match="Llama-3-8B"):
        resolve_model("no-such-org/no-such-model-xyz")


def test_plan_accepts_a_transformers_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    p = tiercache.plan({"name": "fp"}, cfg, batch_size=2, context_length=300)
    assert len(p.layers) == 4 and p.bytes["device"] == 4 * 2 * 2 * 512 * 2 * 16 * 4


def test_tier_bytes_maps_places():
    assert tier_bytes({"cuda:0": 5, "cpu": 7, "disk": 9}, "cuda:0") == {"device": 5, "host": 7, "disk": 9}
    assert tier_bytes({"cpu": 7}, "cpu") == {"device": 7, "host": 0, "disk": 0}


def test_main_plan_exit_codes(tmp_path):
    good = tmp_path / "p.yaml"
    good.write_text("name: p\nbudget: {device: 20GiB}\n")
    out = io.StringIO()
    assert main_plan(str(good), "llama-3-8b", 131072, 1, out=out) == 0
    assert "verdict: fits" in out.getvalue()
    assert main_plan(str(good), "llama-3-8b", 131072, 2, out=io.StringIO()) == 1
    err = io.StringIO()
    assert main_plan(str(tmp_path / "missing.yaml"), "llama-3-8b", 10, 1, out=io.StringIO(), err=err) == 1
    assert "error:" in err.getvalue()
    err = io.StringIO()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: p\noverrides: [{layers: [40], quantize: null}]\n")
    assert main_plan(str(bad), "llama-3-8b", 10, 1, out=io.StringIO(), err=err) == 1
    assert "out of range" in err.getvalue()


def test_keys_at_their_own_bits_are_counted_and_named():
    """``key_bits: 4`` on ``bits: 2``: the keys' rows at int4 size, the values' at int2, and the
    table says so (K4V2)."""
    from tiercache.policy.schema import QuantizePolicy

    spec = PRESETS["llama-3-8b"]
    q2, q4, mixed = QuantizePolicy(bits=2), QuantizePolicy(bits=4), QuantizePolicy(bits=2, key_bits=4)
    both = quantized_bytes(q2, spec, 1, 4096) + quantized_bytes(q4, spec, 1, 4096)
    assert 2 * quantized_bytes(mixed, spec, 1, 4096) == both  # same K and V dims: the mean of the two
    p = plan(tiercache.Policy.from_dict({"name": "k4", "quantize": {"bits": 2},
                                         "overrides": [{"layers": [0], "quantize": {"key_bits": 4}}]}),
             spec, 1, 4096)
    table = p.table()
    assert "K4V2 native" in table and "int2 native" in table
    assert p.layers[0].bytes["device"] > p.layers[1].bytes["device"]
