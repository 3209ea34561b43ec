"""The OpenAPI 3.1 document of the server (``GET /openapi.json``): ``document(model_name) -> dict``.

Built from the tables the request parser runs by, so the two cannot drift: the property names of
each request body are ``fields.allowed(kind)`` (no others: ``additionalProperties: false``, as the
parser refuses any other field by name); the bounds come from ``protocol`` (``NUMBERS``, ``MAX_N``,
``MAX_STOP``, ``MAX_BIAS``, ``ROLES``) and ``sampling.MAX_TOP_LOGPROBS``; a field served only at its
neutral value is an ``enum`` of the values its ``fields`` predicate accepts (``NEUTRAL_CANDIDATES``
run through it). ``tests/serve/test_openapi.py`` checks the names against the tables and fuzzes a
live server from this document (schemathesis).

What a schema cannot say, the parser still refuses with a 400 naming the field: ``max_tokens`` and
``max_completion_tokens`` that disagree, ``top_logprobs`` without ``logprobs``, ``stream_options``
without ``stream``, ``best_of`` other than ``n``, a prompt past the model's context, token ids
(``prompt``, ``logit_bias``) outside the vocabulary, another model's name (404).

Responses: ``chat.completion`` / ``text_completion`` objects (``application/json``), their chunks
as server-sent events (``text/event-stream``, ``data: {chunk}`` lines ending ``data: [DONE]``),
``{"error": {...}}`` for every refusal, the model card and list, ``/health`` and ``/metrics``.
"""

from __future__ import annotations

from tiercache import __version__
from tiercache.serve import fields
from tiercache.serve.protocol import MAX_BIAS, MAX_N, MAX_SALT, MAX_STOP, NUMBERS, ROLES
from tiercache.serve.sampling import MAX_TOP_LOGPROBS

# values a neutral field may be sent at; each field's enum is those its predicate accepts
NEUTRAL_CANDIDATES = (None, False, True, "", "none", "auto", "default", "in_memory", {}, [], {"type": "text"},
                      {"mode": "implicit"}, ["text"])
_REF = "#/components/schemas/"


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _number(name: str) -> dict:
    default, low, high, low_open = NUMBERS[name]
    bound = {"exclusiveMinimum": low} if low_open else {"minimum": low}
    return _nullable({"type": "number", **bound, "maximum": high, "default": default})


def _int(low: int | None = None, high: int | None = None) -> dict:
    s = {"type": "integer"}
    if low is not None:
        s["minimum"] = low
    if high is not None:
        s["maximum"] = high
    return _nullable(s)


def _neutral(accepts) -> dict:
    return {"enum": [v for v in NEUTRAL_CANDIDATES if accepts(v)]}


def _model(model_name: str | None) -> dict:
    """The served model's id: the one value a request may name (another is a 404)."""
    return {"type": "string", "minLength": 1, **({"enum": [model_name]} if model_name else {}),
            "description": "the served model's id (GET /v1/models)"}


def _common(model_name: str | None) -> dict:
    return {
        "model": _model(model_name),
        "max_tokens": _int(1),
        **{name: _number(name) for name in NUMBERS},
        "seed": _int(),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "maxItems": MAX_STOP,
                                      "items": {"type": "string", "minLength": 1}}]}),
        "n": _int(1, MAX_N),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "additionalProperties": False, "properties": {
            "include_usage": _nullable({"type": "boolean"}),
            "include_obfuscation": _nullable({"type": "boolean"})}}),
        "logit_bias": _nullable({"type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -MAX_BIAS,
                                                          "maximum": MAX_BIAS}}),
        "user": _nullable({"type": "string"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_SALT}),
    }


def _text_parts() -> dict:
    return {"type": "array", "items": {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                                       "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}


def _message() -> dict:
    props = {"role": {"enum": list(ROLES)},
             "content": {"anyOf": [{"type": "string"}, _text_parts()]},
             "name": _nullable({"type": "string"}),
             **{key: _neutral(accepts) for key, accepts in fields.MESSAGE_NEUTRAL.items()}}
    return {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": props}


def _inert(name: str) -> dict:
    if name == "metadata":
        return _nullable({"type": "object", "additionalProperties": {"type": "string"}})
    return _nullable({"type": "string"})


def chat_request(model_name: str | None = None) -> dict:
    props = {**_common(model_name),
             "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
             "max_completion_tokens": _int(1),
             "logprobs": _nullable({"type": "boolean"}),
             "top_logprobs": _int(0, MAX_TOP_LOGPROBS),
             **{name: _inert(name) for name in fields.INERT_CHAT},
             **{name: _neutral(accepts) for name, (accepts, _) in fields.NEUTRAL_CHAT.items()}}
    return {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": {name: props[name] for name in fields.allowed("chat")}}


def completion_request(model_name: str | None = None) -> dict:
    neutral = {name: _neutral(accepts) for name, (accepts, _) in fields.NEUTRAL_COMPLETION.items() if accepts}
    neutral["best_of"] = {**_int(1, MAX_N), "description": "only equal to n (no server-side candidates)"}
    props = {**_common(model_name),
             "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                                  {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string",
                                                                                          "minLength": 1}},
                                  {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}]},
             "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS},
                                    {"const": False}, {"type": "null"}]},
             **{name: _inert(name) for name in fields.INERT_COMPLETION},
             **neutral}
    return {"type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": {name: props[name] for name in fields.allowed("completion")}}


