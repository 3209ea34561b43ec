"""Who may put K/V into a conversation through Redis: signed chunks (``remote.secret``), tenants'
scopes in the keys, and a Redis that asks for a password, an ACL user or TLS. Real redis-servers
(loopback, free ports), the tiny model; the last test runs two real servers with other secrets."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
from redis_proc import start_redis

from tiercache.cache.compat import cache_arg
from tiercache import TieredCache
from tiercache.models.load import load_model
from tiercache.policy.schema import Policy
from tiercache.serve.launch import LiveServer
from tiercache.serve.remote.config import SECRET_ENV, RemoteConfig
from tiercache.serve.remote.launch import self_signed
from tiercache.serve.remote.tier import RemoteTier
from tiercache.serve.tenants import Scope

pytestmark = pytest.mark.setup_seconds(25)  # orders the file (tests/conftest.py): servers with other secrets: two servers started and compared (~17 s)

C = 32
FULL = Policy()


@pytest.fixture(scope="module")
def model():
    return load_model("tiny")[0]


def tier_of(model, url, **kw) -> RemoteTier:
    cfg = RemoteConfig(url, chunk_tokens=C, timeout=kw.pop("timeout", 0.5), **kw)
    return RemoteTier.for_model(cfg, model, "tiny", FULL, min_match=16, retry_after=0.3)


def ids_of(n, seed=0):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def filled(model, ids):
    cache = TieredCache.from_policy(FULL, model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **cache_arg(cache))
    return cache


def publish(tier, model, ids, scope=None):
    kw = {} if scope is None else {"scope": scope}
    assert tier.publish(ids, filled(model, ids), **kw) == len(ids) // C
    assert tier.flush(20)


def test_a_chunk_signed_under_another_secret_is_a_miss_counted_and_deleted(model, redis_url, redis_server,
                                                                             monkeypatch):
    ids = ids_of(100)
    writer = tier_of(model, redis_url, secret="secret-A")
    publish(writer, model, ids)
    keys = redis_server.command("KEYS", "tiercache:*")
    assert len(keys) == 3
    monkeypatch.setenv(SECRET_ENV, "secret-B")  # the environment's secret, when the config has none
    reader = tier_of(model, redis_url)
    assert reader.fmt.signed
    assert reader.fetch(ids + [1]) == (None, 0)
    s = reader.stats()
    assert s["bad_tag"] == 1 and s["corrupt"] == 0 and s["hits"] == 0
    assert len(redis_server.command("KEYS", "tiercache:*")) == 2  # the refused first chunk was deleted
    writer.close()
    writer = tier_of(model, redis_url, secret="secret-A")  # a rightful writer writes it again: SET NX finds it free
    publish(writer, model, ids)
    monkeypatch.setenv(SECRET_ENV, "secret-A")
    got, n = tier_of(model, redis_url).fetch(ids + [1])
    assert n == 96
    got.close()
    for t in (writer, reader):
        t.close()


def test_signed_and_unsigned_servers_never_use_each_others_chunks(model, redis_url):
    ids = ids_of(100, seed=1)
    unsigned, signed = tier_of(model, redis_url), tier_of(model, redis_url, secret="s")
    publish(unsigned, model, ids)
    assert signed.fetch(ids + [1]) == (None, 0) and signed.stats()["bad_tag"] == 1  # no tag is a missing tag
    publish(signed, model, ids)
    assert unsigned.fetch(ids + [1]) == (None, 0) and unsigned.stats()["corrupt"] == 1  # its checksum fails
    for t in (signed, unsigned):
        t.close()


def test_a_tenants_chunks_are_found_only_in_its_scope(model, redis_url):
    ids = ids_of(100, seed=2)
    alice, salted = Scope.of("alice"), Scope.of("alice", "x")
    writer, reader = tier_of(model, redis_url), tier_of(model, redis_url)  # two servers
    publish(writer, model, ids, scope=alice)
    for other in (Scope.of("bob"), salted, Scope.of()):
        assert reader.fetch(ids + [1], scope=other) == (None, 0)
    got, n = reader.fetch(ids + [1], scope=alice)
    assert n == 96 and reader.stats()["errors"] == 0
    got.close()
    writer.close(), reader.close()


def test_replicas_keep_tenants_apart_through_redis(model, redis_url):
    """The store the worker sees (``SharedStore``): a put publishes under the request's scope, and
    another replica's checkout finds it only in that scope."""
    from tiercache.serve.remote.store import SharedStore
    from tiercache.serve.store import PrefixStore

    def replica():
        local = PrefixStore([FULL], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=8)
        return SharedStore(local, tier_of(model, redis_url))

    ids, alice = ids_of(100, seed=11), Scope.of("alice", "s")
    first, second = replica(), replica()
    assert first.put(ids, filled(model, ids), scope=alice)
    assert first.tier.flush(20) and first.tier.stats()["chunks_written"] == 3
    assert second.checkout(ids + [1], scope=Scope.of("bob", "s")) == (None, 0)
    assert second.checkout(ids + [1]) == (None, 0)
    got, n = second.checkout(ids + [1], scope=alice)
    assert n == 96 and second.tier.stats()["hits"] == 1
    got.close()
    first.close(), second.close()


