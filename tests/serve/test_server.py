"""The real server in a subprocess on 127.0.0.1, driven by the official ``openai`` client.

Three servers start once for the module: the store on (the default budget), ``--no-store`` (the
reference: every prompt prefilled in full), and a tiny budget with a lossless ladder (host, then
disk) that forces demotions and evictions, with ``--persist DIR`` (restarted by the last test)."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
from tiercache.serve.launch import LiveServer as Server

pytestmark = pytest.mark.setup_seconds(30)  # orders the file (tests/conftest.py): its module fixtures start servers (~15 s) before the first test

GREEDY = {"temperature": 0, "max_tokens": 24}
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 24}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    (d / "tiny-store.yaml").write_text(json.dumps({
        "budget": {"device": "2.5MiB", "host": "1.5MiB", "disk": "1.5MiB"},  # 1 MiB per entry
        "ladder": [{"name": "host", "offload": {"device": "cpu"}},
                   {"name": "disk", "offload": {"device": "disk", "path": str(d / "disk")}}],
        "block_size": 8, "min_match": 8}))
    started = {"store": Server("--model", "tiny", log_dir=d),
               "plain": Server("--model", "tiny", "--no-store", log_dir=d),
               "tight": Server("--model", "tiny", "--store", str(d / "tiny-store.yaml"), "--max-active", "2",
                               "--persist", str(d / "persisted"), log_dir=d)}
    live = dict(started)  # tests may replace one (a restart)
    try:
        for s in started.values():
            s.wait_ready()
        yield live
    finally:
        for s in {*started.values(), *live.values()}:
            s.stop()


def wait_idle(server, seconds: float = 20.0) -> None:
    """Until the worker has handed its last cache back (that happens after the answer is sent)."""
    end = time.monotonic() + seconds
    while server.http.get("/health").json()["active_requests"] and time.monotonic() < end:
        time.sleep(0.05)


def chat(server, messages, **kw):
    r = server.client().chat.completions.create(model="tiny", messages=messages, **{**GREEDY, **kw})
    return r.choices[0].message.content, r.usage


def conversation(server, questions, reference=None, **kw):
    """Turns of one chat; with ``reference``, each turn's history is sent to it too and must get
    the same answer. Returns [(answer, usage)] of ``server``."""
    messages, turns = [], []
    for q in questions:
        messages.append({"role": "user", "content": q})
        answer, usage = chat(server, messages, **kw)
        if reference is not None:
            assert chat(reference, messages, **kw)[0] == answer, f"turn {len(turns) + 1} differs from --no-store"
        turns.append((answer, usage))
        messages.append({"role": "assistant", "content": answer})
    return turns


QUESTIONS = ["def fibonacci(n):", "Now write it with a loop.", "import os\nprint(os.getcwd())"]


@pytest.mark.parametrize("sampling", [GREEDY, {**SAMPLED, "seed": 5}], ids=["greedy", "seeded-sampling"])
def test_turns_reuse_the_cache_and_answer_as_without_store(servers, sampling):
    qs = [f"({sampling['temperature']}) {q}" for q in QUESTIONS]  # its own conversation from the first token
    turns = conversation(servers["store"], qs, reference=servers["plain"], **sampling)
    assert turns[0][1].prompt_tokens_details.cached_tokens == 0
    for (_, before), (_, after) in zip(turns, turns[1:]):
        # the next turn reuses the whole previous prompt and answer
        assert after.prompt_tokens_details.cached_tokens >= before.prompt_tokens + before.completion_tokens - 1
        assert after.prompt_tokens_details.cached_tokens < after.prompt_tokens
    plain = conversation(servers["plain"], qs, **sampling)
    assert all(u.prompt_tokens_details.cached_tokens == 0 for _, u in plain)


def test_streaming_equals_non_streaming(servers):
    s = servers["store"]
    client = s.client()
    messages = [{"role": "user", "content": "class Stack:"}]
    for kw in (GREEDY, {**SAMPLED, "seed": 11}, {**SAMPLED, "seed": 3, "stop": ["  ", "e"]}):
        full = client.chat.completions.create(model="tiny", messages=messages, **kw)
        stream = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kw)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == full.choices[0].message.content
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
        comp = client.completions.create(model="tiny", prompt="def parse(path):\n", **kw)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model="tiny", prompt="def parse(path):\n", stream=True, **kw))
        assert streamed == comp.choices[0].text
    raw = s.http.post("/v1/completions", json={"model": "tiny", "prompt": "x = ", "max_tokens": 3, "stream": True})
    assert raw.text.rstrip().endswith("data: [DONE]")


def test_eight_conversations_at_once_each_get_what_they_get_alone(servers):
    qs = [[f"def task_{i}(x):", f"Make task_{i} faster."] for i in range(8)]
    alone = [conversation(servers["plain"], q, **SAMPLED, seed=i) for i, q in enumerate(qs)]
    results, errors = [None] * 8, []

    def run(i):
        try:
            results[i] = conversation(servers["store"], qs[i], **SAMPLED, seed=i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and all(r is not None for r in results)
    for got, want in zip(results, alone):
        assert [a for a, _ in got] == [a for a, _ in want]
        assert got[1][1].prompt_tokens_details.cached_tokens > 0


def test_a_tiny_budget_demotes_and_evicts_and_answers_stay_right(servers):
    tight, plain = servers["tight"], servers["plain"]
    for i in range(5):
        conversation(tight, [f"# module {i}", "continue"], reference=plain)
    wait_idle(tight)
    m = tight.metrics()
    assert m["tiercache_store_demotions_total"] > 0 and m["tiercache_store_evictions_total"] > 0
    for tier, budget in (("device", 2.5), ("host", 1.5), ("disk", 1.5)):
        assert m[f'tiercache_store_bytes{{tier="{tier}"}}'] <= budget * 2**20
    # the oldest conversation was evicted: asked again, it is prefilled and answered the same
    conversation(tight, ["# module 0", "continue"], reference=plain)


BAD = [
    pytest.param(b'{"model": "tiny", "messages": [', 400, None, "not valid JSON", id="malformed-json"),
    pytest.param(b'{"model": "tiny", "messages": "\xff\xfe"}', 400, None, "not valid UTF-8", id="not-utf8"),
    pytest.param(b'{"model": "tiny", "temperature": NaN, "messages": []}', 400, None, "not valid JSON", id="nan"),
    pytest.param(b"[1, 2]", 400, None, "JSON object", id="not-an-object"),
    pytest.param({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model", "not found",
                 id="unknown-model"),
    pytest.param({"model": "tiny", "messages": []}, 400, "messages", "empty", id="empty-messages"),
    pytest.param({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role",
                 "wizard", id="unknown-role"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}, 400, "messages",
                 "context is 4096", id="prompt-over-context"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400,
                 "max_tokens", ">= 1", id="max-tokens-zero"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400,
                 "max_tokens", "at most", id="max-tokens-past-context"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400,
                 "temperature", "number", id="wrong-type-temperature"),
    pytest.param({"model": "tiny", "messages": "hi"}, 400, "messages", "list", id="wrong-type-messages"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
                 "string", id="wrong-type-content"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400,
                 "stream", "true or false", id="wrong-type-stream"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs_please": True}, 400,
                 "logprobs_please", "unsupported field", id="unsupported-field"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
                 400, "tools", "not served", id="tools-refused"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "n",
                 "n must be in [1, 16]", id="n-99"),
    pytest.param({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999": 1}}, 400,
                 "logit_bias", "outside the vocabulary", id="logit-bias-outside-vocabulary"),
]


@pytest.mark.parametrize("body, status, param, words", BAD)
def test_bad_input_gets_an_openai_error_and_the_server_goes_on(servers, body, status, param, words):
    s = servers["store"]
    wait_idle(s)
    before = {k: v for k, v in s.metrics().items() if k.startswith("tiercache_store_")}
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = s.http.post("/v1/chat/completions", headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and words in err["message"] and err["param"] == param
    after = {k: v for k, v in s.metrics().items() if k.startswith("tiercache_store_")}
    assert after == before  # a bad request never touches the store
    assert chat(s, [{"role": "user", "content": "still there?"}], max_tokens=2)[0] is not None


def test_the_openai_client_sees_the_errors(servers):
    client = servers["store"].client()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], top_p=0)


def test_oversized_body_and_wrong_method(servers):
    s = servers["store"]
    r = s.http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}')
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = s.http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert s.http.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert s.http.get("/health").json()["status"] == "ok"


def test_a_client_that_disconnects_cancels_its_generation(servers):
    s = servers["store"]
    body = {"model": "tiny", "prompt": "def main():\n", "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.Client(base_url=s.url, timeout=30, trust_env=False) as c, c.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_idle(s, 10.0)  # 3000 tokens would take far longer than this
    assert s.http.get("/health").json()["active_requests"] == 0
    assert chat(s, [{"role": "user", "content": "after a cancel"}], max_tokens=2)[0] is not None


def test_persisted_entries_survive_a_restart(servers, tmp_path):
    s, plain = servers["tight"], servers["plain"]
    messages = [{"role": "user", "content": "def survive_a_restart():"}]
    first, usage = chat(s, messages)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "and again"}]
    wait_idle(s)
    log = s.stop()  # SIGTERM: a graceful shutdown saves the store
    assert re.search(r"persist: saved [1-9]\d* entries", log), log
    flags = s.proc.args[s.proc.args.index("serve") + 1:]
    again = Server(*[f for f in flags if f not in ("--port", str(s.port), "--host", "127.0.0.1")],
                   log_dir=tmp_path).wait_ready()
    servers["tight"] = again  # the fixture stops it
    assert re.search(r"persist: loaded [1-9]\d* entries", again.log())
    answer, after = chat(again, messages)
    assert after.prompt_tokens_details.cached_tokens >= usage.prompt_tokens + usage.completion_tokens - 1
    assert answer == chat(plain, messages)[0]
