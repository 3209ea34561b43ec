"""Many texts at once (``multitext``): windows of the held-out stream, a batched teacher-forced decode
equal to decoding each text alone (full precision and quantized), and the spread of per-text deltas."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from tiercache import TieredCache
from research import forced, multitext, realbench, seeded, texts
from tiercache.models.tiny import ByteTokenizer, tiny_random
from tiercache.models.load import load_model

INT2 = {"name": "int2", "quantize": {"bits": 2, "group_size": 16, "residual_length": 32, "sink_tokens": 4,
                                     "clip": "mse-values"}}


def test_windows_are_consecutive_slices_of_the_stream():
    tok = ByteTokenizer()
    ids = multitext.windows(tok, "code", 3, 100)  # [3, 100]
    assert ids.shape == (3, 100)
    stream = texts.encode(tok, texts.code("heldout", max_chars=8 * 300 + 4096))
    assert ids.flatten().tolist() == stream[:300]
    with pytest.raises(ValueError, match="text kind"):
        multitext.windows(tok, "poetry", 2, 10)
    with pytest.raises(ValueError, match="asked"):
        multitext.windows(tok, "prose", 10**4, 10**4)


@pytest.mark.parametrize("policy", [None, INT2], ids=["dynamic", "int2"])
def test_batched_decode_equals_each_text_alone(policy):
    model = tiny_random()
    ids = multitext.windows(ByteTokenizer(), "prose", 3, 90)  # [3, 90]
    make = (lambda: DynamicCache(config=model.config)) if policy is None else \
        (lambda: TieredCache.from_policy(policy, model.config))
    pre = multitext.prefill(model, ids[:, :70])
    assert pre.kv[0][0].shape[0] == 3 and pre.logits.shape[0] == 3
    batched = multitext.teacher_forced(model, seeded.seed(make(), pre), pre, ids[:, 70:])
    assert batched.nll.shape == (3, 20) and batched.steps == 19
    for i in range(3):
        one = seeded.prefill(model, ids[i, :70])
        alone = forced.teacher_forced(model, seeded.seed(make(), one), one, ids[i, 70:])
        torch.testing.assert_close(batched.nll[i], alone.nll, rtol=1e-4, atol=1e-4)
        assert torch.equal(batched.top1[i], alone.top1)


def test_spread_of_per_text_deltas():
    ref = torch.zeros(4, 5)
    deltas = [0.0, 0.1, 0.2, 0.5]
    nll = torch.stack([torch.full((5,), math.log1p(d)) for d in deltas])  # each text's ppl ratio is 1 + d
    sp = multitext.spread(nll, ref)
    assert sp["per_text"] == pytest.approx(deltas)
    assert sp["mean"] == pytest.approx(0.2) and sp["lo"] <= sp["mean"] <= sp["hi"]
    assert 0.0 <= sp["lo"] < 0.2 < sp["hi"] <= 0.5
    assert sp["pooled"] == pytest.approx(math.exp(sum(map(math.log1p, deltas)) / 4) - 1)
    same = multitext.spread(ref, ref)
    assert same["mean"] == same["lo"] == same["hi"] == 0.0
    with pytest.raises(ValueError, match=r"\[N, M\]"):
        multitext.spread(nll, ref[:3])


def test_run_reports_the_spread_over_texts():
    model, tok = load_model("tiny")
    rows, meta = realbench.run(model, tok, ["int2 +sinks +clipV"], 200, 6, ["code"], 0, [], [],
                               log=lambda *_: None, texts_per_kind=3)
    assert meta["texts_per_kind"] == 3
    ref, row = rows
    assert ref["ppl_spread"]["code"]["per_text"] == [0.0, 0.0, 0.0]
    sp = row["ppl_spread"]["code"]
    assert len(sp["per_text"]) == 3 and row["ppl_delta"]["code"] == pytest.approx(sum(sp["per_text"]) / 3)
    assert sp["lo"] <= row["ppl_delta"]["code"] <= sp["hi"]
