"""``sampling.Sampler`` against plain torch formulas, the fields table of ``protocol`` / ``fields``,
and ``n`` choices forked from one prefill against runs of their own (the tiny random model with a
plain ``DynamicCache`` and the same sampler: the fork must not change a single token)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from tiercache.cache.compat import cache_arg
from tiercache.models.load import load_model
from tiercache.policy.schema import load_policy
from tiercache.serve.chat import Codec
from tiercache.serve.errors import APIError
from tiercache.serve.fields import NEUTRAL_CHAT, NEUTRAL_COMPLETION
from tiercache.serve.protocol import check_vocabulary, parse_chat, parse_completion
from tiercache.serve.sampling import MAX_TOP_LOGPROBS, Sampler
from tiercache.serve.store import PrefixStore
from tiercache.serve.worker import Worker

MSG = [{"role": "user", "content": "hi"}]
EOS = 257


class ByteCodec:
    byte_level, eos_ids = True, {EOS}

    @staticmethod
    def decode(ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def request(**fields):
    return parse_completion({"model": "m", "prompt": "x", **fields})


def logits_row(seed=0, v=259):
    return torch.randn(v, generator=torch.Generator().manual_seed(seed)) * 3  # [V]


# -- the sampler ------------------------------------------------------------------------------
def test_penalties_and_bias_follow_openais_formula():
    req = request(temperature=0, presence_penalty=0.7, frequency_penalty=1.3, logit_bias={"5": 4.0, "9": -2.5},
                  logprobs=3)
    s = Sampler(req, ByteCodec, "cpu")
    counts = torch.zeros(259)
    bias = torch.zeros(259)
    bias[5], bias[9] = 4.0, -2.5
    for step in range(12):
        row = logits_row(step % 3)  # repeated rows: penalties must change the picks
        want = row - 1.3 * counts - 0.7 * (counts > 0).float() + bias
        token = s.pick(row)
        assert token == int(torch.argmax(want))
        entry = s.take()["logprobs"][0]
        ref = torch.log_softmax(want, -1)
        assert entry["id"] == token and entry["logprob"] == pytest.approx(float(ref[token]), abs=1e-5)
        assert [t[0] for t in entry["top"]] == torch.topk(ref, 3).indices.tolist()
        counts[token] += 1
    assert len(set(counts.nonzero().flatten().tolist())) > 1  # the penalties moved greedy off one token


@pytest.mark.parametrize("limit", [{"temperature": 1e-300}, {"temperature": 5e-324}, {"top_p": 5e-324},
                                   {"top_p": 1e-300, "temperature": 2.0}])
def test_a_vanishing_temperature_or_top_p_is_the_greedy_limit(limit):
    # logits / 1e-300 overflow to inf (softmax: NaN) and a top_p under float32's smallest number kept
    # no token at all: both were a 500 (found by schemathesis); their limit is the argmax
    row = logits_row(2)
    s = Sampler(request(seed=1, **limit), ByteCodec, "cpu")
    assert [s.pick(row) for _ in range(5)] == [int(torch.argmax(row))] * 5


def test_logit_bias_bans_and_forces():
    row = logits_row(1)
    top = int(torch.argmax(row))
    assert Sampler(request(temperature=0, logit_bias={str(top): -100}), ByteCodec, "cpu").pick(row) != top
    forced = Sampler(request(temperature=1.0, seed=3, logit_bias={"42": 100}), ByteCodec, "cpu")
    assert {forced.pick(row) for _ in range(20)} == {42}


def test_same_seed_same_tokens_and_choices_differ():
    def draw(seed, choice):
        s = Sampler(request(temperature=1.0, top_p=0.9, seed=seed), ByteCodec, "cpu", choice)
        return [s.pick(logits_row(i)) for i in range(30)]

    assert draw(7, 0) == draw(7, 0) and draw(7, 2) == draw(7, 2)
    assert draw(7, 0) != draw(8, 0) and draw(7, 0) != draw(7, 1)


def test_logprobs_entries_skip_eos_and_carry_bytes():
    row = torch.full((259,), -10.0)
    row[EOS] = 10.0
    s = Sampler(request(temperature=0, logprobs=MAX_TOP_LOGPROBS), ByteCodec, "cpu")
    assert s.pick(row) == EOS and s.take() == {"logprobs": []}
    row = torch.full((259,), -10.0)
    row[0xC3] = 10.0  # the first byte of a two-byte character: text U+FFFD, its true byte kept
    s.pick(row)
    entry = s.take()["logprobs"][0]
    assert entry["token"] == "\ufffd" and entry["bytes"] == [0xC3] and len(entry["top"]) == MAX_TOP_LOGPROBS
    assert Sampler(request(), ByteCodec, "cpu").take() == {}  # not asked for: nothing


# -- the fields -------------------------------------------------------------------------------
NEUTRAL_VALUES = {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none",
                  "parallel_tool_calls": False, "response_format": {"type": "text"}, "audio": None,
                  "modalities": ["text"], "prediction": None, "reasoning_effort": None, "verbosity": None,
                  "web_search_options": None, "store": False, "service_tier": "auto", "echo": False, "suffix": "",
                  "best_of": 1, "moderation": None, "prompt_cache_options": {}, "prompt_cache_retention": "in_memory"}
SERVED_NONE = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto",
               "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": "yes",
               "response_format": {"type": "json_object"}, "audio": {"voice": "alloy", "format": "wav"},
               "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
               "reasoning_effort": "high", "verbosity": "low", "web_search_options": {}, "store": True,
               "service_tier": "flex", "echo": True, "suffix": "}", "best_of": 3,
               "moderation": {"model": "omni-moderation-latest"}, "prompt_cache_options": {"mode": "explicit"},
               "prompt_cache_retention": "24h"}


@pytest.mark.parametrize("name", [*NEUTRAL_CHAT, *NEUTRAL_COMPLETION])
def test_every_unserved_field_takes_its_neutral_value_and_is_refused_by_name_otherwise(name):
    parse = parse_chat if name in NEUTRAL_CHAT else parse_completion
    base = {"model": "m", "messages": MSG} if name in NEUTRAL_CHAT else {"model": "m", "prompt": "x"}
    parse({**base, name: NEUTRAL_VALUES[name]})
    parse({**base, name: None})
    with pytest.raises(APIError) as e:
        parse({**base, name: SERVED_NONE[name]})
    assert e.value.status == 400 and e.value.param == name and name in e.value.message


def test_every_field_of_the_openai_client_is_in_the_table():
    import inspect

    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    from tiercache.serve.fields import allowed

    for create, kind in ((Chat.create, "chat"), (Completions.create, "completion")):
        names = [p for p in inspect.signature(create).parameters
                 if p not in ("self", "timeout") and not p.startswith("extra_")]
        assert sorted(set(names) - set(allowed(kind))) == [], kind


def test_json_schema_is_refused_by_name_and_neutral_served_values_pass():
    with pytest.raises(APIError, match="json modes") as e:
        parse_chat({"model": "m", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert e.value.param == "response_format"
    req = parse_chat({"model": "m", "messages": MSG, "logprobs": False, "top_logprobs": 0, "presence_penalty": 0,
                      "frequency_penalty": 0, "logit_bias": {}, "n": 1, "seed": None, "stop": None, "user": None,
                      "metadata": {}, "stream_options": None, "prompt_cache_key": "k", "safety_identifier": "u"})
    assert (req.logprobs, req.presence_penalty, req.logit_bias, req.n) == (None, 0.0, {}, 1)
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": 0}).logprobs == 0
    assert not parse_chat({"model": "m", "messages": MSG, "stream_options": {"include_usage": False}}).include_usage
    with pytest.raises(APIError, match="only allowed with stream: true"):
        parse_chat({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}})
    assert parse_completion({"model": "m", "prompt": "x", "logprobs": False}).logprobs is None
    assert parse_chat({"model": "m", "messages": [{"role": "assistant", "content": "a", "tool_calls": [],
                                                   "refusal": None}]}).messages[0]["content"] == "a"


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"), ({"n": 17}, "n"), ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 2}, "logprobs"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "x"}, "frequency_penalty"), ({"logit_bias": {"a": 1}}, "logit_bias"),
    ({"logit_bias": {"3": 101}}, "logit_bias"), ({"wizardry": 1}, "wizardry"), ({"metadata": {"a": 1}}, "metadata"),
    ({"messages": [{"role": "assistant", "content": "a", "tool_calls": [{"id": "x"}]}]}, "messages[0].tool_calls"),
])
def test_bad_served_fields_name_themselves(fields, param):
    with pytest.raises(APIError) as e:
        parse_chat({"model": "m", "messages": MSG, **fields})
    assert e.value.status == 400 and e.value.param == param


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    check_vocabulary(request(logit_bias={"258": 1}), 259)
    with pytest.raises(APIError, match="259 is outside the vocabulary") as e:
        check_vocabulary(request(logit_bias={"259": 1}), 259)
    assert e.value.param == "logit_bias"


# -- n: choices forked from one prefill -------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random")
    return model, Codec(tok)


def alone(model, codec, req, ids, choice):
    """Choice ``choice`` run by itself: a plain DynamicCache, the same sampler."""
    sampler, cache, out = Sampler(req, codec, "cpu", choice), DynamicCache(), []
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(req.max_tokens):
            logits = model(input_ids=x, **cache_arg(cache), use_cache=True).logits[0, -1]  # [V]
            token = sampler.pick(logits)
            out.append(token)
            if token in codec.eos_ids:
                break
            x = torch.tensor([[token]])
    return codec.decode([t for t in out if t not in codec.eos_ids]), [e["logprob"] for e in sampler.take()["logprobs"]]


def events_of(worker, req):
    events, finished = [], threading.Event()

    def emit(kind, **data):
        events.append((kind, data))
        if kind == "error" or sum(k == "done" for k, _ in events) == req.n:
            finished.set()

    job = worker.prepare(req, emit)
    worker.submit(job)
    assert finished.wait(60), "no answer in time"
    return events, job


def wait_idle(worker):
    for _ in range(500):
        if worker.active == 0 and worker.queue_length == 0:
            return
        threading.Event().wait(0.02)
    raise AssertionError("the worker is still busy")


def run(worker, req, ids):
    events, _ = events_of(worker, req)
    assert all(k != "error" for k, _ in events), events
    texts = ["".join(d["text"] for k, d in events if k == "delta" and d.get("index", 0) == i) for i in range(req.n)]
    lps = [[e["logprob"] for k, d in events if d.get("index", 0) == i for e in d.get("logprobs", ())]
           for i in range(req.n)]
    return texts, lps


@pytest.mark.parametrize("with_store", [True, False], ids=["store", "no-store"])
def test_n_choices_fork_the_prompt_and_each_equals_its_run_alone(tiny, with_store):
    model, codec = tiny
    policy = load_policy({"name": "full"})
    store = PrefixStore([policy], {"device": 64 * 2**20}, lambda c: c.tier_nbytes(), block_size=8, min_match=4) \
        if with_store else None
    w = Worker(model, codec, policy, model_name="m", store=store, max_active=2)  # fewer slots than choices
    w.start()
    try:
        ids = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(4)).tolist()
        req = parse_completion({"model": "m", "prompt": ids, "max_tokens": 14, "n": 4, "seed": 9, "temperature": 0.8,
                                "presence_penalty": 0.4, "logprobs": 2})
        texts, lps = run(w, req, ids)
        wait_idle(w)  # the worker's steps switch the model's attention to the packed one: not while `alone` runs
        for i in range(4):
            want_text, want_lps = alone(model, codec, req, ids, i)
            assert texts[i] == want_text, f"choice {i}"
            assert lps[i] == pytest.approx(want_lps, abs=1e-4)
        assert len(set(texts)) > 1  # the choices are not copies of one another
        if with_store:
            for _ in range(200):  # the caches come back after the answer
                if w.active == 0:
                    break
                threading.Event().wait(0.02)
            assert len(store) == 1  # one entry per request (choice 0's)
            assert not any(store.stats()["reserved"].values())  # every choice's share came back
            one = w.prepare(parse_completion({"model": "m", "prompt": ids, "max_tokens": 14}), None).need
            assert w.prepare(req, None).need == {t: 4 * v for t, v in one.items()} and any(one.values())
    finally:
        w.stop()


def test_a_failed_fork_or_choice_fails_the_request_and_returns_every_reservation(tiny, monkeypatch):
    from tiercache.cache.tiered import TieredCache

    model, codec = tiny
    policy = load_policy({"name": "full"})
    store = PrefixStore([policy], {"device": 64 * 2**20}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    w = Worker(model, codec, policy, model_name="m", store=store, max_active=4)
    real_fork, forks = TieredCache.fork, []

    def flaky_fork(cache):
        forks.append(cache)
        if len(forks) == 2:
            raise RuntimeError("injected fork fault")
        return real_fork(cache)

    monkeypatch.setattr(TieredCache, "fork", flaky_fork)
    w.start()
    try:
        ids = list(range(60, 90))
        req = parse_completion({"model": "m", "prompt": ids, "max_tokens": 30, "n": 3, "temperature": 0})
        events, job = events_of(w, req)
        message = events[-1][1]["error"].message  # (the fault's text is in the server's log, not the answer)
        assert events[-1][0] == "error" and "internal error (id " in message and "injected" not in message
        job.cancel()  # what the app does on an error: the other choices stop
        wait_idle(w)
        assert not any(store.stats()["reserved"].values())
        monkeypatch.setattr(TieredCache, "fork", real_fork)
        from tiercache.serve.sequence import Sequence

        real_advance, faults = Sequence.advance, []

        def advance(seq, row, logits, token=None):  # choice 2's part of its first decode step fails
            if seq.choice == 2 and not faults:
                faults.append(seq)
                raise RuntimeError("injected step fault")
            return real_advance(seq, row, logits, token)

        monkeypatch.setattr(Sequence, "advance", advance)
        events, job = events_of(w, req)
        assert events[-1][0] == "error" and events[-1][1].get("index") == 2
        job.cancel()
        wait_idle(w)
        assert not any(store.stats()["reserved"].values())
        monkeypatch.setattr(Sequence, "advance", real_advance)
        texts, _ = run(w, req, ids)  # the server goes on
        assert texts[0] == texts[1] == texts[2] != ""  # greedy: the same answer three times
    finally:
        w.stop()


def test_a_batch_picks_what_each_row_picks_alone():
    """``pick_rows`` over rows of different settings (greedy, seeded sampling, ``top_p``, penalties and
    bias, log-probabilities, a vanishing temperature) = each row's own ``Sampler.pick``, step after step."""
    from tiercache.serve.sampling import pick_rows

    settings = [dict(temperature=0), dict(temperature=0.8, seed=3), dict(temperature=1.2, top_p=0.5, seed=4, logprobs=2),
                dict(temperature=0, presence_penalty=0.9, frequency_penalty=0.4, logit_bias={"7": 3.0}, logprobs=5),
                dict(temperature=1e-30, seed=5, logprobs=0), dict(temperature=0.7, seed=6, frequency_penalty=1.0)]
    batch = [Sampler(request(**kw), ByteCodec, "cpu") for kw in settings]
    alone = [Sampler(request(**kw), ByteCodec, "cpu") for kw in settings]
    for step in range(8):
        rows = torch.stack([logits_row(step % 2 + r) for r in range(len(settings))])  # [R, V]
        rows[3, EOS] = 50.0 if step == 5 else rows[3, EOS]  # an end-of-sequence pick: no entry
        got = pick_rows(batch, rows)
        want = [s.pick(rows[r]) for r, s in enumerate(alone)]
        assert got == want, step
        for a, b in zip(batch, alone):
            ea, eb = a.take().get("logprobs"), b.take().get("logprobs")
            assert (ea is None) == (eb is None)
            for x, y in zip(ea or [], eb or []):
                assert x["id"] == y["id"] and x["logprob"] == pytest.approx(y["logprob"], abs=1e-5)
                assert [t[0] for t in x["top"]] == [t[0] for t in y["top"]]
    assert len({tuple(s.counts.tolist()) for s in batch if s.counts is not None}) == 2  # penalties counted per row
