"""The connector: exists / get / set over a Redis (or Valkey) server, through redis-py. Nothing else.

    conn = RedisConnector(url, timeout=0.5, ttl=86400)   no connection is made until the first call;
                                                         ``url`` may carry an ACL user and password
                                                         (``redis://user:pass@host:6379/0``) and be
                                                         ``rediss://`` (TLS; ``?ssl_ca_certs=PATH``);
                                                         ``conn.url`` is it without the password (logs)
    conn.ping() -> True                                  raises RemoteError when the server is not there
    conn.exists(keys) -> [bool]                          one round trip (a pipeline of EXISTS)
    conn.get(keys) -> [bytes | None]                     one round trip (MGET); None: not there
    conn.set(items) -> int                               {key: bytes}; one round trip: SET NX EX ttl,
                                                         and EXPIRE ttl (refresh) for each; returns how
                                                         many were new
    conn.delete(key)                                     drop one value (a chunk that failed its check)
    conn.close()

Every failure of the server (refused, reset, past ``timeout``, an error reply) is a
``RemoteError`` (``.timeout`` says whether it was a timeout); the caller decides what a failure
costs. redis-py's pool reconnects on the next call after a lost connection, so a server that
comes back is used again without anything done here.

``SET NX``: a chunk, once written, is never overwritten while it lives; two servers writing the
same chunk at once leave the first one's bytes, and a reader sees one whole value (Redis
commands are atomic), never a mix.
"""

from __future__ import annotations


class RemoteError(RuntimeError):
    def __init__(self, message: str, timeout: bool = False):
        super().__init__(message)
        self.timeout = timeout


class RedisConnector:
    def __init__(self, url: str, timeout: float = 0.5, ttl: float | None = 86400.0):
        try:
            import redis
        except ImportError as e:
            raise ImportError("the remote tier needs redis-py: pip install 'tiercache[remote]'") from e
        from tiercache.serve.remote.config import redact

        self._redis = redis
        self.url, self.ttl = redact(url), None if ttl is None else max(1, int(ttl))
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # one retry, at once, for a lost connection (a pooled one Redis closed); none for a timeout:
        # the caller's lookup is then a miss within ``timeout``, not redis-py's backoff schedule
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                           retry=retry, health_check_interval=0)

    def _call(self, what: str, fn):
        try:
            return fn()
        except self._redis.exceptions.TimeoutError as e:
            raise RemoteError(f"redis {what}: timed out ({e})", timeout=True) from e
        except (self._redis.exceptions.RedisError, OSError) as e:
            raise RemoteError(f"redis {what}: {type(e).__name__}: {e}") from e

    def ping(self) -> bool:
        return bool(self._call("PING", self.client.ping))

    def exists(self, keys) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]

        return self._call("EXISTS", run)

    def get(self, keys) -> list:
        if not keys:
            return []
        return self._call("MGET", lambda: self.client.mget(keys))

    def set(self, items: dict) -> int:
        if not items:
            return 0

        def run():
            pipe = self.client.pipeline(transaction=False)
            for k, v in items.items():
                pipe.set(k, v, nx=True, ex=self.ttl)
                if self.ttl is not None:
                    pipe.expire(k, self.ttl)
            res = pipe.execute()
            return sum(bool(r) for r in res[::2 if self.ttl is not None else 1])

        return self._call("SET", run)

    def delete(self, key: str) -> None:
        self._call("DEL", lambda: self.client.delete(key))

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - closing a dead connection
            pass
