"""The remote tier: conversations' K/V as chunks in Redis, shared by every server of one model.

    tier = RemoteTier.for_model(config, model, name, policy, min_match=16)   (``RemoteConfig``)
    tier.probe() -> bool             at start: is Redis there? (logged either way; never fatal)
    tier.fetch(ids, beat=0, scope=SHARED) -> (cache | None, n)
                                     the longest run of stored chunks that prefixes ``ids`` and
                                     leaves one token to prefill, as a fresh cache of ``policy``
                                     holding exactly ``ids[:n]``; None unless ``n > beat`` (what
                                     the local store already offers) and ``n >= min_match``
    tier.publish(ids, cache, scope=SHARED) -> int
                                     chunks of ``ids`` (whole chunks, K/V of ``cache``) not yet
                                     known to be in Redis: copied now, encoded and written by a
                                     background thread; returns how many were queued
    tier.flush(timeout) -> bool      wait for queued writes (tests, shutdown)
    tier.stats() -> dict; tier.close()

Lookup: keys of the prompt's whole chunks (``keys.chunk_keys``), one pipelined EXISTS for all,
then one MGET for the leading run that exists. Each value is checked (``codec.ChunkFormat``);
the first chunk that is gone (evicted between the two calls) or fails its check ends the run:
the prefix before it is used, never anything after it. A chunk that fails its check is logged,
counted (``corrupt``; ``bad_tag`` when its HMAC tag is missing or wrong under ``remote.secret``),
deleted from Redis (a forged value would otherwise hold its key against the rightful write, which
is ``SET NX``), and the lookup is a miss past it. The K/V are
ingested (``TieredCache.from_legacy``) into a cache of the serving policy, so at full precision
the result is bit-exact with the cache that wrote the chunks; an int4 format hands back the
dequantized values (the serving policy then re-quantizes them if it quantizes).

Faults cost a prefill, never an answer: any Redis failure (refused, reset, a command past
``timeout``) makes that lookup a miss, is counted in ``errors`` (``timeouts`` apart), and the
tier is skipped for ``retry_after`` seconds (a dead or stalled Redis is not asked again by every
request); then the next call tries again and redis-py reconnects. Writes never block the worker:
the copy of new chunks is the only work on its thread; a full write queue drops the job
(``writes_dropped``), and while Redis is down nothing is copied (``writes_skipped``).

Models: every layer must keep every token (full attention, no KV sharing, decoder-only);
``for_model`` raises ``ValueError`` naming the first layer that does not.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict

import torch

from tiercache.serve.remote.codec import ChunkError, ChunkFormat, ChunkTagError
from tiercache.serve.remote.connector import RedisConnector, RemoteError
from tiercache.serve.remote.keys import chunk_keys, model_fingerprint
from tiercache.serve.tenants import SHARED

log = logging.getLogger("tiercache.serve")
WRITE_BATCH = 8  # chunks per SET pipeline
COUNTERS = ("lookups", "hits", "misses", "cached_tokens", "errors", "timeouts", "corrupt", "bad_tag", "vanished",
            "chunks_read", "bytes_read", "chunks_written", "bytes_written", "writes_dropped", "writes_skipped")


class RemoteTier:
    def __init__(self, connector, fmt: ChunkFormat, namespace: str, chunk_tokens: int, policy, model_config,
                 device="cpu", min_match: int = 16, retry_after: float = 1.0, queue_size: int = 16,
                 known_keys: int = 1 << 16):
        self.conn, self.fmt, self.namespace = connector, fmt, namespace
        self.chunk, self.policy, self.model_config = chunk_tokens, policy, model_config
        self.device, self.min_match, self.retry_after = torch.device(device), min_match, retry_after
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.up = True
        self._down_until = 0.0
        self._lock = threading.Lock()
        self._known: OrderedDict[str, None] = OrderedDict()  # keys seen in Redis (written or read), LRU
        self._known_max = known_keys
        self._pending: set[str] = set()  # keys queued or being written
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._writer = threading.Thread(target=self._write_loop, name="tiercache-remote-writer", daemon=True)
        self._writer.start()

    @classmethod
    def for_model(cls, config, model, name: str, policy, min_match: int = 16, retry_after: float = 1.0) -> "RemoteTier":
        from tiercache.models.spec import ModelSpec
        from tiercache.serve.remote.config import secret_of

        spec = ModelSpec.from_config(model.config)
        problem = _unsupported(spec)
        if problem:
            raise ValueError(f"store.remote: {problem}; the remote tier needs every layer to keep every token")
        param = next(model.parameters())
        fmt = ChunkFormat(spec, param.dtype, config.quantize, secret=secret_of(config))
        namespace = f"tiercache:v1:{model_fingerprint(model, name)}:{fmt.name}"
        conn = RedisConnector(config.url, timeout=config.timeout, ttl=config.ttl)
        return cls(conn, fmt, namespace, config.chunk_tokens, policy, model.config, param.device, min_match,
                   retry_after)

    # -- health ----------------------------------------------------------------------------------
    def probe(self) -> bool:
        try:
            self.conn.ping()
        except RemoteError as e:
            self._failed(e, f"remote tier: Redis at {self.conn.url} is not reachable ({e}); serving without it, "
                            f"asking again every {self.retry_after:g}s")
            return False
        log.info("remote tier: Redis at %s answers (chunks of %d tokens, format %s, %s)", self.conn.url, self.chunk,
                 self.fmt.name, "signed: HMAC-SHA256" if self.fmt.signed else
                 "unsigned: anyone who can write to this Redis can write K/V; set remote.secret")
        return True

    def _ready(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, e: RemoteError, message: str | None = None) -> None:
        with self._lock:
            self.counters["errors"] += 1
            self.counters["timeouts"] += bool(e.timeout)
            self._down_until = time.monotonic() + self.retry_after
            was_up, self.up = self.up, False
        if was_up or message:
            log.warning(message or f"remote tier: {e}; answering by prefill, asking Redis again in "
                                   f"{self.retry_after:g}s")

    def _ok(self) -> None:
        if not self.up:
            self.up = True
            with self._lock:
                self._known.clear()  # it may have restarted empty: what it held is asked again
            log.info("remote tier: Redis at %s answers again", self.conn.url)

    def _count(self, **n) -> None:
        with self._lock:
            for k, v in n.items():
                self.counters[k] += v

    def _forget(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._known.pop(k, None)

    def _remember(self, keys) -> None:
        with self._lock:
            for k in keys:
                self._known[k] = None
                self._known.move_to_end(k)
            while len(self._known) > self._known_max:
                self._known.popitem(last=False)

    # -- lookup ----------------------------------------------------------------------------------
    def fetch(self, ids, beat: int = 0, scope=SHARED):
        whole = (len(ids) - 1) // self.chunk  # one token is always left to prefill
        if whole * self.chunk <= beat or whole * self.chunk < self.min_match or not self._ready():
            return None, 0
        self._count(lookups=1)
        keys = chunk_keys(ids[:whole * self.chunk], self.chunk, self.namespace, scope.digest)
        try:
            present = self.conn.exists(keys)  # [bool] per chunk, one round trip
            run = next((i for i, p in enumerate(present) if not p), len(present))
            self._forget(k for k, p in zip(keys, present) if not p)  # evicted or expired: write them again
            if run * self.chunk <= beat or run * self.chunk < self.min_match:
                self._ok()
                return self._miss()
            blobs = self.conn.get(keys[:run])
        except RemoteError as e:
            self._failed(e)
            return self._miss()
        self._ok()
        got, out = self._decode(keys[:run], blobs)
        n = got * self.chunk
        if n <= beat or n < self.min_match:
            return self._miss()
        from tiercache.cache.tiered import TieredCache

        past = tuple((k[:, :, :n], v[:, :, :n]) for k, v in out)  # [1, H, n, D] per layer
        cache = TieredCache.from_legacy(past, self.policy, self.model_config)
        self._remember(keys[:got])
        self._count(hits=1, cached_tokens=n)
        return cache, n

    def _decode(self, keys, blobs):
        """Chunks in order into one ``[1, H, run * C, D]`` pair per layer; stops at the first bad one."""
        out, got = None, 0
        for i, (key, blob) in enumerate(zip(keys, blobs)):
            if blob is None:  # evicted (maxmemory, ttl) since EXISTS
                self._count(vanished=1)
                self._forget([key])
                break
            try:
                kv = self.fmt.decode(blob, key, self.device, self.chunk)
            except ChunkError as e:
                log.error("remote tier: chunk %d of a %d-chunk prefix refused (%s); using the %d tokens before it",
                          i, len(keys), e, i * self.chunk)
                self._count(**{"bad_tag" if isinstance(e, ChunkTagError) else "corrupt": 1})
                self._forget([key])
                try:
                    self.conn.delete(key)
                except RemoteError:
                    pass
                break
            if out is None:
                out = [tuple(torch.empty((1, t.shape[1], len(keys) * self.chunk, t.shape[3]), dtype=t.dtype,
                                         device=self.device) for t in pair) for pair in kv]
            at = slice(i * self.chunk, (i + 1) * self.chunk)
            for (k, v), (ck, cv) in zip(out, kv):
                k[:, :, at] = ck
                v[:, :, at] = cv
            got += 1
            self._count(chunks_read=1, bytes_read=len(blob))
        return got, out

    def _miss(self):
        self._count(misses=1)
        return None, 0

    # -- writes ----------------------------------------------------------------------------------
    def publish(self, ids, cache, scope=SHARED) -> int:
        keys = chunk_keys(ids[:cache.get_seq_length()], self.chunk, self.namespace, scope.digest)  # what it holds
        with self._lock:
            new = [i for i, k in enumerate(keys) if k not in self._known and k not in self._pending]
        if not new:
            return 0
        if not self._ready():
            self._count(writes_skipped=1)
            return 0
        kv = self._snapshot(cache, new)
        job = [(keys[i], chunk) for i, chunk in zip(new, kv)]
        with self._lock:
            self._pending.update(k for k, _ in job)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._pending.difference_update(k for k, _ in job)
            self._count(writes_dropped=1)
            return 0
        return len(job)

    def _snapshot(self, cache, chunks) -> list:
        """Copies of chunks ``chunks`` of every layer: ``[[(k, v) per layer] per chunk]``, ``[1, H, C, D]``."""
        out = [[] for _ in chunks]
        for layer in cache.layers:
            k, v, _ = layer.export()  # [1, H, S, D], possibly views of the layer's storage: copied now
            for slot, i in zip(out, chunks):
                at = slice(i * self.chunk, (i + 1) * self.chunk)
                slot.append((k[:, :, at].to("cpu", copy=True), v[:, :, at].to("cpu", copy=True)))
        return out

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                self._queue.task_done()
                return
            keys = [k for k, _ in job]
            try:
                if self._ready():
                    self._write(job)
                else:
                    self._count(writes_skipped=1)
            except RemoteError as e:
                self._failed(e)
            except Exception:  # noqa: BLE001 - a bad snapshot must not end the writer
                log.exception("remote tier: encoding chunks failed")
            finally:
                with self._lock:
                    self._pending.difference_update(keys)
                self._queue.task_done()

    def _write(self, job) -> None:
        present = self.conn.exists([k for k, _ in job])
        todo = [(k, kv) for (k, kv), p in zip(job, present) if not p]
        for at in range(0, len(todo), WRITE_BATCH):  # bounded pipelines: Redis counts its input buffer as memory
            items = {k: self.fmt.encode(kv, k) for k, kv in todo[at:at + WRITE_BATCH]}
            new = self.conn.set(items)  # SET NX: another server may have written some meanwhile
            self._count(chunks_written=new, bytes_written=sum(len(b) for b in items.values()))
        self._ok()
        self._remember(k for k, _ in job)

    def flush(self, timeout: float = 30.0) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                if not self._pending and self._queue.unfinished_tasks == 0:
                    return True
            time.sleep(0.01)
        return False

    # -- reporting -------------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            return {**self.counters, "up": int(self.up), "pending_writes": len(self._pending),
                    "chunk_tokens": self.chunk, "format": self.fmt.name}

    def close(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        try:
            self._queue.put(None, timeout=1.0)
        except queue.Full:
            pass
        self._writer.join(timeout=2.0)
        self.conn.close()


def _unsupported(spec) -> str | None:
    if spec.cross_attention:
        return "encoder-decoder models are not supported"
    for i in range(spec.num_layers):
        if spec.window(i) is not None:
            return f"layer {i} is {spec.layer_types[i]} (keeps a window, not every token)"
        if spec.kv_sharing(i) is not None:
            return f"layer {i} shares K/V with another layer ({spec.kv_sharing(i)})"
    return None
