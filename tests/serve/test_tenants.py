"""Tenants kept apart in the prefix store (fake caches, as in test_store.py), the keys file, and
scopes surviving ``--persist`` (real caches of the tiny model)."""

from __future__ import annotations

import pytest
import torch

from tiercache import PolicyError
from tiercache.cache.compat import cache_arg
from tiercache.cache.tiered import TieredCache
from tiercache.models.load import load_model
from tiercache.policy.schema import load_policy
from tiercache.serve.persist import load_entries, save_entries
from tiercache.serve.remote.keys import chunk_keys
from tiercache.serve.store import PrefixStore
from tiercache.serve.tenants import SHARED, Scope, load_api_keys

from test_store import BYTES, FakeCache, make

A, B = Scope.of("alice"), Scope.of("bob")


def test_a_prefix_is_found_only_in_its_own_scope():
    store = make()
    history = list(range(40))
    store.put(history, FakeCache(history), scope=A)
    turn = history + [99, 98]
    for other in (B, SHARED, Scope.of("alice", "salt-1"), Scope.of("", "alice")):
        assert store.lookup(turn, scope=other) == 0
        assert store.checkout(turn, scope=other) == (None, 0)
        assert store.reserve({}, turn, scope=other).entry is None  # nothing of alice's is pinned for it
    assert len(store) == 1
    cache, n = store.checkout(turn, scope=A)
    assert n == 40 and cache.kv == history
    assert store.stats()["misses"] == 4 and store.stats()["hits"] == 1


def test_the_same_history_in_two_scopes_is_two_entries():
    store = make()
    history = list(range(30))
    salted = Scope.of("alice", "s")
    caches = {scope: FakeCache(history) for scope in (A, B, salted, SHARED)}
    for scope, cache in caches.items():
        store.put(history, cache, scope=scope)
    assert len(store) == 4 and not any(c.closed for c in caches.values())  # no put superseded another scope's
    for scope, cache in caches.items():
        assert store.checkout(history + [1], scope=scope) == (cache, 30)  # its own entry, taken


def test_a_tenant_over_its_budget_evicts_its_own_entries_never_another_tenants():
    store = make(tenant_budgets={"alice": 25 * BYTES})  # room for two of alice's 10-token entries
    bobs = [list(range(100 + 10 * i, 110 + 10 * i)) for i in range(3)]
    for ids in bobs:  # bob's entries are older: first in the shared LRU line
        store.put(ids, FakeCache(ids), scope=B)
    alices = [list(range(500 + 10 * i, 510 + 10 * i)) for i in range(4)]
    caches = []
    for ids in alices:
        caches.append(FakeCache(ids))
        store.put(ids, caches[-1], scope=Scope.of("alice", f"salt-{len(caches) % 2}"))  # salts: one tenant
    held = {tuple(ids) for ids, _, _ in store.entries()}
    assert held == {tuple(i) for i in bobs + alices[2:]}  # alice's two oldest went, every one of bob's stayed
    assert caches[0].closed and caches[1].closed and not caches[2].closed
    s = store.stats()
    assert s["tenant_evictions"] == 2 and s["evictions"] == 2
    assert s["tenant_bytes"] == {"alice": 20 * BYTES, "bob": 30 * BYTES}


def test_a_tenant_budget_spares_the_entry_a_reservation_will_take():
    store = make(tenant_budgets={"alice": 15 * BYTES})
    old, new = list(range(10)), list(range(50, 60))
    store.put(old, FakeCache(old), scope=A)
    r = store.reserve({}, old + [1, 2], scope=A)  # the next turn of `old` is admitted
    assert r.entry is not None
    store.put(new, FakeCache(new), scope=A)
    assert {tuple(i) for i, _, _ in store.entries()} == {tuple(old)}  # the new one went, not the pinned one
    store.release(r)


