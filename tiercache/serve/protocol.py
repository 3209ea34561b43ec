"""OpenAI request bodies -> a validated ``Request``; anything wrong -> ``APIError(400)`` naming it.

    parse_chat(body) -> Request          POST /v1/chat/completions
    parse_completion(body) -> Request    POST /v1/completions

Served fields (``null`` means "the default"): ``model``, ``messages`` (chat) / ``prompt``
(completions: a string, a one-string list, or a list of token ids), ``max_tokens`` and
``max_completion_tokens`` (>= 1; default: the room left in the context, at most
``DEFAULT_MAX_TOKENS``), ``temperature`` (0..2, default 1; 0 is greedy), ``top_p`` (0 < p <= 1),
``seed``, ``stop`` (a string or up to 4), ``n`` (1..``MAX_N`` choices), ``presence_penalty`` and
``frequency_penalty`` (-2..2), ``logit_bias`` (token id -> -100..100), ``logprobs`` (chat: true /
false with ``top_logprobs`` 0..20; completions: 0..20 alternatives), ``stream``,
``stream_options`` (``include_usage``; ``include_obfuscation`` accepted, no padding is added),
``user``, and vLLM's ``cache_salt`` (a non-empty string of at most ``MAX_SALT`` characters:
stored prefixes are shared only between requests with the same salt). The documented fields this server does not serve are accepted at their neutral values
and otherwise refused by name (``fields``); any other field is refused by name, never ignored.
Messages: ``role`` one of ``ROLES``; ``content`` a string or a list of ``{"type": "text",
"text": ...}`` parts; ``name`` allowed; ``refusal``, ``audio``, ``tool_calls``, ``function_call``
only when empty. ``Request.logprobs`` is the number of alternatives per token (None: no
log-probabilities). ``Request.tenant`` is not a body field: the HTTP side sets it from the API key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.serve.errors import APIError
from tiercache.serve.fields import allowed, check_message_extras, check_unserved
from tiercache.serve.sampling import MAX_TOP_LOGPROBS

ROLES = ("system", "developer", "user", "assistant")
DEFAULT_MAX_TOKENS = 256
MAX_N = 16
MAX_SALT = 1024
MAX_STOP = 4  # stop sequences
MAX_BIAS = 100  # |logit_bias| per token
# number fields: name -> (default, low, high, low excluded); the OpenAPI schema (``openapi``) reads them too
NUMBERS = {"temperature": (1.0, 0.0, 2.0, False), "top_p": (1.0, 0.0, 1.0, True),
           "presence_penalty": (0.0, -2.0, 2.0, False), "frequency_penalty": (0.0, -2.0, 2.0, False)}
CHAT_FIELDS = allowed("chat")
COMPLETION_FIELDS = allowed("completion")


@dataclass
class Request:
    kind: str  # "chat" | "completion"
    model: str
    messages: list | None = None  # [{"role": str, "content": str}]
    prompt: str | list | None = None  # text or token ids
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict = field(default_factory=dict)  # token id -> added logit
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities
    cache_salt: str | None = None  # stored prefixes are shared only with requests of the same salt
    tenant: str | None = None  # set from the API key (``serve.tenants``), never from the body


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
    return body


def _unsupported(body: dict, kind: str) -> None:
    names = allowed(kind)
    for key in body:
        if key not in names:
            raise _bad(f"unsupported field {key!r}; this server accepts: {', '.join(names)}", key, "unsupported_field")
    check_unserved(body, kind)


def _int(body, key, low=None):
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(f"{key} must be an integer, got {v!r}", key, "invalid_type")
    if low is not None and v < low:
        raise _bad(f"{key} must be >= {low}, got {v}", key)
    return v


def _number(body, key, default, low, high, low_open=False):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"{key} must be a number, got {v!r}", key, "invalid_type")
    if v < low or v > high or (low_open and v == low):
        raise _bad(f"{key} must be in {'(' if low_open else '['}{low}, {high}], got {v}", key)
    return float(v)


def _common(body: dict, kind: str) -> Request:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(f"model must be a non-empty string, got {model!r}", "model", "invalid_type")
    n = _int(body, "n")
    if n is not None and not 1 <= n <= MAX_N:
        raise _bad(f"n must be in [1, {MAX_N}] (choices per request), got {n}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {stream!r}", "stream", "invalid_type")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "include_obfuscation"}:
            raise _bad(f"stream_options must be an object with only include_usage (and include_obfuscation), "
                       f"got {opts!r}", "stream_options")
        for key in opts:
            if opts[key] is not None and not isinstance(opts[key], bool):
                raise _bad(f"stream_options.{key} must be true or false", f"stream_options.{key}", "invalid_type")
        include_usage = bool(opts.get("include_usage"))
        if not stream and any(opts.values()):
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of up to {MAX_STOP}, got {body.get('stop')!r}", "stop",
                   "invalid_type")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad(f"user must be a string, got {user!r}", "user", "invalid_type")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise _bad(f"cache_salt must be a string, got {type(salt).__name__}", "cache_salt", "invalid_type")
    if salt is not None and not 1 <= len(salt) <= MAX_SALT:
        raise _bad(f"cache_salt must be a non-empty string of at most {MAX_SALT} characters, got {len(salt)}",
                   "cache_salt")
    numbers = {name: _number(body, name, *bounds) for name, bounds in NUMBERS.items()}
    return Request(kind=kind, model=model, max_tokens=_int(body, "max_tokens", 1), **numbers,
                   seed=_int(body, "seed"), stop=stop, stream=bool(stream), include_usage=include_usage, user=user,
                   n=n or 1, logit_bias=_logit_bias(body.get("logit_bias")), cache_salt=salt)


def _logit_bias(value) -> dict:
    """``{"token id": bias}`` -> ``{int: float}``; ids are checked against the vocabulary later
    (``check_vocabulary``: the parser does not know the model)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(f"logit_bias must be an object of token id -> bias, got {value!r}", "logit_bias", "invalid_type")
    out = {}
    for key, bias in value.items():
        if not (isinstance(key, str) and key.strip().isascii() and key.strip().isdigit()):
            raise _bad(f"logit_bias key {key!r} is not a token id (a non-negative integer)", "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -MAX_BIAS <= bias <= MAX_BIAS:
            raise _bad(f"logit_bias[{key!r}] must be a number in [-{MAX_BIAS}, {MAX_BIAS}], got {bias!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out


def check_vocabulary(req: Request, vocab_size: int) -> None:
    """``logit_bias`` names only token ids of the model (``vocab_size`` of them)."""
    bad = sorted(t for t in req.logit_bias if t >= vocab_size)
    if bad:
        raise _bad(f"logit_bias token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})", "logit_bias")


def _chat_logprobs(body: dict):
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _bad(f"logprobs must be true or false, got {logprobs!r}", "logprobs", "invalid_type")
    top = _int(body, "top_logprobs", 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise _bad(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs")
    if top and not logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if logprobs else None


def _completion_logprobs(body: dict):
    if body.get("logprobs") is False:  # a neutral value some clients send
        return None
    top = _int(body, "logprobs", 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise _bad(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token), got {top}", "logprobs")
    return top


def parse_chat(body) -> Request:
    body = _object(body)
    _unsupported(body, "chat")
    req = _common(body, "chat")
    req.logprobs = _chat_logprobs(body)
    mct = _int(body, "max_completion_tokens", 1)
    if mct is not None:
        if req.max_tokens is not None and req.max_tokens != mct:
            raise _bad(f"max_tokens ({req.max_tokens}) and max_completion_tokens ({mct}) disagree; give one",
                       "max_completion_tokens")
        req.max_tokens = mct
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad(f"messages must be a list of messages, got {type(messages).__name__}", "messages", "invalid_type")
    if not messages:
        raise _bad("messages is empty; give at least one message", "messages")
    req.messages = [_message(m, i) for i, m in enumerate(messages)]
    return req


def _message(m, i: int) -> dict:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(f"{where} must be an object with role and content, got {m!r}", where, "invalid_type")
    check_message_extras(m, where)
    role = m.get("role")
    if role not in ROLES:
        raise _bad(f"{where}.role {role!r} is not supported; allowed: {', '.join(ROLES)}", f"{where}.role")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           f"{where}.content", "unsupported_content")
            parts.append(part["text"])
        content = "".join(parts)
    if not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text parts, got {content!r}", f"{where}.content",
                   "invalid_type")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise _bad(f"{where}.name must be a string", f"{where}.name", "invalid_type")
    return {"role": role, "content": content}


def parse_completion(body) -> Request:
    body = _object(body)
    _unsupported(body, "completion")
    req = _common(body, "completion")
    req.logprobs = _completion_logprobs(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif not isinstance(prompt, str):
        raise _bad("prompt must be a string, a list of one string, or a list of token ids", "prompt", "invalid_type")
    if not prompt:
        raise _bad("prompt is empty; give at least one character", "prompt")
    req.prompt = prompt
    return req
