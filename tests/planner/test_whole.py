"""Whole-footprint plans: weights from shapes against real modules, activation lines, budgets with
``scope: total``, the prefill chunk ``auto`` and ``plan`` pick, and the CLI lines."""

import pytest
import torch

import tiercache
from builders import build
from tiercache.planner.activations import prefill_peak
from tiercache.cli import main
from tiercache.errors import PolicyError
from tiercache.planner.weights import Arch, arch_preset, module_bytes, weight_bytes

EXACT = ["llama", "mistral", "qwen2", "mixtral"]


@pytest.mark.parametrize("family", EXACT)
def test_weights_from_the_config_equal_the_module(family):
    model = build(family)
    arch = Arch.from_config(model.config)
    assert weight_bytes(arch, "fp32") == module_bytes(model) - _buffers(model)


@pytest.mark.parametrize("family", ["gemma2", "qwen3", "phi3", "cohere2"])
def test_weights_of_other_layouts_are_close(family):
    model = build(family)
    real = module_bytes(model) - _buffers(model)
    assert abs(weight_bytes(Arch.from_config(model.config), "fp32") - real) / real < 0.05


def _buffers(model) -> int:
    return sum(b.numel() * b.element_size() for b in model.buffers())


def test_llama_3_8b_weights_and_formats():
    arch = arch_preset("Llama-3-8B")
    assert weight_bytes(arch) == 8_030_261_248 * 2  # the published parameter count, bf16
    linear = arch.linear_params()
    int4, int8 = weight_bytes(arch, "int4"), weight_bytes(arch, "int8")
    other = arch.other_params() * 2
    assert (int4 - other) * 8 / linear == pytest.approx(4.5)  # 4 bits + a 16-bit scale and zero per 64
    assert int4 < int8 < weight_bytes(arch, "bf16") < weight_bytes(arch, "fp32")
    with pytest.raises(ValueError, match="int4"):
        weight_bytes(arch, "int3")


def test_activation_lines_follow_the_shapes():
    arch = arch_preset("Llama-3-8B")
    big, small = prefill_peak(arch, 1, 4096, 131072), prefill_peak(arch, 1, 512, 131072)
    assert small["peak"] < big["peak"] and small["mlp"] * 8 == big["mlp"]
    # GQA: transformers expands K/V to all query heads when a mask is passed: 2 x 32 heads x 128k x 128 x bf16
    assert big["attention"] >= 2 * 32 * 131072 * 128 * 2
    assert prefill_peak(arch, 1, 512, 131072, kernel="math")["attention"] > small["attention"]
    assert big["mlp"] == 3 * 4096 * 14336 * 2 and big["mask"] == 4096 * 131072


def test_plan_lines_add_up_and_the_cache_line_is_the_cache():
    p = tiercache.plan("configs/int4-kivi.yaml", "Llama-3-8B", 1, 32768)
    names = [x.name for x in p.whole.lines]
    for name in ("weights", "kv cache", "cache growth", "activations", "runtime", "margin"):
        assert name in names
    assert p.whole.line("kv cache") == p.bytes["device"]
    assert p.whole.total["device"] == sum(x.bytes for x in p.whole.lines if x.tier == "device")
    assert p.prefill_chunk == 2048
    four = tiercache.plan("configs/int4-kivi.yaml", "Llama-3-8B", 1, 32768, weights="int4")
    assert four.whole.line("weights") < p.whole.line("weights") / 2.5  # embeddings and head stay bf16


def test_a_loaded_model_is_counted_exactly():
    model = build("llama")
    p = tiercache.plan({"name": "fp"}, model, 1, 64, device="cpu")
    assert p.whole.line("weights") == module_bytes(model)
    assert p.prefill_chunk == 64


@pytest.mark.parametrize("name", ["tiny", "tiny-random", "smollm2-135m"])
def test_a_built_in_model_by_name_counts_its_weights_and_activations(name):
    """Planned by name, without loading it: the weights line is the model's parameters (built on
    the meta device from the same config), and the activations are counted."""
    from transformers import AutoModelForCausalLM

    from tiercache.models import registry as builtin

    p = tiercache.plan({"name": "fp"}, name, 1, 4096, device="cpu")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(builtin.config(name))
    assert p.whole.line("weights") == 4 * sum(x.numel() for x in model.parameters())  # fp32
    assert p.whole.line("activations") > 0


def test_scope_total_budget_checks_the_whole_run_and_picks_the_chunk():
    base = {"name": "t", "quantize": {"bits": 4}, "offload": {"device": "cpu"}}
    at = {c: tiercache.plan(base, "Llama-3-8B", 1, 131072, prefill_chunk=c).whole.total["device"] for c in (1024, 2048)}
    assert at[1024] < at[2048]
    budget = (at[1024] + at[2048]) // 2
    p = tiercache.plan({**base, "budget": {"device": budget, "scope": "total"}}, "Llama-3-8B", 1, 131072)
    assert p.fits and p.prefill_chunk == 1024 and "whole run" in p.table()
    cache_only = tiercache.plan({**base, "budget": {"device": budget}}, "Llama-3-8B", 1, 131072)
    assert cache_only.fits and cache_only.prefill_chunk == 2048  # scope cache: the default chunk
    tight = tiercache.plan({**base, "budget": {"device": at[1024] // 2, "scope": "total"}}, "Llama-3-8B", 1, 131072)
    assert not tight.fits and tight.prefill_chunk == 128  # the smallest tried


def test_auto_picks_a_policy_and_a_chunk_that_fit_the_whole_run():
    auto = {"name": "a", "auto": True, "budget": {"device": "22GiB", "host": "64GiB", "scope": "total"}}
    p = tiercache.plan(auto, "Llama-3-8B", 1, 131072)
    assert p.fits and p.whole.total["device"] <= 22 * 2**30
    fp = next(r for r in p.rungs if r.name == "fp-resident")
    assert not fp.plan.fits  # 15 GiB of weights + 16 GiB of cache
    assert p.rungs.index(next(r for r in p.rungs if "CHOSEN" in r.verdict)) > 0


def test_bad_run_options_are_refused():
    for kw, match in ((dict(weights="int3"), "weights"), (dict(device="tpu"), "device"),
                      (dict(prefill_chunk=0), "prefill_chunk")):
        with pytest.raises(PolicyError, match=match):
            tiercache.plan({"name": "x"}, "Llama-3-8B", 1, 1024, **kw)
    with pytest.raises(PolicyError, match="scope"):
        tiercache.load_policy({"name": "x", "budget": {"device": "1GiB", "scope": "everything"}})


def test_cli_plan_prints_every_line(capsys):
    code = main(["plan", "configs/tiered-int4-offload.yaml", "--model", "Llama-3-8B", "--context", "131072",
                 "--weights", "int4", "--device", "cpu", "--prefill-chunk", "1024"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    for text in ("whole footprint on cpu (prefill in chunks of 1024 tokens)", "weights", "int4, from the config",
                 "activations", "runtime", "margin", "total"):
        assert text in out, out
