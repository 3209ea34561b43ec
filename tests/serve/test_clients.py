"""The server as users run it: a real ``tiercache serve`` (uvicorn) on 127.0.0.1 with ``--api-key``,
driven by the official ``openai`` client, ``langchain-openai`` (``ChatOpenAI`` invoke and stream)
and ``litellm`` (``completion`` with ``api_base``). Loopback only: no proxy, litellm's model cost
map read from its package (``LITELLM_LOCAL_MODEL_COST_MAP``), no tracing.

The reference for every client is the plain HTTP answer (``httpx``) to the same body: a client
that adds, drops or rewrites a field shows up as a different answer."""

from __future__ import annotations

import importlib.util
import os

import httpx
import openai
import pytest

from tiercache.serve.launch import LiveServer

pytestmark = pytest.mark.setup_seconds(30)  # orders the file (tests/conftest.py): a server, then litellm's and langchain's imports (seconds each)

KEY = "sk-tiercache-test"
MSGS = [{"role": "user", "content": "def fibonacci(n):"}]
GREEDY = {"temperature": 0, "max_tokens": 20}

# looked up, not imported: the two packages take seconds to import, paid by the tests that use them
# (after the server fixture has set their environment), not by every worker's collection
if importlib.util.find_spec("langchain_openai") is None or importlib.util.find_spec("litellm") is None:
    pytest.skip("the clients extra: pip install 'tiercache[clients]'", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    for name, value in {"NO_PROXY": "127.0.0.1,localhost", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                        "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false"}.items():
        os.environ[name] = value
    s = LiveServer("--model", "tiny", "--api-key", KEY, log_dir=tmp_path_factory.mktemp("clients"))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60,
                         http_client=httpx.Client(trust_env=False))


def raw(server, body, route="/v1/chat/completions", key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return server.http.post(route, json=body, headers=headers)


def plain_answer(server, **fields) -> str:
    r = raw(server, {"model": "tiny", "messages": MSGS, **GREEDY, **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


# -- the key ----------------------------------------------------------------------------------
def test_the_api_key_is_required_on_v1_routes(server, client):
    for key in (None, "sk-wrong"):
        r = raw(server, {"model": "tiny", "messages": MSGS}, key=key)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert server.http.get("/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {}).status_code == 401
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0, timeout=30,
                        http_client=httpx.Client(trust_env=False))
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2)
    assert server.http.get("/health").status_code == 200  # probes need no key


def test_models_are_listed_and_retrieved(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


# -- the fields, through the openai client ----------------------------------------------------
def test_neutral_values_are_accepted_and_change_nothing(server, client):
    want = plain_answer(server)
    r = client.chat.completions.create(
        model="tiny", messages=MSGS, **GREEDY, logprobs=False, presence_penalty=0, frequency_penalty=0, logit_bias={},
        response_format={"type": "text"}, n=1, seed=None, stop=None, tool_choice="none", parallel_tool_calls=False,
        store=False, metadata={}, user="u1", service_tier="auto", modalities=["text"], top_logprobs=0)
    assert r.choices[0].message.content == want
    c = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0, echo=False, suffix=None,
                                  best_of=1, logprobs=None)
    assert c.choices[0].text == raw(server, {"model": "tiny", "prompt": "x = ", "max_tokens": 5, "temperature": 0},
                                    "/v1/completions").json()["choices"][0]["text"]


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
])
def test_unserved_modes_are_refused_by_name(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=2, **fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param and param in e.value.body["message"]


def test_n_choices_seed_and_fingerprint(client):
    kw = {"model": "tiny", "messages": MSGS, "max_tokens": 16, "temperature": 1.0, "seed": 123}
    a = client.chat.completions.create(n=3, **kw)
    b = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]  # same seed, same answer
    assert len({c.message.content for c in a.choices}) > 1
    assert client.chat.completions.create(n=1, **kw).choices[0].message.content == a.choices[0].message.content
    written = sum(len(c.message.content.encode()) for c in a.choices)  # byte-level: a token per byte
    eos = sum(c.finish_reason == "stop" for c in a.choices)  # an end-of-sequence token each
    assert a.usage.completion_tokens == written + eos
    assert a.system_fingerprint and a.system_fingerprint == b.system_fingerprint
    # streamed: the same choices, each chunk tagged with its index, usage summed at the end
    texts, usage = ["", "", ""], None
    for chunk in client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw):
        assert chunk.system_fingerprint == a.system_fingerprint
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts == [c.message.content for c in a.choices]
    assert usage.completion_tokens == a.usage.completion_tokens and usage.prompt_tokens == a.usage.prompt_tokens


