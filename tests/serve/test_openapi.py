"""``GET /openapi.json``: a document of the real request and response bodies, built from the
parser's tables (names, bounds, neutral values), and schemathesis fuzzing a live server from it:
no input is a server error, every answer has a declared content type and schema, and the server
answers a normal request exactly as before afterwards."""

from __future__ import annotations

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.serve import fields
from tiercache.serve.errors import APIError
from tiercache.serve.launch import LiveServer
from tiercache.serve.openapi import document
from tiercache.serve.protocol import MAX_N, NUMBERS, parse_chat, parse_completion
from tiercache.serve.sampling import MAX_TOP_LOGPROBS

DOC = document("tiny")
SCHEMAS = DOC["components"]["schemas"]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "tiny", "prompt": "hi"}


def test_request_bodies_name_exactly_the_fields_the_parser_takes():
    for kind, name in (("chat", "ChatCompletionRequest"), ("completion", "CompletionRequest")):
        schema = SCHEMAS[name]
        assert set(schema["properties"]) == set(fields.allowed(kind)) and schema["additionalProperties"] is False
    chat = SCHEMAS["ChatCompletionRequest"]["properties"]
    assert chat["n"]["anyOf"][0]["maximum"] == MAX_N and chat["top_logprobs"]["anyOf"][0]["maximum"] == MAX_TOP_LOGPROBS
    for number, (_, low, high, _) in NUMBERS.items():
        bound = chat[number]["anyOf"][0]
        assert bound.get("minimum", bound.get("exclusiveMinimum")) == low and bound["maximum"] == high


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_neutral_value_of_the_schema_is_accepted_and_no_other(kind):
    parse, base = (parse_chat, CHAT) if kind == "chat" else (parse_completion, COMPLETION)
    props = SCHEMAS["ChatCompletionRequest" if kind == "chat" else "CompletionRequest"]["properties"]
    table = fields.NEUTRAL_CHAT if kind == "chat" else fields.NEUTRAL_COMPLETION
    for name in table:
        for value in props[name].get("enum", []):
            parse({**base, name: value})  # accepted
        for value in ("something", 3, {"x": 1}):
            if value not in props[name].get("enum", [value]):
                with pytest.raises(APIError):
                    parse({**base, name: value})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = LiveServer("--model", "tiny", log_dir=tmp_path_factory.mktemp("openapi"))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def greedy(server) -> tuple:
    chat = server.http.post("/v1/chat/completions", json={**CHAT, "temperature": 0, "max_tokens": 12}).json()
    text = server.http.post("/v1/completions", json={**COMPLETION, "temperature": 0, "max_tokens": 12}).json()
    return chat["choices"][0]["message"]["content"], text["choices"][0]["text"]


def test_the_server_publishes_its_document(server):
    r = server.http.get("/openapi.json")
    assert r.status_code == 200 and r.json() == DOC


CAP = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}  # the fuzzer is after the input handling,
                                                             # not long answers


def _capped(case):
    """Caps the answer's length and count; a body that names no length gets ``max_tokens: 4`` (else
    the server's default, 256 tokens, would make most of the fuzzer's time the tiny model decoding)."""
    if isinstance(case.body, dict):
        for key, most in CAP.items():
            value = case.body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                case.body[key] = most
        if case.method.upper() == "POST" and not {"max_tokens", "max_completion_tokens"} & set(case.body):
            case.body["max_tokens"] = CAP["max_tokens"]
    return case


@pytest.mark.slow(seconds=60)
def test_schemathesis_finds_no_server_error_and_the_server_answers_as_before(server):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

    before = greedy(server)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    session = requests.Session()
    session.trust_env = False
    checks = [not_a_server_error, content_type_conformance, response_schema_conformance]
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {op.label for op in ops} >= {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"}
    counts = {}
    for op in ops:
        generation = op.as_strategy(GenerationMode.POSITIVE) | op.as_strategy(GenerationMode.NEGATIVE)
        many = op.method.upper() == "POST"

        @settings(max_examples=120 if many else 15, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(generation)
        def run(case):
            response = _capped(case).call(base_url=server.url, session=session, timeout=60)
            counts[op.label] = counts.get(op.label, 0) + 1
            case.validate_response(response, checks=checks)

        run()
    assert sum(counts.values()) >= 250, counts
    assert server.http.get("/health").json()["status"] == "ok"
    assert greedy(server) == before  # alive, and the same greedy answers
