"""The ``remote:`` section of ``store.yaml``: where the shared tier lives and how chunks look.

    remote:
      url: redis://127.0.0.1:6379/0   # a Redis (or Valkey) server: redis://, rediss:// (TLS), unix://;
                                      # an ACL user and password go in the URL: redis://user:pass@host:6379/0
      chunk_tokens: 256               # tokens per chunk (the lookup and write granularity)
      ttl: 1d                         # how long a chunk lives after its last write or refresh
                                      # (s, m, h, d; a number is seconds; null: until maxmemory evicts it)
      timeout: 500ms                  # per Redis command; a lookup past it is a miss (ms, s, or seconds)
      quantize: null                  # the chunks' block format: null = the model's dtype, or a
                                      # native quantization ({bits: 4, group_size: 64}: packed on the wire)
      write: turn                     # turn: new chunks after every turn (servers share conversations);
                                      # demote: only an entry leaving the ladder's last local rung
      secret: null                    # the key of every chunk's HMAC-SHA256 (else $TIERCACHE_REMOTE_SECRET;
                                      # neither: chunks carry a plain sha256, anyone who can write to Redis
                                      # can write K/V that servers will use)

``RemoteConfig`` is a frozen dataclass read by the generic loader (``tiercache.policy.fields``):
``build(RemoteConfig, value, "store.remote")`` goes through ``RemoteConfig.from_plain`` (the
``quantize`` section's ``residual_length`` defaults to 0 here: every token of a chunk is packed),
then the checks below. Bad input raises ``PolicyError`` naming ``store.remote.<field>`` and what is
allowed; a secret is never shown in an error. ``secret_of(config)`` is the HMAC key in use (the
field, else the environment). This module needs no Redis client: a config is checked
(``tiercache validate``, tests) without the ``remote`` extra.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlparse

from tiercache.errors import PolicyError
from tiercache.policy.fields import Duration, build_fields
from tiercache.policy.schema import QuantizePolicy, check_quantize

SCHEMES = ("redis", "rediss", "unix")
SECRET_ENV = "TIERCACHE_REMOTE_SECRET"


@dataclass(frozen=True)
class RemoteConfig:
    url: str = field(metadata={"example": "redis://127.0.0.1:6379/0"})
    chunk_tokens: int = 256
    ttl: Duration | None = Duration(86400)  # seconds; None: no expiry
    timeout: Duration = Duration(0.5)  # seconds per command
    quantize: QuantizePolicy | None = None  # None: chunks in the model's dtype
    write: Literal["turn", "demote"] = "turn"
    secret: str | None = field(default=None, metadata={"secret": True}, repr=False)  # HMAC key (else the env)

    @classmethod
    def from_plain(cls, value, path: str) -> "RemoteConfig":
        if isinstance(value, dict) and isinstance(value.get("quantize"), dict):
            value = {**value, "quantize": {"residual_length": 0, **value["quantize"]}}
        cfg = build_fields(cls, value, path)
        cfg.check(path)
        return cfg

    def check(self, path: str = "store.remote") -> None:
        if urlparse(self.url).scheme not in SCHEMES:
            raise PolicyError(f"{path}.url: expected a URL with scheme {' | '.join(SCHEMES)} "
                              f"(e.g. redis://127.0.0.1:6379/0), got {redact(self.url)!r}")
        if self.chunk_tokens < 1:
            raise PolicyError(f"{path}.chunk_tokens: expected a whole number >= 1, got {self.chunk_tokens!r}")
        if self.ttl is not None and self.ttl < 1:
            raise PolicyError(f"{path}.ttl: at least 1s (Redis expires in whole seconds), got {self.ttl:g}s")
        if self.timeout <= 0:
            raise PolicyError(f"{path}.timeout: must be > 0, got {self.timeout:g}s")
        if self.secret is not None and not self.secret:
            raise PolicyError(f"{path}.secret: an empty secret; give one (a long random string) or omit the field")
        q = self.quantize
        if q is None:
            return
        where = f"{path}.quantize"
        if q.backend != "native":
            raise PolicyError(f"{where}.backend: chunks are packed by the native backend; got {q.backend!r}")
        check_quantize(q, where)
        if q.sink_tokens or q.residual_length:
            raise PolicyError(f"{where}: sink_tokens and residual_length do not apply to chunks (every token is packed)")
        if self.chunk_tokens % q.group_size:
            raise PolicyError(f"{where}.group_size: {q.group_size} must divide {path}.chunk_tokens "
                              f"({self.chunk_tokens}): a chunk is whole blocks")


def secret_of(config: RemoteConfig) -> bytes | None:
    """The HMAC key of the chunks: ``config.secret``, else ``$TIERCACHE_REMOTE_SECRET``, else None."""
    secret = config.secret if config.secret is not None else os.environ.get(SECRET_ENV) or None
    return None if secret is None else secret.encode("utf-8")


def redact(url: str) -> str:
    """``url`` without its password (logs, errors): ``redis://user:***@host:6379/0``."""
    try:
        parsed = urlparse(url)
        if parsed.password is None:
            return url
        user = parsed.username or ""
        host = parsed.netloc.rsplit("@", 1)[1]
        return parsed._replace(netloc=f"{user}:***@{host}").geturl()
    except ValueError:
        return "<a URL that cannot be parsed>"
