"""``--persist``: what survives a restart, what is refused and kept, and shutdown (issue 32, point 6).

Real caches of the randomly initialised tiny model; a "wrong --model" is the same config with other
K/V shapes (its fingerprint differs)."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading

import pytest
import torch

from tiercache.cache.compat import cache_arg
from tiercache.cache.tiered import TieredCache
from tiercache.models.load import load_model
from tiercache.policy.schema import load_policy
from tiercache.serve.persist import load_entries, save_entries
from tiercache.serve.store import PrefixStore

FULL = load_policy({"name": "full"})
HOST = load_policy({"name": "host", "offload": {"device": "cpu", "pin_memory": False}})


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random")


def ids_of(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def filled(model, ids, policy=FULL):
    cache = TieredCache.from_policy(policy, model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **cache_arg(cache))
    return cache


def store_of(model, convs, ladder=(FULL,)):
    store = PrefixStore(list(ladder), {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    for ids in convs:
        store.put(ids, filled(model, ids))
    return store


def held(store) -> set:
    return {tuple(ids) for ids, _, _ in store.entries()}


def loaded(model, directory, config=None, ladder=(FULL,)):
    store = PrefixStore(list(ladder), {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    store.refused = load_entries(store, directory, config or model.config, 256).refused
    return store


def other_model(config):
    wrong = copy.deepcopy(config)
    wrong.num_key_value_heads = config.num_attention_heads  # other K/V shapes: another model
    return wrong


def test_a_restart_with_the_wrong_model_refuses_and_keeps_every_entry(tiny, tmp_path, caplog):
    model, _ = tiny
    convs = [ids_of(i, 20 + i) for i in range(3)]
    assert save_entries(store_of(model, convs), tmp_path) == 3
    with caplog.at_level("ERROR", logger="tiercache.serve"):
        wrong = loaded(model, tmp_path, other_model(model.config))
    assert len(wrong) == 0
    refusals = [r.message for r in caplog.records if "persist:" in r.message]
    assert len(refusals) == 3 and all("another model" in m and "kept" in m for m in refusals), refusals
    assert len(wrong.refused) == 3
    save_entries(wrong, tmp_path, keep=wrong.refused)  # that server shuts down, holding nothing
    assert held(loaded(model, tmp_path)) == {tuple(c) for c in convs}  # the right model gets them all back


class Killed(BaseException):
    """The process dies mid-save (SIGKILL, power): nothing after this point runs."""


def test_a_save_killed_halfway_leaves_the_previous_set_whole(tiny, tmp_path, monkeypatch):
    model, _ = tiny
    before = [ids_of(10 + i, 20) for i in range(3)]
    save_entries(store_of(model, before), tmp_path)
    after = store_of(model, [ids_of(20 + i, 24) for i in range(3)])
    real, calls = TieredCache.save, []

    def dying(self, path, token_ids=None):
        calls.append(path)
        if len(calls) == 2:
            raise Killed
        return real(self, path, token_ids)

    monkeypatch.setattr(TieredCache, "save", dying)
    with pytest.raises(Killed):
        save_entries(after, tmp_path)
    monkeypatch.setattr(TieredCache, "save", real)
    back = loaded(model, tmp_path)
    assert held(back) == {tuple(c) for c in before}
    assert len(list(tmp_path.glob("*.tiercache"))) == 4  # the previous set and the one file the killed save wrote
    save_entries(back, tmp_path)  # the next save: its set, and nothing else
    assert len(list(tmp_path.glob("*.tiercache"))) == 3 and held(loaded(model, tmp_path)) == {tuple(c) for c in before}


def test_a_cache_saved_under_no_rung_of_the_ladder_is_refused_and_kept(tiny, tmp_path, caplog):
    model, _ = tiny
    ids = ids_of(30, 20)
    store = PrefixStore([FULL, HOST], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    cache = filled(model, ids)
    cache.retier(HOST)
    store.put(ids, cache, rung=1)
    save_entries(store, tmp_path)
    with caplog.at_level("ERROR", logger="tiercache.serve"):
        alone = loaded(model, tmp_path, ladder=(FULL,))  # a server with no host rung
    assert len(alone) == 0 and any("no rung" in r.message for r in caplog.records)
    # the same form under another name is that rung: loaded there, and brought back to rung 0 for use
    renamed = load_policy({"name": "cpu-tier", "offload": {"device": "cpu", "pin_memory": False}})
    back = loaded(model, tmp_path, ladder=(FULL, renamed))
    assert [(tuple(i), r) for i, _, r in back.entries()] == [(tuple(ids), 1)]
    cache, n = back.checkout(ids + [1])
    assert n == 20 and cache.policy == FULL


def test_shutdown_saves_nothing_while_the_worker_is_still_running(tmp_path, monkeypatch):
    """The worker is stuck in a forward when the server stops: the previous persisted set stays."""
    from tiercache.serve.protocol import parse_completion
    from tiercache.serve.server import build

    store_cfg = {"budget": {"device": "64MiB", "host": None, "disk": None}, "ladder": []}

    def serve_once(app, worker, prompt, block=None):
        done = threading.Event()
        request = parse_completion({"model": "tiny-random", "prompt": prompt, "max_tokens": 4, "temperature": 0})
        job = worker.prepare(request, lambda kind, **d: kind in ("done", "error") and done.set())

        async def life():
            async with app.router.lifespan_context(app):
                worker.submit(job)
                await asyncio.to_thread((block or done).wait, 30)

        asyncio.run(life())

    app, worker = build("tiny-random", store=store_cfg, persist=tmp_path)
    first = ids_of(40, 30)
    serve_once(app, worker, first)
    manifest = sorted(p.name for p in tmp_path.iterdir())
    app, worker = build("tiny-random", store=store_cfg, persist=tmp_path)
    assert len(worker.store) == 1
    (stored,), = [[ids for ids, _, _ in worker.store.entries()]]
    inside, release = threading.Event(), threading.Event()
    import tiercache.serve.worker as worker_module

    real = worker_module.run_rows

    def stuck(model, rows, *rest):  # the worker's step forward
        inside.set()
        release.wait(30)
        return real(model, rows, *rest)

    monkeypatch.setattr(worker_module, "run_rows", stuck)
    worker.stop = functools.partial(worker.stop, timeout=0.5)
    try:
        serve_once(app, worker, list(stored) + [1, 2, 3], block=inside)  # its next turn: the entry is taken
    finally:
        release.set()
    assert sorted(p.name for p in tmp_path.iterdir()) == manifest
    again = build("tiny-random", store=store_cfg, persist=tmp_path)[1]
    assert [tuple(ids) for ids, _, _ in again.store.entries()] == [tuple(stored)]


def test_the_order_of_use_survives_a_restart(tiny, tmp_path):
    """Reloaded under a budget that holds two of three, the two used last are the ones kept."""
    model, _ = tiny
    convs = [ids_of(60 + i, 20) for i in range(3)]  # stored in this order: the last one is the most recent
    save_entries(store_of(model, convs), tmp_path)
    one = filled(model, convs[0]).tier_nbytes()["device"]
    store = PrefixStore([FULL], {"device": 2 * one}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    load_entries(store, tmp_path, model.config, 256)
    assert [tuple(ids) for ids, _, _ in store.entries()] == [tuple(convs[1]), tuple(convs[2])]
