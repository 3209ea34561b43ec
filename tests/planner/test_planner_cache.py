"""The plan matches ``nbytes()`` of a real, filled TieredCache within 3%, per tier and per layer.

Every config in ``configs/`` and a grid of policies (each storage kind, quantize, offload to
host and disk, overrides) on tiny random models: a prefill, then single-token steps.

CPU-only comparison: the compute device is ``cpu``, which is also the host tier's place, so
the tests read ``cache.tier_nbytes()`` (bytes keyed by tier: device, host, disk), and every
tier is compared on its own (``tier_bytes(cache.nbytes(), device)`` gives the same on a GPU).
"""

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config, FalconConfig, Gemma2Config, Gemma4TextConfig, LlamaConfig, MistralConfig

import tiercache
from tiercache.models.spec import ModelSpec
from tiercache.planner.api import plan
from tiercache.cache.compat import cache_arg

# the policies (serve store budgets live in configs/serve/, tested in tests/serve/test_config.py)
CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
assert CONFIGS, "no configs/*.yaml found"
SHAPE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=128, head_dim=16)
MODELS = {
    "llama": lambda layers=4: LlamaConfig(num_hidden_layers=layers, **SHAPE),
    "gemma2": lambda layers=4: Gemma2Config(num_hidden_layers=layers, sliding_window=64, **SHAPE),
    "mistral": lambda: MistralConfig(num_hidden_layers=3, sliding_window=200, **SHAPE),
}
# What layers cache differs from num_key_value_heads x head_dim: multi-query, latent attention
# (DeepSeek MLA: keys kv_lora_rank wide, values qk_rope_head_dim), per-layer head dims and KV
# sharing (Gemma 4: wider full-attention layers; the last two layers reuse earlier ones' K/V).
SHAPED = {
    "falcon-mqa": lambda: FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                       multi_query=True),
    "deepseek-mla": lambda: DeepseekV3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=2, n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
        moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=None,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16),
    "gemma4-shared": lambda: Gemma4TextConfig(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        global_head_dim=32, sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2),
}
MODELS.update(SHAPED)
BATCH, PREFILL, STEPS = 2, 600, 150  # two flushes of a 64-token block after the prefill: steady state

Q4 = {"bits": 4, "group_size": 32, "residual_length": 64}
POLICIES = {
    "fp": {},
    "static": {"storage": "static", "max_length": 1000},
    "host": {"offload": {"device": "cpu", "prefetch": 1}},
    "host-prefetch2": {"offload": {"device": "cpu", "prefetch": 2}},
    "disk": {"offload": {"device": "disk"}},
    "int4": {"quantize": Q4},
    "int2-token-keys": {"quantize": {**Q4, "bits": 2, "key_axis": "token"}},
    "int8-channel-values": {"quantize": {**Q4, "bits": 8, "value_axis": "channel"}},
    "int4-host": {"quantize": Q4, "offload": {"device": "cpu"}},
    "int4-disk": {"quantize": Q4, "offload": {"device": "disk"}},
    "int4-first-last-fp": {"quantize": Q4, "overrides": [{"layers": [0, -1], "quantize": None}]},
    "int2-keys4-some-host": {"quantize": {**Q4, "bits": 2}, "offload": {"device": "cpu"},
                             "overrides": [{"layers": [0], "quantize": {"key_bits": 4}}]},
    "int2-meta8-keys8-some": {"quantize": {**Q4, "bits": 2, "meta_bits": 8, "value_axis": "channel"},
                              "overrides": [{"layers": [0], "quantize": {"key_bits": 8}}]},
    "int4-host-sliding-offloaded": {
        "quantize": Q4, "offload": {"device": "cpu"},
        "overrides": [{"layer_type": "sliding_attention", "offload": {"device": "cpu"}}]},
    "static-int4": {"storage": "static", "max_length": 1000, "quantize": Q4},
}


def _layers_for(policy, least: int = 4) -> int:
    """Layers a small model needs for ``policy``'s overrides to name real layers, with a few beyond
    them (a policy written for a 32-layer model names indices up to 31)."""
    named = [i + 1 if i >= 0 else -i for o in policy.overrides for i in (o.layers or ())]
    return max(least, max(named, default=0) + 4) if any(n > least for n in named) else least


