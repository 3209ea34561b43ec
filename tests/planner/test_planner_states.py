"""The planner counts a hybrid model's conv / recurrent states (issue 31): for every family of
``hybrid_models.HYBRID`` the plan's states line equals ``state_nbytes()`` of a real cache after a
prefill (float32 and bfloat16, batch 1 and 3), it is context-independent, part of the device
total, and the table and ``tiercache plan`` show it; a model whose state shapes are not known
says so instead of counting 0."""

from __future__ import annotations

import functools
import io
import json

import pytest
import torch

from hybrid_models import HYBRID, build, tiny_config
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.state_layer import StateLayer
from tiercache.models.spec import ModelSpec
from tiercache.planner.api import main_plan, plan
from tiercache.planner.states import RULES, state_plan

FP = {"name": "fp"}
BF16_BROKEN = {"inkling2_text", "inkling2_loop_text"}  # transformers' own bf16 forward fails (float vs bf16 matmul)


@functools.lru_cache(maxsize=None)
def model(family: str, dtype: torch.dtype):
    m = build(family).to(dtype)
    m.config.dtype = dtype
    return m


def measured(m, batch: int, length: int = 5) -> dict[int, int]:
    cache = TieredCache.from_policy(FP, m.config)
    ids = torch.randint(3, 100, (batch, length), generator=torch.Generator().manual_seed(batch))
    with torch.no_grad():
        m(ids, **cache_arg(cache), use_cache=True)
    return {i: layer.state_nbytes() for i, layer in enumerate(cache.layers) if isinstance(layer, StateLayer)}


CASES = [(f, d) for f in HYBRID for d in (torch.float32, torch.bfloat16) if not (d == torch.bfloat16 and f in BF16_BROKEN)]


@pytest.mark.parametrize("family,dtype", CASES, ids=[f"{f}-{str(d)[6:]}" for f, d in CASES])
def test_plan_states_equal_the_measured_state_bytes(family, dtype):
    m = model(family, dtype)
    for batch in (1, 3):
        got = measured(m, batch)
        p = plan(FP, m.config, batch_size=batch, context_length=64)
        states = p.states
        assert states is not None and states.unknown is None
        if states.elsewhere is not None:  # RecurrentGemma: its states live in the model, the cache holds none
            assert sum(got.values()) == 0 and p.state_bytes == 0
            continue
        assert {i: states.layer_bytes(i, batch) for i in got if got[i]} == {i: n for i, n in got.items() if n}
        assert p.state_bytes == sum(got.values()) > 0


def test_states_are_context_independent_and_part_of_the_device_total():
    cfg = tiny_config("jamba")
    short, long = plan(FP, cfg, 2, 16), plan(FP, cfg, 2, 4096)
    assert short.state_bytes == long.state_bytes > 0
    attention = lambda p: sum(r.bytes["device"] for r in p.layers)  # noqa: E731
    assert short.bytes["device"] == attention(short) + short.state_bytes + short.workspace + short.mirrors
    assert long.bytes["device"] - short.bytes["device"] == attention(long) - attention(short)
    offloaded = plan({"name": "cpu", "offload": {"device": "cpu"}}, cfg, 2, 4096)  # states stay on the device
    assert offloaded.state_bytes == long.state_bytes and offloaded.bytes["device"] >= offloaded.state_bytes


def test_the_whole_cache_matches_the_plan_after_prefill():
    """The plan's device total (attention + states + workspace) is what ``nbytes()`` reports."""
    m = model("bamba", torch.float32)
    policy = {"name": "int4", "quantize": {"backend": "native", "bits": 4, "group_size": 4, "residual_length": 4}}
    cache = TieredCache.from_policy(policy, m.config)
    with torch.no_grad():
        m(torch.randint(3, 100, (1, 9)), **cache_arg(cache), use_cache=True)
    p = plan(policy, m.config, 1, 9)
    assert sum(cache.nbytes().values()) == sum(p.bytes.values())


def test_table_and_cli_show_the_states(tmp_path):
    cfg = tiny_config("qwen3_next")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    policy = tmp_path / "p.yaml"
    policy.write_text("name: fp\n")
    out, err = io.StringIO(), io.StringIO()
    assert main_plan(str(policy), str(tmp_path), 1024, 2, out, err) == 0, err.getvalue()
    text = out.getvalue()
    p = plan(FP, str(tmp_path), 2, 1024)  # a config.json without a dtype reads as bfloat16 (resolve.local_config)
    assert p.state_bytes == 3 * 2 * (128 * 4 * 2 + 4 * 16 * 16 * 4)
    line = next(x for x in text.splitlines() if "conv / recurrent states" in x)
    from tiercache.planner.units import human

    assert human(p.state_bytes) in line and "exact" in line
    assert "state, exact: conv [128, 4] bf16 + recurrent [4, 16, 16] fp32" in text


def test_unknown_state_shapes_are_said_not_counted_as_zero():
    cfg = tiny_config("mamba")
    spec = ModelSpec.from_config(cfg)
    p = plan(FP, spec, 1, 128)  # a ModelSpec alone: no sizes to read
    assert p.states.unknown and p.state_bytes == 0
    text = p.table()
    assert "NOT PREDICTED" in text and "not predicted" in text.split("total held")[1]
    cfg.model_type = "some_new_mamba"
    s = state_plan(spec, cfg)
    assert "some_new_mamba" in s.unknown and s.bytes(1) == 0
    assert set(HYBRID) - {"recurrent_gemma"} <= set(RULES)
