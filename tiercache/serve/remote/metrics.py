"""The remote tier's families for ``/metrics`` (prefix ``tiercache_remote_``), from ``RemoteTier.stats()``.

    families(stats) -> iterator of prometheus families   (``serve.metrics`` yields them when present)

Counters: ``lookups_total``, ``hits_total``, ``misses_total``, ``cached_tokens_total`` (prompt
tokens that came from Redis), ``errors_total`` (every failed Redis call), ``timeouts_total``
(those past ``timeout``), ``corrupt_chunks_total`` (refused by their check), ``bad_tag_chunks_total``
(refused because their HMAC tag is missing or wrong under ``remote.secret``), ``vanished_chunks_total``
(gone between EXISTS and GET), ``chunks_read_total`` / ``bytes_read_total``,
``chunks_written_total`` / ``bytes_written_total``, ``writes_dropped_total`` (the write queue was
full), ``writes_skipped_total`` (Redis was down). Gauges: ``up`` (1 when the last call worked),
``pending_writes`` (chunks queued or being written).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_COUNTERS = {"lookups": "prompts looked up in Redis", "hits": "lookups that gave a longer prefix",
             "misses": "lookups that gave nothing usable", "cached_tokens": "prompt tokens that came from Redis",
             "errors": "failed Redis calls (each one a miss or a skipped write)",
             "timeouts": "Redis calls past the timeout", "corrupt": "chunks refused by their check",
             "bad_tag": "chunks refused: HMAC tag missing or wrong under remote.secret (unsigned, other secret, forged)",
             "vanished": "chunks gone between EXISTS and GET", "chunks_read": "chunks read",
             "bytes_read": "bytes of chunks read", "chunks_written": "chunks this server wrote first (SET NX)",
             "bytes_written": "bytes of chunks sent to Redis", "writes_dropped": "write jobs dropped (queue full)",
             "writes_skipped": "write jobs skipped while Redis was down"}
_NAMES = {"corrupt": "corrupt_chunks", "bad_tag": "bad_tag_chunks", "vanished": "vanished_chunks"}


def families(stats: dict):
    for key, doc in _COUNTERS.items():
        yield CounterMetricFamily(f"tiercache_remote_{_NAMES.get(key, key)}", doc, value=stats[key])
    yield GaugeMetricFamily("tiercache_remote_up", "1 when the last Redis call worked", value=stats["up"])
    yield GaugeMetricFamily("tiercache_remote_pending_writes", "chunks queued or being written",
                            value=stats["pending_writes"])
