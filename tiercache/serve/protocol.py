"""OpenAI request bodies -> a validated ``Request``; anything wrong -> ``APIError(400)`` naming it.

    parse_chat(body) -> Request          POST /v1/chat/completions
    parse_completion(body) -> Request    POST /v1/completions

Accepted fields (``null`` means "the default"): ``model``, ``messages`` (chat) / ``prompt``
(completions: a string, a one-string list, or a list of token ids), ``max_tokens`` and
``max_completion_tokens`` (>= 1; default: the room left in the context, at most
``DEFAULT_MAX_TOKENS``), ``temperature`` (0..2, default 1; 0 is greedy), ``top_p`` (0 < p <= 1),
``seed``, ``stop`` (a string or up to 4), ``n`` (1 only), ``stream``, ``stream_options``
(``include_usage``), ``user``. Any other field is refused by name, never ignored.
Messages: ``role`` one of ``ROLES``; ``content`` a string or a list of ``{"type": "text",
"text": ...}`` parts; ``name`` allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.serve.errors import APIError

ROLES = ("system", "developer", "user", "assistant")
DEFAULT_MAX_TOKENS = 256
_COMMON = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "stream", "stream_options", "user")
CHAT_FIELDS = (*_COMMON, "messages", "max_completion_tokens")
COMPLETION_FIELDS = (*_COMMON, "prompt")


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


def _bad(message: str, param: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None, "invalid_type")
    return body


def _unsupported(body: dict, allowed) -> None:
    for key in body:
        if key not in allowed:
            raise _bad(f"unsupported field {key!r}; this server accepts: {', '.join(allowed)}", key, "unsupported_field")


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
    if n is not None and n != 1:
        raise _bad(f"n must be 1 (one choice per request), got {n}", "n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream must be true or false, got {stream!r}", "stream", "invalid_type")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise _bad(f"stream_options must be an object with only include_usage, got {opts!r}", "stream_options")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise _bad("stream_options.include_usage must be true or false", "stream_options.include_usage", "invalid_type")
        if not stream:
            raise _bad("stream_options is only allowed with stream: true", "stream_options")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise _bad(f"stop must be a non-empty string or a list of up to 4, got {body.get('stop')!r}", "stop", "invalid_type")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad(f"user must be a string, got {user!r}", "user", "invalid_type")
    return Request(kind=kind, model=model, max_tokens=_int(body, "max_tokens", 1),
                   temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
                   top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
                   seed=_int(body, "seed"), stop=stop, stream=bool(stream), include_usage=include_usage, user=user)


def parse_chat(body) -> Request:
    body = _object(body)
    _unsupported(body, CHAT_FIELDS)
    req = _common(body, "chat")
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
    for key in m:
        if key not in ("role", "content", "name"):
            raise _bad(f"{where}: unsupported field {key!r}; allowed: role, content, name", f"{where}.{key}",
                       "unsupported_field")
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
    _unsupported(body, COMPLETION_FIELDS)
    req = _common(body, "completion")
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