def _needs(policy) -> None:
    """Skip while the processor a policy needs has not landed yet."""
    n = _layers_for(policy, 2)
    layer_policies = policy.resolve(ModelSpec("probe", n, ("full_attention", "sliding_attention") * (n // 2) + (
        ("full_attention",) if n % 2 else ()), 2, 16, 64))
    if policy.quantize is not None or any(lp.quantize for lp in layer_policies):
        pytest.importorskip("tiercache.quantize.processor")
    if policy.offload is not None or any(lp.offload for lp in layer_policies):
        pytest.importorskip("tiercache.offload.processor")


def _filled(policy, config, dtype=torch.float32):
    """A cache fed as the model would: each layer the shape it caches; KV-sharing ``reuse`` layers never."""
    cache = tiercache.TieredCache.from_policy(policy, config, batch_size=BATCH, context_length=PREFILL + STEPS)
    spec = ModelSpec.from_config(config)
    g = torch.Generator().manual_seed(0)
    for t in (PREFILL, *[1] * STEPS):
        for i in range(spec.num_layers):
            if spec.kv_sharing(i) == "reuse":
                continue
            heads, key_dim, value_dim = spec.kv_shape(i)
            k = torch.randn(BATCH, heads, t, key_dim, generator=g).to(dtype)
            cache.update(k, torch.randn(BATCH, heads, t, value_dim, generator=g).to(dtype), i)
    return cache


def _close(real: int, predicted: int) -> bool:
    return abs(real - predicted) <= 0.03 * max(real, predicted)


def _check(policy, config, monkeypatch, dtype=torch.float32, cache=None, exact_mirrors=True):
    cache = _filled(policy, config, dtype) if cache is None else cache
    p = plan(cache.policy if policy.auto else policy, config, BATCH, PREFILL + STEPS)
    real = {tier: cache.tier_nbytes().get(tier, 0) for tier in p.bytes}
    work = cache.workspace_nbytes().get("cpu", 0)  # the quantized layers' dequantization workspace
    slots = cache.shared_nbytes().get("cpu", 0) - work  # the prefetcher's device mirrors
    assert real.keys() == p.bytes.keys()
    for tier in real:
        held, planned = real[tier], p.bytes[tier]
        if tier == "device":  # the mirror slots and the workspace are checked on their own below
            held, planned = held - slots - work, planned - p.mirrors - p.workspace
        assert _close(held, planned), f"{tier}: real {real} vs plan {p.bytes}\n{p.table()}"
    assert work == p.workspace, f"workspace: real {work} vs plan {p.workspace}"
    whole = {tier: p.whole.line("kv cache", tier) for tier in p.bytes}  # the whole footprint's cache lines
    assert whole == p.bytes, f"whole-footprint cache lines {whole} vs plan {p.bytes}"
    sizes = {r.mirror for r in p.layers if r.mirror}
    if len(sizes) <= 1 and exact_mirrors:  # offloaded layers alike: the slots are predicted exactly
        assert _close(slots, p.mirrors), f"mirror slots: real {slots} vs plan {p.mirrors}"
    else:  # sizes differ: the slots depend on the fetch schedule; the plan is an upper bound
        assert slots <= p.mirrors * 1.03, f"mirror slots: real {slots} vs plan {p.mirrors}"
    for layer, row in zip(cache.layers, p.layers):
        held = sum(layer.nbytes().values())
        assert _close(held, sum(row.bytes.values())), f"layer {row.index}: real {layer.nbytes()} vs {row.bytes}"
    cache.close()
    return p


@pytest.mark.parametrize("path", [pytest.param(c, marks=pytest.mark.slow) if _layers_for(tiercache.load_policy(c)) > 4
                                  else c for c in CONFIGS], ids=[c.stem for c in CONFIGS])  # widened models: slow
@pytest.mark.parametrize("model", ["llama", "gemma2"])
def test_every_config_matches_a_filled_cache(path, model, monkeypatch):
    policy = tiercache.load_policy(path)
    _needs(policy)
    _check(policy, MODELS[model](_layers_for(policy)), monkeypatch)