def test_remote_keys_carry_the_scope():
    ids = list(range(64))
    shared = chunk_keys(ids, 32, "ns")
    assert chunk_keys(ids, 32, "ns", SHARED.digest) == shared  # a server without tenants names chunks as before
    keys = {tuple(chunk_keys(ids, 32, "ns", s.digest)) for s in (SHARED, A, B, Scope.of("alice", "x"))}
    assert len(keys) == 4
    assert all("alice" not in k for k in chunk_keys(ids, 32, "ns", A.digest))  # hashed in, not written
    assert Scope.of("alice", "x") == Scope.of("alice", "x") and Scope.of(None, None) is SHARED


KEYS = """
alice:
  key: sk-alice-0123456789
  budget: 1MiB
bob:
  keys: [sk-bob-1, sk-bob-2]
"""


def test_the_keys_file(tmp_path):
    path = tmp_path / "keys.yaml"
    path.write_text(KEYS)
    tenants = load_api_keys(path)
    assert tenants.find("sk-alice-0123456789") == "alice" and tenants.find("sk-bob-2") == "bob"
    assert tenants.find("sk-bob-3") is None and tenants.find("") is None
    assert tenants.budgets == {"alice": 2**20}
    assert "sk-" not in repr(tenants.tenants)  # secrets stay out of reprs (logs)


@pytest.mark.parametrize("text, words", [
    ("", "expected a mapping of tenant names"),
    ("- sk-1\n", "expected a mapping of tenant names"),
    ("alice: {budget: 1GiB}\n", ".alice: no key; give key: SECRET or keys"),
    ("alice: {key: sk-a}\nbob: {keys: [sk-b, sk-a]}\n", "a key of tenant 'bob' is also a key of tenant 'alice'"),
    ("alice: {key: sk-a}\nalice: {key: sk-b}\n", "'alice' is given twice in one mapping"),
    ("alice: {key: sk-a, key: sk-b}\n", "'key' is given twice in one mapping"),
    ("alice: {key: 123456}\n", ".alice.key: expected a string or null (the value is a secret: not shown)"),
    ("alice: {key: sk-a, budget: lots}\n", ".alice.budget: expected a size such as 20GiB"),
    ("alice: {key: sk-a, budget: 0}\n", ".alice.budget: a budget of 0 bytes stores nothing"),
    ("alice: {key: sk-a, role: admin}\n", ".alice.role: unknown field; allowed: key, keys, budget"),
    ("alice: {key: ' sk-a'}\n", "has spaces around it"),
    ("7: {key: sk-a}\n", "a key must be a string, got 7"),
    ("alice: {key: sk-abc\n", "is not valid YAML at line 2, column 1"),
])
def test_a_bad_keys_file_names_what_is_wrong_and_never_shows_a_key(tmp_path, text, words):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(PolicyError) as e:
        load_api_keys(path)
    assert words in str(e.value)
    assert "sk-" not in str(e.value) and "123456" not in str(e.value)


def test_a_missing_keys_file(tmp_path):
    with pytest.raises(PolicyError, match="api keys file .* does not exist"):
        load_api_keys(tmp_path / "nope.yaml")


def test_scopes_survive_a_restart(tmp_path):
    model, _ = load_model("tiny-random")
    full = load_policy({"name": "full"})

    def filled(ids):
        cache = TieredCache.from_policy(full, model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]), **cache_arg(cache))
        return cache

    def new_store():
        return PrefixStore([full], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)

    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    store = new_store()
    salted = Scope.of("alice", "secret-salt")
    for scope in (salted, SHARED):
        store.put(ids, filled(ids), scope=scope)
    assert save_entries(store, tmp_path) == 2
    manifest = (tmp_path / "manifest.json").read_text()
    assert "secret-salt" not in manifest and salted.digest in manifest
    back = new_store()
    assert load_entries(back, tmp_path, model.config, 256).count == 2
    for scope in (salted, SHARED):
        assert back.lookup(ids + [1], scope=scope) == 24
    assert back.lookup(ids + [1], scope=A) == 0 and back.lookup(ids + [1], scope=Scope.of("", "secret-salt")) == 0
