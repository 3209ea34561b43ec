"""The remote tier against a real redis-server, with the tiny model: what comes back is exactly
what was written (full precision: bit-exact, and the next logits match a full prefill), and every
fault (a chunk gone, a corrupted value, a slow, dead or returning Redis, two writers at once)
costs a shorter prefix or a miss, never a wrong one."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from redis_proc import start_redis

from tiercache.cache.compat import cache_arg
from tiercache import TieredCache
from tiercache.models.load import load_model
from tiercache.policy.schema import Policy
from tiercache.serve.remote.codec import ChunkError
from tiercache.serve.remote.config import RemoteConfig
from tiercache.serve.remote.store import SharedStore
from tiercache.serve.remote.tier import RemoteTier
from tiercache.serve.store import PrefixStore

C = 32  # tokens per chunk
FULL = Policy()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")[0]


def make_tier(model, url, name="tiny", **kw) -> RemoteTier:
    cfg = RemoteConfig(url, chunk_tokens=C, timeout=kw.pop("timeout", 0.3), **kw)
    return RemoteTier.for_model(cfg, model, name, FULL, min_match=16, retry_after=0.3)


def ids_of(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill(model, ids, cache=None):
    cache = cache if cache is not None else TieredCache.from_policy(FULL, model.config)
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), **cache_arg(cache), use_cache=True)
    return cache, out.logits[0, -1]  # [V]


def written(model, url, ids, **kw) -> tuple[RemoteTier, TieredCache]:
    tier = make_tier(model, url, **kw)
    cache, _ = prefill(model, ids)
    assert tier.publish(ids, cache) == len(ids) // C
    assert tier.flush(20)
    return tier, cache


def assert_prefix(model, got, n, reference):
    """``got`` holds exactly the reference's first ``n`` tokens (bit-exact at full precision)."""
    assert got.get_seq_length() == n
    for layer, ref in zip(got.to_legacy(), reference.to_legacy()):
        assert torch.equal(layer[0], ref[0][:, :, :n]) and torch.equal(layer[1], ref[1][:, :, :n])


def test_a_published_conversation_comes_back_bit_exact(model, redis_url):
    ids = ids_of(200)
    tier, cache = written(model, redis_url, ids)
    prompt = ids + ids_of(20, seed=1)
    other = make_tier(model, redis_url)  # another server: nothing in common but Redis
    got, n = other.fetch(prompt)
    assert n == 192
    assert_prefix(model, got, n, cache)
    _, logits = prefill(model, prompt[n:], got)
    _, want = prefill(model, prompt)
    assert torch.allclose(logits, want, atol=1e-5, rtol=1e-5)
    # one token is always left to prefill; a prompt diverging in chunk 3 gets the three before it
    assert other.fetch(ids[:192])[1] == 160
    assert other.fetch(ids[:100] + ids_of(120, seed=2))[1] == 96
    assert other.stats()["hits"] == 3 and other.stats()["errors"] == 0
    # another model (another fingerprint) never reads these chunks
    assert make_tier(model, redis_url, name="not-tiny").fetch(prompt) == (None, 0)
    tier.close(), other.close()


def test_the_local_store_answers_unless_redis_has_more(model, redis_url):
    ids = ids_of(200, seed=3)
    tier, cache = written(model, redis_url, ids)
    local = PrefixStore([FULL], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=8)
    store = SharedStore(local, tier)
    short, _ = prefill(model, ids[:50])
    local.put(ids[:50], short)
    got, n = store.checkout(ids + [1])
    assert n == 192 and tier.stats()["hits"] == 1  # Redis had more than the local 50
    got.close()
    longer, _ = prefill(model, ids)
    local.put(ids, longer)
    lookups = tier.stats()["lookups"]
    got, n = store.checkout(ids + [1])
    assert n == 200 and got is longer and tier.stats()["lookups"] == lookups  # not asked: nothing to gain
    tier.close()


def test_the_shared_store_keeps_the_local_reservations(model, redis_url):
    """Reserve, split and put(..., release=) pass through to the local store: the reservation ends
    before the published entry is counted, and every share comes back."""
    tier = make_tier(model, redis_url)
    local = PrefixStore([FULL], {"device": 10 * 2**20}, lambda c: c.tier_nbytes(), block_size=8, min_match=8)
    store = SharedStore(local, tier)
    ids = ids_of(100, seed=41)
    r = store.reserve({"device": 3 * 2**20}, ids)
    assert r is not None and local.stats()["reserved"]["device"] == 3 * 2**20
    first, second = store.split(r, 2)
    assert first.need["device"] + second.need["device"] == 3 * 2**20
    cache, _ = prefill(model, ids)
    assert store.put(ids, cache, release=first)
    assert local.stats()["reserved"]["device"] == second.need["device"] and len(local) == 1
    store.release(second)
    assert local.stats()["reserved"]["device"] == 0
    assert tier.flush(20) and tier.stats()["chunks_written"] == 3  # write: turn published it
    tier.close()