def test_logprobs_describe_the_answer(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, logprobs=True, top_logprobs=20)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content  # ASCII: one byte, one token
    for e in content:
        lps = [t.logprob for t in e.top_logprobs]
        assert len(lps) == 20 and lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert e.token == e.top_logprobs[0].token and e.logprob == pytest.approx(lps[0])  # greedy: the top one
        assert bytes(e.bytes).decode() == e.token
    streamed = []
    for chunk in client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, logprobs=True, top_logprobs=2,
                                                stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in content]
    c = client.completions.create(model="tiny", prompt="x = ", max_tokens=6, temperature=0, logprobs=3)
    lp = c.choices[0].logprobs
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset == list(range(len(lp.tokens)))
    assert all(len(top) == 3 and max(top.values()) == pytest.approx(t) for top, t in zip(lp.top_logprobs,
                                                                                          lp.token_logprobs))


def test_penalties_and_logit_bias_change_the_answer(server, client):
    base = plain_answer(server)
    first = base[0]
    banned = client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, logit_bias={str(ord(first)): -100})
    assert banned.choices[0].message.content and banned.choices[0].message.content[0] != first
    forced = client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, logit_bias={str(ord("Q")): 100})
    assert forced.choices[0].message.content == "Q" * GREEDY["max_tokens"]
    for name in ("presence_penalty", "frequency_penalty"):
        penalised = client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, **{name: 2.0})
        text = penalised.choices[0].message.content
        assert text != base and text == plain_answer(server, **{name: 2.0})  # deterministic at temperature 0
    assert max(base.count(ch) for ch in set(base)) > max(text.count(ch) for ch in set(text))  # fewer repeats


def test_stop_and_include_usage(client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, stop=["\n"])
    assert "\n" not in r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="tiny", messages=MSGS, **GREEDY, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


# -- langchain-openai and litellm -------------------------------------------------------------
def test_langchain_chatopenai_invoke_and_stream(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=KEY, temperature=0, max_tokens=20,
                     max_retries=0, timeout=60, http_client=httpx.Client(trust_env=False))
    want = plain_answer(server)
    msg = llm.invoke("def fibonacci(n):")
    assert msg.content == want
    usage = raw(server, {"model": "tiny", "messages": MSGS, **GREEDY}).json()["usage"]
    assert msg.usage_metadata["output_tokens"] == usage["completion_tokens"]
    assert msg.usage_metadata["input_tokens"] == usage["prompt_tokens"]
    chunks = list(llm.stream("def fibonacci(n):"))
    assert "".join(c.content for c in chunks) == want
    seeded = ChatOpenAI(model="tiny", base_url=server.url + "/v1", api_key=KEY, temperature=0.9, seed=7, max_tokens=12,
                        max_retries=0, timeout=60, http_client=httpx.Client(trust_env=False), logprobs=True)
    a, b = seeded.invoke("import os"), seeded.invoke("import os")
    assert a.content == b.content and a.response_metadata["logprobs"]["content"]


def test_litellm_completion_with_api_base(server):
    import litellm

    kw = {"model": "openai/tiny", "api_base": server.url + "/v1", "api_key": KEY, "messages": MSGS,
          "temperature": 0, "max_tokens": 20, "timeout": 60, "num_retries": 0}
    want = plain_answer(server)
    r = litellm.completion(**kw)
    assert r.choices[0].message.content == want and r.usage.completion_tokens > 0
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw) if c.choices)
    assert streamed == want
    r = litellm.completion(**{**kw, "temperature": 1.0, "seed": 5, "n": 2, "presence_penalty": 0.5})
    again = litellm.completion(**{**kw, "temperature": 1.0, "seed": 5, "n": 2, "presence_penalty": 0.5})
    assert [c.message.content for c in r.choices] == [c.message.content for c in again.choices]
    with pytest.raises(litellm.exceptions.BadRequestError):
        litellm.completion(**{**kw, "response_format": {"type": "json_object"}})
