"""Retrieval samples and judging (``research.retrieval``) and the per-setup accuracy run
(``retrievalbench``) on the tiny models: the needle where asked, no digits but the key's, the
same samples for the same seed, the answer read as a first number, accuracy against full precision."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from research import retrieval, retrievalbench
from tiercache.bench import setups
from tiercache.models.tiny import ByteTokenizer
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg

FORMATS = sorted(retrieval.FORMATS)


class ChatBytes(ByteTokenizer):
    """A byte tokenizer with a ChatML-like template, as SmolLM2's."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def test_spread_covers_depths_0_1_to_0_9():
    assert retrieval.spread(10)[0] == 0.1 and retrieval.spread(10)[-1] == 0.9 and len(retrieval.spread(10)) == 10
    steps = [b - a for a, b in zip(retrieval.spread(10), retrieval.spread(10)[1:])]
    assert max(steps) - min(steps) < 1e-3
    assert retrieval.spread(1) == [0.5]
    with pytest.raises(ValueError, match="at least 1"):
        retrieval.spread(0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_needle_sits_at_the_asked_depth_and_only_the_key_has_digits(fmt):
    tok = ByteTokenizer()
    depths = retrieval.spread(5)
    out = retrieval.samples(tok, [900, 1500], depths, seed=2, fmt=fmt)
    assert len(out) == 10 and len({s.key for s in out}) == 10
    for i, s in enumerate(out):
        text = tok.decode(s.context)
        needle = retrieval.FORMATS[fmt].needle.format(key=s.key, name=s.name)
        assert text.count(needle) == 1 and s.target == [900, 1500][i // 5]
        assert tok.decode(s.context[s.needle]) == needle
        assert s.length == len(s.context) + len(s.question) <= s.target
        assert re.findall(r"\d+", text) == [s.key, s.key]  # the filler and instruction hold no digits
        before, total = text[: text.index(needle)].count(retrieval.FILLER), text.count(retrieval.FILLER)
        assert total >= 5 and abs(before / total - s.depth) <= 1 / total
        question = tok.decode(s.question)
        assert not re.search(r"\d", question) and question.endswith(retrieval.FORMATS[fmt].answer.format(name=s.name))
        if fmt == "kv":
            assert f'"{s.name}"' in question and s.name in retrieval.NAMES


def test_samples_are_determined_by_the_seed_and_the_same_in_a_split_run():
    tok = ByteTokenizer()
    a = retrieval.samples(tok, [600, 900], [0.1, 0.9], seed=5)
    b = retrieval.samples(tok, [600, 900], [0.1, 0.9], seed=5)
    alone = retrieval.samples(tok, [900], [0.1, 0.9], seed=5)
    assert all(torch.equal(x.context, y.context) and x.key == y.key for x, y in zip(a, b))
    assert [s.key for s in a[2:]] == [s.key for s in alone]
    assert all(torch.equal(x.context, y.context) for x, y in zip(a[2:], alone))
    assert [s.key for s in retrieval.samples(tok, [600, 900], [0.1, 0.9], seed=6)] != [s.key for s in a]


def test_chat_form_ends_the_user_turn_and_opens_the_assistant_turn():
    tok = ChatBytes()
    s = retrieval.samples(tok, [800], [0.5], chat=True)[0]
    assert tok.decode(s.context).startswith("<|im_start|>user\n" + retrieval.INTRO)
    assert tok.decode(s.question) == "\nWhat is the pass key?<|im_end|>\n<|im_start|>assistant\nThe pass key is"
    plain = retrieval.samples(tok, [800], [0.5])[0]
    assert tok.decode(plain.question) == "\nWhat is the pass key? The pass key is"
    assert tok.decode(plain.context).startswith(retrieval.INTRO) and plain.key == s.key


def test_bad_requests_are_refused():
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="too short"):
        retrieval.samples(tok, [50], [0.5])
    with pytest.raises(ValueError, match="depth"):
        retrieval.samples(tok, [800], [1.5])
    with pytest.raises(ValueError, match="passkey"):
        retrieval.samples(tok, [800], [0.5], fmt="nope")


def test_the_answer_is_judged_by_its_first_number():
    assert retrieval.extract(" 60494. Remember it.") == "60494"
    assert retrieval.extract(" 6 0 4 9 4 is it") == "60494" and retrieval.extract("a magical key") == ""
    assert retrieval.found(" 60494. Remember it.", "60494") and retrieval.found("\n12345", "12345")
    assert not retrieval.found(" 6049.", "60494") and not retrieval.found(" 1604945", "60494")
    assert not retrieval.found(" 11111, no: 60494", "60494")


def test_run_answers_as_prefilling_context_and_question_through_one_cache():
    model, tok = load_model("tiny")
    names = ["int2 +sinks +clip", "QuantizedCache quanto int2", "int4-kivi"]
    seen = []
    records = retrievalbench.run(model, tok, names, [400], 2, fmt="kv", log=lambda *_: None, on_sample=seen.append)
    assert len(records) == 2 and len(seen) == 2 and [r["depth"] for r in records] == [0.1, 0.9]
    for rec, s in zip(records, retrieval.samples(tok, [400], [0.1, 0.9], fmt="kv")):
        assert rec["key"] == s.key and rec["context"] == 400 and set(rec["found"]) == {"DynamicCache", *names}
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=s.context[None], **cache_arg(cache), use_cache=True)
        assert rec["answers"]["DynamicCache"] == retrieval.answer(model, cache, s, tok)
        assert all(rec["found"][n] == retrieval.found(rec["answers"][n], s.key) for n in rec["found"])
    seen.clear()
    again = retrievalbench.run(model, tok, names, [400], 2, fmt="kv", log=lambda *_: None, on_sample=seen.append,
                               done=records[1:])  # resume: only the missing sample is asked
    assert len(seen) == 1 and sorted(r["key"] for r in again) == sorted(r["key"] for r in records)
    assert [r["answers"] for r in again if r["key"] == records[0]["key"]] == [records[0]["answers"]]
    with pytest.raises(ValueError, match="unknown setup"):
        retrievalbench.run(model, tok, ["nope"], [400], 1)