def test_write_demote_puts_an_entry_in_redis_when_it_leaves_the_ladder(model, redis_url):
    tier = make_tier(model, redis_url, write="demote")
    one = 200 * 2 * 4 * 2 * 64 * 4  # a 200-token cache's bytes
    local = PrefixStore([FULL], {"device": int(1.5 * one)}, lambda c: c.tier_nbytes(), block_size=8, min_match=8)
    store = SharedStore(local, tier, write="demote", remote_rung=True)
    first, second = ids_of(200, seed=4), ids_of(200, seed=5)
    store.put(first, prefill(model, first)[0])
    assert tier.flush(5) and tier.stats()["chunks_written"] == 0  # write: demote: nothing after a turn
    ref, _ = prefill(model, first)
    store.put(second, prefill(model, second)[0])  # over budget: the first leaves the last local rung
    assert len(local) == 1 and tier.flush(20) and tier.stats()["chunks_written"] == 6
    got, n = make_tier(model, redis_url).fetch(first + [1])
    assert n == 192
    assert_prefix(model, got, n, ref)
    tier.close()


def test_a_deleted_or_evicted_chunk_shortens_the_prefix(model, redis_url, redis_server, tmp_path):
    ids = ids_of(200, seed=6)
    tier, cache = written(model, redis_url, ids)
    from tiercache.serve.remote.keys import chunk_keys

    keys = chunk_keys(ids, C, tier.namespace)
    redis_server.command("DEL", keys[2])
    got, n = tier.fetch(ids + [1])
    assert n == 64
    assert_prefix(model, got, n, cache)
    tier.close()
    # maxmemory: Redis evicts least-recently-used chunks; whatever run is left is a true prefix
    small = start_redis(tmp_path, maxmemory="3mb")
    try:
        long_ids = ids_of(1000, seed=7)
        tier, cache = written(model, small.url, long_ids)
        assert int(small.command("INFO", "stats")["evicted_keys"]) > 0
        got, n = make_tier(model, small.url).fetch(long_ids + [1])
        present = sum(bool(small.command("EXISTS", k)) for k in chunk_keys(long_ids, C, tier.namespace))
        assert present < len(long_ids) // C
        if got is not None:
            assert_prefix(model, got, n, cache)
        tier.close()
    finally:
        small.stop()