def _works(model, url, seed) -> bool:
    tier = tier_of(model, url)
    try:
        if not tier.probe():
            return False
        ids = ids_of(70, seed=seed)
        publish(tier, model, ids)
        got, n = tier_of(model, url).fetch(ids + [1])
        return n == 64
    finally:
        tier.close()


def test_a_password_and_an_acl_user(model, tmp_path, caplog):
    r = start_redis(tmp_path, password="pw-default-1")
    try:
        with caplog.at_level(logging.INFO, logger="tiercache.serve"):
            assert _works(model, r.url, seed=3)  # redis://:PASSWORD@host
            assert not _works(model, r.url_for(None, None), seed=4)  # no password: NOAUTH, a miss
            assert not _works(model, r.url_for(None, "pw-wrong-9"), seed=5)
        r.command("ACL", "SETUSER", "tiercache", "on", ">pw-user-2", "~tiercache:*", "+@all")
        assert _works(model, r.url_for("tiercache", "pw-user-2"), seed=6)
        assert not _works(model, r.url_for("tiercache", "wrong"), seed=7)
        r.command("ACL", "SETUSER", "reader", "on", ">pw-reader-3", "~other:*", "+@all")
        assert not _works(model, r.url_for("reader", "pw-reader-3"), seed=8)  # the ACL refuses its keys
        logged = "\n".join(rec.getMessage() for rec in caplog.records)
        assert "remote tier: Redis at redis://:***@127.0.0.1" in logged
        assert "pw-default-1" not in logged and "pw-wrong-9" not in logged
        assert tier_of(model, r.url_for("u", "pw-x")).conn.url.startswith("redis://u:***@")
    finally:
        r.stop()


def test_rediss_tls(model, tmp_path):
    r = start_redis(tmp_path, tls=self_signed(tmp_path))
    try:
        assert r.url.startswith("rediss://")
        assert _works(model, r.url, seed=9)
        assert not _works(model, f"redis://127.0.0.1:{r.port}/0", seed=10)  # plain text to a TLS port
    finally:
        r.stop()


GREEDY = {"temperature": 0, "max_tokens": 24}
STORY = ("Write a function that merges two sorted lists of intervals, each a pair of integers, into one "
         "sorted list without overlaps. Explain each step in a comment and add three doctests. ")


def test_servers_with_other_secrets_reuse_nothing_and_answer_the_same(tmp_path):
    r = start_redis(tmp_path)
    servers = []
    try:
        for name in ("a", "b"):
            path = tmp_path / f"store-{name}.yaml"
            path.write_text(json.dumps({"remote": {"url": r.url, "chunk_tokens": C, "timeout": "300ms",
                                                   "secret": f"secret-of-{name}"}}))
            servers.append(LiveServer("--model", "tiny", "--store", str(path), log_dir=tmp_path))
        a, b = (s.wait_ready() for s in servers)
        messages = [{"role": "user", "content": STORY}]
        first = a.client().chat.completions.create(model="tiny", messages=messages, **GREEDY)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now add type hints."}]
        end = time.monotonic() + 20
        while a.metrics()["tiercache_remote_chunks_written_total"] < 3 and time.monotonic() < end:
            time.sleep(0.05)
        assert a.metrics()["tiercache_remote_chunks_written_total"] >= 3
        on_b = b.client().chat.completions.create(model="tiny", messages=messages, **GREEDY)
        on_a = a.client().chat.completions.create(model="tiny", messages=messages, **GREEDY)
        assert on_b.usage.prompt_tokens_details.cached_tokens == 0
        assert on_a.usage.prompt_tokens_details.cached_tokens > 0
        assert on_b.choices[0].message.content == on_a.choices[0].message.content
        assert b.metrics()["tiercache_remote_bad_tag_chunks_total"] == 1
        assert "HMAC tag missing or wrong" in b.log() and "secret-of" not in b.log()
    finally:
        for s in servers:
            s.stop()
        r.stop()