def test_a_policy_file_is_a_setup_as_its_named_copy_is(tmp_path, monkeypatch):
    """A user's policy YAML given by a path from the working directory answers exactly as the
    same policy under its benchmark name; a missing file or an unknown name is refused before
    anything runs, and a merge of earlier runs does not need the file any more."""
    model, tok = load_model("tiny")
    monkeypatch.chdir(tmp_path)
    mine = Path("mine.yaml")
    mine.write_text((setups.REPO_CONFIGS / "int2-sinks.yaml").read_text())
    records = retrievalbench.run(model, tok, [str(mine), "int2-sinks"], [400], 2, fmt="kv", log=lambda *_: None)
    assert all(r["answers"][str(mine)] == r["answers"]["int2-sinks"] for r in records)
    with pytest.raises(ValueError, match=r"policy file not found: .*gone\.yaml"):
        retrievalbench.run(model, tok, [str(tmp_path / "gone.yaml")], [400], 1)
    with pytest.raises(ValueError, match=r"unknown setup \['int2-sink'\]; allowed: .*or a policy file"):
        retrievalbench.run(model, tok, ["int2-sink"], [400], 1)
    mine.unlink()
    assert f"| {mine} | " in retrievalbench.markdown(records, [str(mine)], {"format": "kv"})


def test_unique_keeps_one_record_per_sample():
    a = {"context": 1024, "depth": 0.1, "key": "12345", "found": {"DynamicCache": True}}
    b = {**a, "depth": 0.9}
    assert retrievalbench.unique([a, b, dict(a, found={})]) == [a, b]


def test_depths_are_asked_spread_out():
    order = retrievalbench.spread_order(10)
    assert sorted(order) == list(range(10)) and order[:3] == [0, 9, 4]
    assert retrievalbench.spread_order(1) == [0] and retrievalbench.spread_order(2) == [0, 1]


def test_table_counts_per_context_and_points_against_full_precision():
    def rec(context, ref, other):
        return {"context": context, "length": context - 3, "found": {"DynamicCache": ref, "int2-kivi": other}}

    records = [rec(1024, True, True), rec(1024, True, False), rec(4096, True, True), rec(4096, False, False)]
    rows = {r["name"]: r for r in retrievalbench.table(records, ["DynamicCache", "int2-kivi"])}
    assert rows["DynamicCache"]["by_length"] == {1024: (2, 2), 4096: (1, 2)} and rows["DynamicCache"]["acc"] == 0.75
    assert rows["int2-kivi"]["acc"] == 0.5 and rows["int2-kivi"]["delta"] == pytest.approx(-25.0)
    text = retrievalbench.markdown(records, ["int2-kivi"], {"format": "passkey"})
    assert rows["int2-kivi"]["kept"] == (2, 3) and rows["DynamicCache"]["kept"] == (3, 3)
    assert "| DynamicCache | 2/2 (100%) | 1/2 (50%) | 3/4 (75%) | +0.0 | 3/3 (100%) |" in text
    assert "| int2-kivi | 1/2 (50%) | 1/2 (50%) | 2/4 (50%) | -25.0 | 2/3 (67%) |" in text


@pytest.mark.parametrize("text", [" 60494.", " 6 0 4 9 4 is", "\n12345\nThe", " 123,", "The key 42 is"])
def test_decoding_stops_only_when_more_tokens_cannot_change_the_verdict(text):
    assert retrieval._settled(text)
    for more in ("", "7", " 7", "99999", " no"):
        assert retrieval.extract(text + more) == retrieval.extract(text)


@pytest.mark.parametrize("text", [" 6049", " 6 0 4", "a magical key", " 60494 ", ""])
def test_decoding_goes_on_while_the_number_may_grow(text):
    assert not retrieval._settled(text)