def test_a_corrupted_value_is_refused_logged_and_a_miss_past_it(model, redis_url, redis_server, caplog):
    ids = ids_of(200, seed=8)
    tier, cache = written(model, redis_url, ids)
    from tiercache.serve.remote.keys import chunk_keys

    keys = chunk_keys(ids, C, tier.namespace)
    size = redis_server.command("STRLEN", keys[3])
    redis_server.command("SETRANGE", keys[3], size // 2, b"\x00\xff\x00")  # bytes flipped inside Redis
    with caplog.at_level(logging.ERROR, logger="tiercache.serve"):
        got, n = tier.fetch(ids + [1])
    assert n == 96 and tier.stats()["corrupt"] == 1
    assert_prefix(model, got, n, cache)
    assert "refused" in caplog.text and "checksum" in caplog.text
    assert not redis_server.command("EXISTS", keys[3])  # dropped, so the next writer can replace it
    redis_server.command("SETRANGE", keys[0], 0, b"XXXX")
    assert tier.fetch(ids + [1]) == (None, 0) and tier.stats()["corrupt"] == 2
    tier.close()


def test_two_writers_of_one_chunk_leave_one_whole_value(model, redis_url):
    ids = ids_of(64, seed=9)
    a, b = make_tier(model, redis_url), make_tier(model, redis_url)
    cache, _ = prefill(model, ids)
    kv = a._snapshot(cache, [0])[0]
    from tiercache.serve.remote.keys import chunk_keys

    key = chunk_keys(ids, C, a.namespace)[0]
    blobs = [a.fmt.encode(kv, key), a.fmt.encode([(k * 1.001, v) for k, v in kv], key)]  # two servers' bytes
    seen, errors, stop = set(), [], threading.Event()

    def write(i):
        conn = (a, b)[i].conn
        for _ in range(200):
            conn.set({key: blobs[i]})

    def read():
        while not stop.is_set():
            for blob in a.conn.get([key]):
                if blob is not None:
                    try:
                        a.fmt.decode(blob, key)
                        seen.add(blob)
                    except ChunkError as e:
                        errors.append(e)

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(i,)) for i in (0, 1)]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not errors and len(seen) == 1 and seen <= set(blobs)  # never torn, never replaced
    # and through publish: two servers writing the same conversation at once
    ids = ids_of(160, seed=10)
    cache, _ = prefill(model, ids)
    threads = [threading.Thread(target=t.publish, args=(ids, cache)) for t in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert a.flush(20) and b.flush(20)
    assert a.stats()["chunks_written"] + b.stats()["chunks_written"] == 5 + 0  # each chunk once (SET NX)
    got, n = make_tier(model, redis_url).fetch(ids + [1])
    assert n == 160
    assert_prefix(model, got, n, cache)
    a.close(), b.close()


def test_a_slow_redis_is_a_miss_not_a_stall(model, redis_url, redis_server):
    ids = ids_of(200, seed=11)
    tier, _ = written(model, redis_url, ids)
    sleeper = threading.Thread(target=redis_server.command, args=("DEBUG", "SLEEP", "1.5"))
    sleeper.start()
    time.sleep(0.1)
    t0 = time.perf_counter()
    assert tier.fetch(ids + [1]) == (None, 0)
    took = time.perf_counter() - t0
    assert took < 0.8, took  # the timeout (0.3 s), not the 1.5 s Redis is stalled for
    assert tier.stats()["timeouts"] == 1 and tier.stats()["up"] == 0
    t0 = time.perf_counter()
    assert tier.fetch(ids + [1]) == (None, 0) and time.perf_counter() - t0 < 0.05  # not asked again at once
    sleeper.join()
    time.sleep(0.35)  # retry_after
    assert tier.fetch(ids + [1])[1] == 192 and tier.stats()["up"] == 1
    tier.close()


def test_a_dead_redis_costs_misses_and_is_used_again_when_back(model, tmp_path):
    r = start_redis(tmp_path)
    try:
        ids = ids_of(200, seed=12)
        tier, _ = written(model, r.url, ids)
        other = ids_of(100, seed=13)
        other_cache = prefill(model, other)[0]  # before the kill: a slow prefill would outlast the 0.3 s backoff
        r.kill()
        assert tier.fetch(ids + [1]) == (None, 0) and tier.stats()["errors"] >= 1
        assert tier.publish(other, other_cache) == 0  # down: nothing copied, nothing queued
        assert tier.stats()["writes_skipped"] == 1
        time.sleep(0.35)
        r.start()  # the same port, empty (no persistence)
        time.sleep(0.35)
        assert tier.fetch(ids + [1]) == (None, 0)  # answered: nothing there any more
        cache, _ = prefill(model, ids)
        assert tier.publish(ids, cache) == 6 and tier.flush(20)
        assert tier.fetch(ids + [1])[1] == 192 and tier.stats()["up"] == 1
        tier.close()
    finally:
        r.stop()


def test_redis_absent_at_start_is_reported_not_fatal(model, caplog):
    from tiercache.serve.launch import free_port

    with caplog.at_level(logging.WARNING, logger="tiercache.serve"):
        tier = make_tier(model, f"redis://127.0.0.1:{free_port()}/0")
        assert tier.probe() is False
    assert "not reachable" in caplog.text
    assert tier.fetch(ids_of(200) + [1]) == (None, 0)
    tier.close()


def test_int4_chunks_travel_packed_and_come_back_close(model, redis_url):
    from tiercache.policy.schema import QuantizePolicy

    ids = ids_of(200, seed=14)
    fp, cache = written(model, redis_url, ids)
    q, _ = written(model, redis_url, ids, quantize=QuantizePolicy(bits=4, group_size=32, residual_length=0))
    assert q.namespace != fp.namespace  # another block format: other keys
    got_fp, n = make_tier(model, redis_url).fetch(ids + [1])
    reader = make_tier(model, redis_url, quantize=QuantizePolicy(bits=4, group_size=32, residual_length=0))
    got, m = reader.fetch(ids + [1])
    assert n == m == 192
    assert reader.stats()["bytes_read"] <= 0.3 * fp.stats()["bytes_written"]  # packed on the wire
    for (k, v), (rk, rv) in zip(got.to_legacy(), cache.to_legacy()):
        for a, b in ((k, rk[:, :, :m]), (v, rv[:, :, :m])):
            sqnr = 10 * torch.log10(b.pow(2).mean() / (a - b).pow(2).mean())
            assert sqnr > 12 and not torch.equal(a, b)
    _, logits = prefill(model, [1], got)
    _, want = prefill(model, ids[:m] + [1])
    assert torch.cosine_similarity(logits, want, dim=0) > 0.98  # lossy, close
    fp.close(), q.close(), reader.close()
