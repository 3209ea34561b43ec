"""The ``remote:`` section of ``store.yaml``: where the shared tier lives and how chunks look.

    remote:
      url: redis://127.0.0.1:6379/0   # a Redis (or Valkey) server: redis://, rediss://, unix://
      chunk_tokens: 256               # tokens per chunk (the lookup and write granularity)
      ttl: 1d                         # how long a chunk lives after its last write or refresh
                                      # (s, m, h, d; a number is seconds; null: until maxmemory evicts it)
      timeout: 500ms                  # per Redis command; a lookup past it is a miss (ms, s, or seconds)
      quantize: null                  # the chunks' block format: null = the model's dtype, or a
                                      # native quantization ({bits: 4, group_size: 64}: packed on the wire)
      write: turn                     # turn: new chunks after every turn (servers share conversations);
                                      # demote: only an entry leaving the ladder's last local rung

``parse_remote(value) -> RemoteConfig | None`` (None: no section, no remote tier). Bad input
raises ``PolicyError`` naming ``store.remote.<field>`` and what is allowed. This module needs no
Redis client: a config is checked (``tiercache validate``, tests) without the ``remote`` extra.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlparse

from tiercache.errors import PolicyError
from tiercache.policy.schema import Policy, QuantizePolicy

FIELDS = ("url", "chunk_tokens", "ttl", "timeout", "quantize", "write")
WRITES = ("turn", "demote")
_SCHEMES = ("redis", "rediss", "unix")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class RemoteConfig:
    url: str
    chunk_tokens: int = 256
    ttl: float | None = 86400.0  # seconds; None: no expiry
    timeout: float = 0.5  # seconds per command
    quantize: QuantizePolicy | None = None  # None: chunks in the model's dtype
    write: str = "turn"


def parse_remote(value) -> RemoteConfig | None:
    if value is None:
        return None
    where = "store.remote"
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected a mapping ({', '.join(FIELDS)}), got {value!r}")
    unknown = sorted(set(value) - set(FIELDS))
    if unknown:
        raise PolicyError(f"{where}: unknown field(s) {unknown}; allowed: {', '.join(FIELDS)}")
    if "url" not in value:
        raise PolicyError(f"{where}.url: missing; give the Redis server, e.g. redis://127.0.0.1:6379/0")
    url = value["url"]
    if not isinstance(url, str) or urlparse(url).scheme not in _SCHEMES:
        raise PolicyError(f"{where}.url: expected a URL with scheme {' | '.join(_SCHEMES)} "
                          f"(e.g. redis://127.0.0.1:6379/0), got {url!r}")
    chunk = value.get("chunk_tokens", 256)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise PolicyError(f"{where}.chunk_tokens: expected a whole number >= 1, got {chunk!r}")
    ttl = value.get("ttl", "1d")
    ttl = None if ttl is None else duration(ttl, f"{where}.ttl")
    if ttl is not None and ttl < 1:
        raise PolicyError(f"{where}.ttl: at least 1s (Redis expires in whole seconds), got {value['ttl']!r}")
    timeout = duration(value.get("timeout", "500ms"), f"{where}.timeout")
    if timeout <= 0:
        raise PolicyError(f"{where}.timeout: must be > 0, got {value['timeout']!r}")
    write = value.get("write", "turn")
    if write not in WRITES:
        raise PolicyError(f"{where}.write: expected {' | '.join(WRITES)}, got {write!r}")
    return RemoteConfig(url, chunk, ttl, timeout, _quantize(value.get("quantize"), chunk, f"{where}.quantize"), write)


def _quantize(value, chunk: int, where: str) -> QuantizePolicy | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected null or a quantize mapping such as {{bits: 4, group_size: 64}}, "
                          f"got {value!r}")
    try:
        q = Policy.from_dict({"quantize": {"residual_length": 0, **value}}).quantize
    except PolicyError as e:
        raise PolicyError(f"{where}: {e}") from e
    if q.backend != "native":
        raise PolicyError(f"{where}.backend: chunks are packed by the native backend; got {q.backend!r}")
    if q.sink_tokens or q.residual_length:
        raise PolicyError(f"{where}: sink_tokens and residual_length do not apply to chunks (every token is packed)")
    if chunk % q.group_size:
        raise PolicyError(f"{where}.group_size: {q.group_size} must divide store.remote.chunk_tokens ({chunk}): "
                          "a chunk is whole blocks")
    return q


def duration(value, where: str) -> float:
    """Seconds from ``90``, ``1.5``, ``"250ms"``, ``"30s"``, ``"5m"``, ``"12h"``, ``"1d"``."""
    if isinstance(value, bool):
        raise PolicyError(f"{where}: expected a duration such as 500ms, 30s, 12h, 1d or seconds, got {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|m|h|d)?\s*", value)):
        seconds = float(m.group(1)) * _UNITS[m.group(2) or "s"]
    else:
        raise PolicyError(f"{where}: expected a duration such as 500ms, 30s, 12h, 1d or seconds, got {value!r}")
    if seconds < 0:
        raise PolicyError(f"{where}: must be >= 0, got {value!r}")
    return seconds