# mistral (every layer sliding) only where it adds a case: sliding layers quantized / offloaded
GRID = [(name, model) for name in POLICIES for model in MODELS
        if not ("sliding" in name and model in ("llama", "falcon-mqa", "deepseek-mla"))
        and (model != "mistral" or name in ("fp", "int4", "int4-host-sliding-offloaded", "static-int4"))
        and (model not in SHAPED or name in ("fp", "static", "host", "int4", "int4-host", "int2-token-keys",
                                             "int4-host-sliding-offloaded"))]


@pytest.mark.parametrize("name,model", GRID, ids=[f"{n}-{m}" for n, m in GRID])
def test_policy_grid_matches_a_filled_cache(name, model, monkeypatch):
    policy = tiercache.Policy.from_dict({"name": name, **POLICIES[name]})
    _needs(policy)
    _check(policy, MODELS[model](), monkeypatch)


@pytest.mark.parametrize("name", ["fp", "int4", "int4-host"])
def test_bfloat16_cache_matches(name, monkeypatch):
    policy = tiercache.Policy.from_dict({"name": name, **POLICIES[name]})
    _needs(policy)
    config = MODELS["llama"]()
    config.dtype = torch.bfloat16
    p = _check(policy, config, monkeypatch, torch.bfloat16)
    assert p.model.dtype == "bfloat16"


LIFECYCLE = ["fp", "static", "host", "disk", "int4", "int4-host", "int2-token-keys", "int4-host-sliding-offloaded"]


@pytest.mark.parametrize("how", ["retier", "load", "fork"])
@pytest.mark.parametrize("name", LIFECYCLE)
def test_the_plan_matches_a_cache_after_retier_load_or_fork(name, how, monkeypatch, tmp_path):
    """A cache moved to a policy (retier), loaded from a save or forked holds what the plan says."""
    policy = tiercache.Policy.from_dict({"name": name, **POLICIES[name]})
    config = MODELS["gemma2"]()
    if how == "retier":
        cache = _filled(tiercache.Policy.from_dict({"name": "fp"}), config)
        cache.retier(policy)
    elif how == "load":
        _filled(tiercache.Policy.from_dict({"name": "fp"}), config).save(tmp_path / "c.safetensors")
        cache = tiercache.TieredCache.load(tmp_path / "c.safetensors", config, policy=policy)
    else:
        cache = _filled(policy, config).fork()
    spec = ModelSpec.from_config(config)
    g = torch.Generator().manual_seed(1)
    for i in range(spec.num_layers):  # one step after the move: the shared buffers are made on use
        heads, key_dim, value_dim = spec.kv_shape(i)
        cache.update(torch.randn(BATCH, heads, 1, key_dim, generator=g),
                     torch.randn(BATCH, heads, 1, value_dim, generator=g), i)
    # mirror slots are made on use, sized to what is held then (a fed cache's grew step by step):
    # for a moved cache the plan is an upper bound of them; every tier's held bytes still match
    p = _check(policy, config, monkeypatch, cache=cache, exact_mirrors=False)
    assert p.context_length == PREFILL + STEPS


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
@pytest.mark.parametrize("prompt,steps", [(300, 0), (300, 20), (600, 5), (20, 300)])
def test_offloaded_sliding_layers_planned_after_a_long_prompt(family, prompt, steps):
    """Offloaded sliding layers given a prompt longer than their window's mirror: the device
    mirrors stay at what the plan counts (a long update is answered in fresh tensors)."""
    import builders

    model = builders.build(family)
    pol = {"name": "offload-sliding", "offload": {"device": "cpu"},
           "overrides": [{"layer_type": "sliding_attention", "offload": {"device": "cpu"}}]}
    cache = tiercache.TieredCache.from_policy(pol, model.config)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, **cache_arg(cache))
        for i in range(steps):
            model(ids[:, i % prompt : i % prompt + 1], **cache_arg(cache))
    p = plan(pol, model.config, batch_size=1, context_length=cache.get_seq_length(), device="cpu")
    assert all(layer.policy.offload is not None for layer in cache.layers)
    held = sum(cache.shared_nbytes().values())
    # every layer sliding: exact; mixed with full layers, the plan counts the largest mirrors together
    assert (p.mirrors == held if family == "mistral" else p.mirrors >= held) and held > 0
    assert p.bytes["host"] == cache.tier_nbytes()["host"]
    cache.close()
