"""Prometheus text for ``/metrics``: ``Metrics(worker, store)``.

    metrics.observe("ttft" | "decode", value)   histograms (the worker calls this)
    metrics.render() -> (bytes, content_type)

Exported (prefix ``tiercache_``): ``store_hits_total``, ``store_misses_total``,
``cached_tokens_total`` (prompt tokens that came from the store), ``prefilled_tokens_total``,
``store_entries{tier}``, ``store_bytes{tier}``, ``store_reserved_bytes{tier}``,
``store_budget_bytes{tier}``, ``store_demotions_total``, ``store_demotion_seconds_total``, ``store_evictions_total``,
``store_tenant_evictions_total`` (evicted to hold a tenant to its budget),
``store_tenant_bytes{tenant}`` (the bytes of each tenant's entries, every tier together),
``queue_length``, ``active_requests``, ``requests_total``, ``failed_requests_total``,
``ttft_seconds`` and ``decode_tokens_per_second`` (histograms); with a remote tier, its
``tiercache_remote_*`` families (``tiercache.serve.remote.metrics``). Store and worker figures
are read when scraped, without a lock: the store's are the snapshot its last change published
(``PrefixStore.stats``), so a scrape never waits for the worker inside a fork, crop or retier,
and never stalls the event loop that streams the answers. Each ``Metrics`` has its own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tiercache.planner.footprint import TIERS

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_RATE_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000)


class _Snapshot:
    def __init__(self, worker, store):
        self.worker, self.store = worker, store

    def collect(self):
        w = self.worker
        yield _counter("requests_total", "requests accepted into the queue", w.counters["requests"])
        yield _counter("failed_requests_total", "requests that failed in the worker", w.counters["failed"])
        yield _counter("prefilled_tokens_total", "prompt tokens run through the model", w.counters["prefilled_tokens"])
        yield _gauge("queue_length", "requests waiting for the worker", w.queue_length)
        yield _gauge("active_requests", "requests being generated", w.active)
        s = self.store.stats() if self.store is not None else None
        if s is None:
            return
        yield _counter("store_hits_total", "requests that reused a stored prefix", s["hits"])
        yield _counter("store_misses_total", "requests with no stored prefix to reuse", s["misses"])
        yield _counter("cached_tokens_total", "prompt tokens that came from the store", s["cached_tokens"])
        yield _counter("store_demotions_total", "entries moved one rung down the ladder", s["demotions"])
        yield _counter("store_evictions_total", "entries dropped from the store", s["evictions"])
        yield _counter("store_tenant_evictions_total", "entries dropped to hold a tenant to its budget",
                       s["tenant_evictions"])
        g = GaugeMetricFamily("tiercache_store_tenant_bytes", "bytes of a tenant's stored entries, every tier",
                              labels=["tenant"])
        for tenant, n in sorted(s["tenant_bytes"].items()):
            g.add_metric([tenant], n)
        yield g
        yield _counter("store_demotion_seconds_total", "seconds spent moving entries down the ladder (beside the "
                       "step, on the store's thread)", s["demotion_seconds"])
        for key, name, doc in (("entries", "store_entries", "stored entries, by the tier holding most of each"),
                               ("bytes", "store_bytes", "bytes held by stored entries"),
                               ("reserved", "store_reserved_bytes", "bytes reserved for active requests"),
                               ("budget", "store_budget_bytes", "the store's budget (absent: no limit)")):
            g = GaugeMetricFamily(f"tiercache_{name}", doc, labels=["tier"])
            for t in TIERS:
                if s[key].get(t) is not None:
                    g.add_metric([t], s[key][t])
            yield g
        if "remote" in s:
            from tiercache.serve.remote.metrics import families

            yield from families(s["remote"])


def _counter(name, doc, value):
    return CounterMetricFamily(f"tiercache_{name}", doc, value=value)


def _gauge(name, doc, value):
    return GaugeMetricFamily(f"tiercache_{name}", doc, value=value)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("tiercache_ttft_seconds", "time to first token, from arrival", buckets=_TTFT_BUCKETS,
                              registry=self.registry)
        self.decode = Histogram("tiercache_decode_tokens_per_second", "decode speed per request",
                                buckets=_RATE_BUCKETS, registry=self.registry)

    def attach(self, worker, store) -> None:
        self.registry.register(_Snapshot(worker, store))

    def observe(self, name: str, value: float) -> None:
        (self.ttft if name == "ttft" else self.decode).observe(value)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