def _usage() -> dict:
    count = {"type": "integer", "minimum": 0}
    return {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
            "properties": {"prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
                           "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": count}}}}


def _head(objects: list) -> dict:
    return {"id": {"type": "string"}, "object": {"enum": objects}, "created": {"type": "integer"},
            "model": {"type": "string"}, "system_fingerprint": {"type": "string"}}


_FINISH = {"enum": ["stop", "length", None]}
_LOGPROBS = {"anyOf": [{"type": "object"}, {"type": "null"}]}


def _completion(chat: bool) -> dict:
    body = ({"message": {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": {"type": "string"}, "refusal": {"type": "null"}}}}
        if chat else {"text": {"type": "string"}})
    choice = {"type": "object", "required": ["index", "finish_reason", *body],
              "properties": {"index": {"type": "integer", "minimum": 0}, **body, "finish_reason": _FINISH,
                             "logprobs": _LOGPROBS}}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {**_head(["chat.completion" if chat else "text_completion"]),
                           "choices": {"type": "array", "items": choice}, "usage": _usage()}}


def _chunk(chat: bool) -> dict:
    body = {"delta": {"type": "object"}} if chat else {"text": {"type": "string"}}
    choice = {"type": "object", "required": ["index", *body],
              "properties": {"index": {"type": "integer"}, **body, "finish_reason": _FINISH, "logprobs": _LOGPROBS}}
    return {"type": "object", "required": ["id", "object", "choices"],
            "properties": {**_head(["chat.completion.chunk" if chat else "text_completion"]),
                           "choices": {"type": "array", "items": choice}, "usage": _nullable(_usage())}}


def _error() -> dict:
    text = _nullable({"type": "string"})
    return {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "param": text, "code": text}}}}


def _model_card() -> dict:
    return {"type": "object", "required": ["id", "object"], "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}}}


def _errors(*codes: int) -> dict:
    why = {400: "a malformed body or a bad field (named in error.param)", 401: "no or a wrong API key",
           404: "another model's name", 413: "a body over the size limit", 429: "the queue is full (Retry-After)",
           500: "generation failed (error.message: internal error (id ...))", 503: "shutting down",
           504: "the request timed out"}
    return {str(c): {"description": why[c], "content": {"application/json": {"schema": _ref("Error")}}} for c in codes}


def _event(chunk: str) -> dict:
    """One server-sent event (OpenAPI 3.1: the ``schema`` of an event stream describes each event)."""
    return {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "description": f"a {chunk} object as JSON (an error event: an Error object), or the "
                                         "final [DONE]"}}}


def _generation(request: str, answer: str, chunk: str, summary: str) -> dict:
    return {"post": {
        "summary": summary, "security": [{}, {"bearer": []}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "the answer; with stream: true, server-sent events of " + chunk +
                                   " objects (data: lines) ending data: [DONE]",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": _event(chunk)}}},
            **_errors(400, 401, 404, 413, 429, 500, 503, 504)}}}


def document(model_name: str | None = None) -> dict:
    json_of = lambda name: {"application/json": {"schema": _ref(name)}}  # noqa: E731
    health = {"type": "object", "required": ["status"], "properties": {
        "status": {"type": "string"}, "model": {"type": "string"}, "queue_length": {"type": "integer"},
        "active_requests": {"type": "integer"}, "store": {"type": "boolean"}}}
    models = {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tiercache serve", "version": __version__,
                 "description": "OpenAI-compatible completions over a memory-tiered KV cache"
                                + (f"; serving {model_name!r}" if model_name else "")},
        "paths": {
            "/v1/chat/completions": _generation("ChatCompletionRequest", "ChatCompletion", "chat.completion.chunk",
                                                "a chat completion"),
            "/v1/completions": _generation("CompletionRequest", "Completion", "text_completion", "a text completion"),
            "/v1/models": {"get": {"summary": "the served model", "security": [{}, {"bearer": []}], "responses": {
                "200": {"description": "a list of one model", "content": json_of("ModelList")}, **_errors(401)}}},
            "/v1/models/{model_id}": {"get": {
                "summary": "one model's card", "security": [{}, {"bearer": []}],
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": _model(model_name)}],
                "responses": {"200": {"description": "the card", "content": json_of("Model")}, **_errors(401, 404)}}},
            "/health": {"get": {"summary": "liveness and load", "responses": {
                "200": {"description": "up", "content": json_of("Health")}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {
                "200": {"description": "the text exposition format", "content": {"text/plain": {"schema": {
                    "type": "string"}}}}, **_errors(404)}}},
        },
        "components": {
            "schemas": {"ChatCompletionRequest": chat_request(model_name),
                        "CompletionRequest": completion_request(model_name),
                        "ChatMessage": _message(), "ChatCompletion": _completion(True), "Completion": _completion(False),
                        "ChatCompletionChunk": _chunk(True), "CompletionChunk": _chunk(False), "Error": _error(),
                        "Model": _model_card(), "ModelList": models, "Health": health},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "with --api-key: Authorization: Bearer <key>"}},
        },
    }
