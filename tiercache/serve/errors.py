"""``APIError``: a request the server refuses, as OpenAI-style JSON.

    raise APIError(400, "max_tokens must be >= 1, got 0", param="max_tokens")
    err.body()   # {"error": {"message", "type", "param", "code"}}

``type`` follows the status (``invalid_request_error`` for 4xx, ``server_error`` for 5xx) unless
given; ``headers`` go on the response (``Retry-After`` for 429).

    internal_error(exc, what="internal error") -> APIError
        a 500 that says ``internal error (id 1a2b3c4d5e6f)`` and nothing of ``exc``; the traceback is
        logged (logger ``tiercache.serve``) with the same id, so an operator finds it and a client
        learns nothing of the server's internals (paths, values, library versions)
"""

from __future__ import annotations

import logging
import secrets

log = logging.getLogger("tiercache.serve")

_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_error",
          503: "server_error", 504: "timeout_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def internal_error(exc: BaseException, what: str = "internal error") -> APIError:
    eid = secrets.token_hex(6)
    log.error("%s (id %s)", what, eid, exc_info=(type(exc), exc, exc.__traceback__))
    message = f"internal error (id {eid})" if what == "internal error" else f"{what}: internal error (id {eid})"
    return APIError(500, message, code="internal_error")
