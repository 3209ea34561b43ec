"""Every field OpenAI documents for the two generation routes, and what this server does with it.

    SERVED_CHAT, SERVED_COMPLETION      fields ``protocol`` parses and honours
    EXTENSIONS                          fields that are not OpenAI's but vLLM's, served the same way
                                        (``cache_salt``: stored prefixes are found only by requests
                                        with the same salt, of the same tenant)
    INERT                               accepted, typed, and changing nothing in the answer (as at
                                        OpenAI: labels for abuse monitoring, stored completions, caching)
    NEUTRAL                             name -> (accepts(value), why any other value is refused)
    check_unserved(body, kind)          APIError(400, code ``unsupported_value``) naming the first
                                        field whose value asks for something not served
    check_message_extras(message, where)  the same for the extra keys of one chat message

A field in none of these tables is not an OpenAI field: ``protocol`` refuses it by name
(``unsupported_field``), never ignores it. Neutral values (``null``, ``false``, ``0``, ``{}``,
``[]``, ``{"type": "text"}``, ``"none"``) are accepted everywhere they mean "nothing asked".
"""

from __future__ import annotations

from tiercache.serve.errors import APIError

_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options",
           "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user")
SERVED_CHAT = (*_COMMON, "messages", "max_completion_tokens", "top_logprobs")
SERVED_COMPLETION = (*_COMMON, "prompt")
EXTENSIONS = ("cache_salt",)

INERT_CHAT = ("metadata", "prompt_cache_key", "safety_identifier")
INERT_COMPLETION = ()


def _null(v) -> bool:
    return v is None


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


def _text_format(v) -> bool:
    return v is None or v == {"type": "text"}


_NO_TOOLS = "this server does not call tools or functions"
NEUTRAL_CHAT = {
    "tools": (_empty, _NO_TOOLS + "; send no tools (or [])"),
    "tool_choice": (lambda v: v in (None, "none"), _NO_TOOLS + '; tool_choice may only be "none"'),
    "functions": (_empty, _NO_TOOLS + "; send no functions (or [])"),
    "function_call": (lambda v: v in (None, "none"), _NO_TOOLS + '; function_call may only be "none"'),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "parallel_tool_calls must be true or false"),
    "response_format": (_text_format, 'response_format json modes (json_object, json_schema) are not supported; '
                                      'only {"type": "text"}'),
    "audio": (_null, "audio output is not supported; this server answers in text"),
    "modalities": (lambda v: v is None or v == ["text"], 'only text output is served: modalities may only be ["text"]'),
    "prediction": (_null, "predicted outputs are not supported"),
    "reasoning_effort": (_null, "this model does not reason in hidden tokens; send no reasoning_effort"),
    "verbosity": (_null, "verbosity is not supported"),
    "web_search_options": (_null, "web search is not supported"),
    "store": (lambda v: v in (None, False), "stored completions are not supported; store may only be false"),
    "service_tier": (lambda v: v in (None, "auto", "default"), 'there is one service tier: "auto" or "default"'),
    "moderation": (_null, "moderation is not run by this server"),
    "prompt_cache_options": (lambda v: v is None or v == {} or v == {"mode": "implicit"},
                             'the store caches every prompt\'s prefix by itself (mode "implicit"); explicit '
                             "breakpoints and lifetimes are not served"),
    "prompt_cache_retention": (lambda v: v in (None, "in_memory"),
                               'stored prefixes live as long as the store\'s budget allows: only "in_memory"'),
}
NEUTRAL_COMPLETION = {
    "echo": (lambda v: v in (None, False), "echo (the prompt repeated in the answer) is not supported"),
    "suffix": (lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    "best_of": (None, "best_of (server-side candidates) is not supported; it may only equal n"),  # checked below
}

# keys a chat message may carry besides role, content and name, when neutral
MESSAGE_NEUTRAL = {
    "refusal": _null, "audio": _null, "tool_calls": _empty, "function_call": _null,
}


def allowed(kind: str) -> tuple:
    if kind == "chat":
        return (*SERVED_CHAT, *EXTENSIONS, *INERT_CHAT, *NEUTRAL_CHAT)
    return (*SERVED_COMPLETION, *EXTENSIONS, *INERT_COMPLETION, *NEUTRAL_COMPLETION)


def _refuse(name: str, value, why: str) -> APIError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return APIError(400, f"{name} {shown} is not served: {why}", param=name, code="unsupported_value")


def check_unserved(body: dict, kind: str) -> None:
    for name, (accepts, why) in (NEUTRAL_CHAT if kind == "chat" else NEUTRAL_COMPLETION).items():
        if name not in body:
            continue
        value = body[name]
        if name == "best_of":
            n = body.get("n") if body.get("n") is not None else 1
            ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value == n)
        else:
            ok = accepts(value)
        if not ok:
            raise _refuse(name, value, why)
    for name in INERT_CHAT if kind == "chat" else INERT_COMPLETION:
        value = body.get(name)
        if name == "metadata":
            if value is not None and not (isinstance(value, dict) and all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items())):
                raise APIError(400, f"metadata must be an object of strings, got {value!r}", param=name,
                               code="invalid_type")
        elif value is not None and not isinstance(value, str):
            raise APIError(400, f"{name} must be a string, got {value!r}", param=name, code="invalid_type")


def check_message_extras(m: dict, where: str) -> None:
    for key, value in m.items():
        if key in ("role", "content", "name"):
            continue
        accepts = MESSAGE_NEUTRAL.get(key)
        if accepts is None:
            raise APIError(400, f"{where}: unsupported field {key!r}; allowed: role, content, name (and "
                           f"{', '.join(MESSAGE_NEUTRAL)} when empty)", param=f"{where}.{key}", code="unsupported_field")
        if not accepts(value):
            raise _refuse(f"{where}.{key}", value, _NO_TOOLS if "call" in key else f"{key} is not supported")
