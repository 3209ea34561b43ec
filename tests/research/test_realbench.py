"""The real-model benchmark's parts on the tiny models: seeding equals prefilling through the cache,
retrieval samples put the needle where asked, sensitivity and the run's rows are sound."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache, QuantizedCache

from tiercache import TieredCache
from research import forced, realbench, retrieval, seeded, sensitivity, texts
from tiercache.bench import quality
from tiercache.models.tiny import ByteTokenizer, tiny_random
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg

POLICY = {"name": "int2-sinks-clip", "quantize": {"bits": 2, "group_size": 16, "residual_length": 32,
                                                   "sink_tokens": 4, "clip": "mse"}}
MAKERS = {
    "dynamic": lambda cfg: DynamicCache(config=cfg),
    "tiercache": lambda cfg: TieredCache.from_policy(POLICY, cfg),
    "quanto": lambda cfg: QuantizedCache("quanto", cfg, nbits=2, axis_key=0, axis_value=0, q_group_size=16,
                                         residual_length=32),
}


@pytest.mark.parametrize("kind", list(MAKERS))
def test_seeding_equals_prefilling_through_the_cache(kind):
    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "code", 150)  # [150]
    pre = seeded.prefill(model, ids[:120])
    seeded_cache = seeded.seed(MAKERS[kind](model.config), pre)
    own = MAKERS[kind](model.config)
    with torch.no_grad():
        logits = model(input_ids=ids[None, :120], **cache_arg(own), use_cache=True).logits[0, -1]
    assert torch.equal(logits, pre.logits)
    a = forced.teacher_forced(model, seeded_cache, pre, ids[120:])
    b = forced.teacher_forced(model, own, pre, ids[120:])
    assert torch.equal(a.nll, b.nll) and torch.equal(a.top1, b.top1) and a.steps == 29


def test_teacher_forced_matches_the_no_cache_reference():
    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "prose", 100)
    pre = seeded.prefill(model, ids[:70])
    f = forced.teacher_forced(model, seeded.seed(DynamicCache(config=model.config), pre), pre, ids[70:])
    nll, top1 = quality.reference(model, ids, 70)
    torch.testing.assert_close(f.nll, nll, rtol=1e-4, atol=1e-4)
    assert quality.agreement(f.top1, top1) == 1.0


def test_retrieval_samples_hide_the_key_at_the_asked_depth():
    tok = ByteTokenizer()
    out = retrieval.samples(tok, [600, 1200], [0.0, 0.5, 1.0], seed=3)
    assert len(out) == 6 and len({s.key for s in out}) == 6
    for i, s in enumerate(out):
        text = tok.decode(s.context)
        at = text.index(f"The pass key is {s.key}")
        assert s.length <= [600, 1200][i // 3] and s.length == len(s.context) + len(s.question)
        before, total = text[:at].count("The grass is green"), text.count("The grass is green")
        assert total >= 3 and abs(before / total - s.depth) <= 1 / total  # depth within the filler
        assert "What is the pass key?" in tok.decode(s.question)
    with pytest.raises(ValueError, match="too short"):
        retrieval.samples(tok, [50], [0.5])


def test_found_reads_digits():
    assert retrieval.found(" 12345.", "12345") and retrieval.found(" 12 345", "12345")
    assert not retrieval.found(" 1234.", "12345") and not retrieval.found("the pass key", "12345")


def test_sensitivity_costs_and_mixed_policy():
    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "code", 110, split="train")
    pre = seeded.prefill(model, ids[:100])
    costs = sensitivity.layer_costs(model, pre, ids[100:], {"bits": 2, "group_size": 16, "residual_length": 16})
    assert len(costs) == model.config.num_hidden_layers and all(c == c for c in costs)
    policy = sensitivity.mixed({"bits": 2}, [0.1, 0.5, -0.2, 0.3], {"bits": 4}, 2, "m")
    assert policy["overrides"] == [{"layers": [1, 3], "quantize": {"bits": 4}}]
    assert "overrides" not in sensitivity.mixed({"bits": 2}, [0.1], None, 0, "m")


def test_one_pass_scoring_equals_decode_steps_while_the_continuation_stays_residual():
    """Prompt of 96 = 3 residual periods of 32: all packed; 32 continuation tokens: all residual."""
    from transformers import DynamicCache

    from tiercache import TieredCache

    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "code", 128, split="train")
    pre = seeded.prefill(model, ids[:96])
    q = {"name": "q", "quantize": {"bits": 2, "group_size": 16, "residual_length": 32}}
    for make in (lambda: DynamicCache(config=model.config), lambda: TieredCache.from_policy(q, model.config)):
        stepped = forced.teacher_forced(model, seeded.seed(make(), pre), pre, ids[96:]).nll
        one = sensitivity.one_pass_nll(model, seeded.seed(make(), pre), pre, ids[96:])
        assert one.shape == stepped.shape == (32,)
        torch.testing.assert_close(one, stepped, atol=1e-4, rtol=1e-4)
    exact = sensitivity.one_pass_nll(model, seeded.seed(DynamicCache(config=model.config), pre), pre, ids[96:])
    assert not torch.allclose(one, exact, atol=1e-4)  # the quantized prompt is really read


def test_upgrade_gains_and_mixed_upgrades():
    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "code", 128, split="train")
    pre = seeded.prefill(model, ids[:96])
    base = {"bits": 2, "group_size": 16, "residual_length": 32}
    ups = {"same": {"key_bits": 2}, "keys": {"key_bits": 8}}
    gains = sensitivity.upgrade_gains(model, [(pre, ids[96:], None)], base, ups)
    n = model.config.num_hidden_layers
    assert gains["same"] == [0.0] * n  # the same format: the very same cache
    assert len(gains["keys"]) == n and all(g == g and g != 0.0 for g in gains["keys"])
    mask = torch.zeros(32, dtype=torch.bool)
    mask[-4:] = True  # only the last 4 tokens count (as a pass key's digits would)
    masked = sensitivity.upgrade_gains(model, [(pre, ids[96:], mask), (pre, ids[96:], mask)], base, ups)
    assert masked["same"] == [0.0] * n and masked["keys"] != gains["keys"]
    ups = {"keys": {"key_bits": 4}, "values": {"value_bits": 4}}
    policy = sensitivity.mixed_upgrades(base, {"keys": [0.3, 0.0, 0.2], "values": [0.25, 0.1, -0.1]}, ups, 3, "m")
    assert policy["overrides"] == [{"layers": [0], "quantize": {"key_bits": 4, "value_bits": 4}},
                                   {"layers": [2], "quantize": {"key_bits": 4}}]
    assert "overrides" not in sensitivity.mixed_upgrades(base, {"keys": [0.3]}, ups, 0, "m")



def test_decode_gains_step_decode_the_listed_layers_only():
    """Step-decoded gains: 0 for the same format and for unlisted layers; a real upgrade changes the
    perplexity, and over a continuation longer than the residual (blocks packed while decoding) it
    is not what one pass sees."""
    model = tiny_random()
    ids = torch.stack([texts.token_ids(ByteTokenizer(), kind, 128, split="train") for kind in ("code", "prose")])
    from research import multitext

    items = [(multitext.prefill(model, ids[:, :64]), ids[:, 64:])]  # 64 decoded, residual 16: packed while decoding
    base = {"bits": 2, "group_size": 8, "residual_length": 16}
    ups = {"same": {"key_bits": 2}, "keys": {"key_bits": 8}}
    n = model.config.num_hidden_layers
    gains = sensitivity.decode_gains(model, items, base, ups, [0, 2])
    assert gains["same"] == [0.0] * n
    assert gains["keys"][1] == 0.0 and gains["keys"][0] != 0.0 and gains["keys"][2] != 0.0
    one_pass = sensitivity.upgrade_gains(model, [(p, c, None) for p, c in items], base, {"keys": ups["keys"]})
    assert one_pass["keys"][0] != gains["keys"][0]


def test_greedy_upgrades_picks_the_best_candidate_each_round_measured_again():
    model = tiny_random()
    ids = texts.token_ids(ByteTokenizer(), "code", 128, split="train")
    pre = seeded.prefill(model, ids[:96])
    mask = torch.zeros(32, dtype=torch.bool)
    mask[-4:] = True
    objectives = {"text": [(pre, ids[96:], None)], "tail": [(pre, ids[96:], mask)]}
    base = {"bits": 2, "group_size": 16, "residual_length": 32}
    ups = {"keys": {"key_bits": 8}, "values": {"value_bits": 8}}
    picks = sensitivity.greedy_upgrades(model, objectives, base, ups, 2)
    n = model.config.num_hidden_layers
    assert picks[0]["layer"] is None and picks[0]["score"] == pytest.approx(2.0)  # the base keeps all of each loss
    assert [sensitivity._ppl(model, objectives["text"], {"name": "fp"})] == [picks[0]["fp"]["text"]]
    chosen = []
    for pick in picks[1:]:
        def score(c):
            policy = sensitivity.policy_of(base, chosen + [c], ups, "t")
            return sum(math.log(sensitivity._ppl(model, its, policy) / picks[0]["fp"][o])
                       / math.log(picks[0]["ppl"][o] / picks[0]["fp"][o]) for o, its in objectives.items())
        scores = {(i, u): score((i, u)) for i in range(n) for u in ups if (i, u) not in chosen}
        assert (pick["layer"], pick["upgrade"]) == min(scores, key=scores.get)  # re-measured with the picks so far
        assert pick["score"] == pytest.approx(scores[(pick["layer"], pick["upgrade"])])
        chosen.append((pick["layer"], pick["upgrade"]))
    assert len(set(chosen)) == 2
    # going on from the first pick finds the same second pick (the search is deterministic)
    resumed = sensitivity.greedy_upgrades(model, objectives, base, ups, 1, start=[chosen[0]])
    assert [(p["layer"], p["upgrade"], p.get("given")) for p in resumed[1:]] == [(*chosen[0], True), (*chosen[1], None)]
    assert resumed[2]["score"] == pytest.approx(picks[2]["score"])
    only = sensitivity.greedy_upgrades(model, objectives, base, ups, 5, candidates=[(1, "values"), (1, "values")])
    assert [(p["layer"], p["upgrade"]) for p in only[1:]] == [(1, "values")]  # never more picks than candidates
    with pytest.raises(ValueError, match=r"candidates \[\(9, 'keys'\)\]"):
        sensitivity.greedy_upgrades(model, objectives, base, ups, 1, candidates=[(9, "keys")])
    exact = {**base, "residual_length": 256}  # the whole prompt stays in the residual: nothing lost to score
    with pytest.raises(ValueError, match="loses nothing"):
        sensitivity.greedy_upgrades(model, objectives, exact, ups, 1)

def test_run_rows_on_the_tiny_model():
    model, tok = load_model("tiny")
    names = ["int2 min/max", "int2 +sinks +clip", "QuantizedCache quanto int2"]
    rows, meta = realbench.run(model, tok, names, 300, 6, ["code"], 3, [400], [0.5], log=lambda *_: None)
    assert [r["name"] for r in rows] == ["DynamicCache", *names]
    assert rows[0]["ppl_delta"]["code"] == 0 and rows[0]["greedy"] == 1.0 and rows[0]["top1"]["code"] == 1.0
    for r in rows:
        assert r["bytes"] > 0 and r["tok_s"] > 0 and r["retrieval_acc"] is not None
    assert rows[1]["bytes"] < rows[0]["bytes"]
    with pytest.raises(ValueError, match="unknown setup"):
        realbench.run(model, tok, ["nope"], 96, 6, ["code"], 0, [], [])


def test_a_policy_file_is_measured_as_its_inline_twin(tmp_path):
    """A user's policy YAML given by path: the same bytes and perplexity as the same policy
    inline, described as that file; a missing file is refused by ``setup_names``."""
    model, tok = load_model("tiny")
    mine = tmp_path / "mine.yml"
    mine.write_text("name: mine\nquantize: {backend: native, group_size: 64, residual_length: 128, "
                    "key_axis: channel, value_axis: token, bits: 2, sink_tokens: 4}\n")
    rows, _ = realbench.run(model, tok, [str(mine), "int2 +sinks"], 300, 6, ["code"], 0, [], [],
                            log=lambda *_: None, texts_per_kind=2)
    got = {r["name"]: r for r in rows}
    assert got[str(mine)]["what"] == f"the policy file {mine}"
    assert got[str(mine)]["bytes"] == got["int2 +sinks"]["bytes"]
    assert got[str(mine)]["ppl"] == got["int2 +sinks"]["ppl"] != got["DynamicCache"]["ppl"]
    with pytest.raises(ValueError, match="policy file not found"):
        realbench.setup_names([str(tmp_path / "gone.yaml")])


def test_every_named_setup_builds_a_cache_for_smollm2_shaped_configs():
    """Every setup the benchmarks name (inline policies and config files, ``meta_bits`` ones
    included) loads and builds a cache for a SmolLM2-shaped config (30 layers, 3 KV heads of 64),
    whose first update holds the tokens it was given."""
    from transformers import LlamaConfig

    from research import retrievalbench
    from tiercache.bench import setups

    config = LlamaConfig(num_hidden_layers=30, hidden_size=192, num_attention_heads=3, num_key_value_heads=3,
                         head_dim=64)
    named = {**{n: s for n, (_, s) in realbench.SETUPS.items()}, **retrievalbench.SETUPS}
    for name, spec in named.items():
        if isinstance(spec, str) and spec in setups.BASELINES:
            continue  # transformers' caches: built in the benchmark runs
        cache = setups.factory(spec, config)()
        k = torch.randn(1, 3, 70, 64)
        cache.update(k, k, 0)
        assert cache.get_seq_length() == 70, name
