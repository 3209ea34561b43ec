"""What a chunked prefill costs per chunk, on the worker (tiny random model, no HTTP).

A chunk's work outside attention must not grow with the history already fed: one cache update
per layer, no copy of the held K/V (each layer's keys stay views of one allocation, sized once
for the prompt), one forward per chunk. Counted, never timed. A stored history's next
turn feeds only its new tokens. Results are checked against a full-precision reference."""

from __future__ import annotations

import math

import pytest

import tiercache.serve.worker as worker_module
from tiercache.cache.tiered import TieredCache
from tiercache.layers import regrowth

from test_worker import Call, assert_kv_matches, ids_of, make_worker, reference, stored, tiny  # noqa: F401


class Recorder:
    """Per forward: the number of ``TieredCache.update`` calls and, per layer, the storage the
    returned keys live in (a new storage at a later chunk means the held K/V were copied)."""

    def __init__(self, monkeypatch):
        self.forwards, self.updates, self.storages = [], 0, {}
        real_update, real_rows = TieredCache.update, worker_module.run_rows

        def update(cache, k, v, layer_idx, *a, **kw):
            self.updates += 1
            keys, values = real_update(cache, k, v, layer_idx, *a, **kw)
            self.storages.setdefault(layer_idx, set()).add(keys.untyped_storage().data_ptr())
            return keys, values

        def run_rows(model, rows, workspace=None):
            before = self.updates
            out = real_rows(model, rows, workspace)
            self.forwards.append((sum(len(r.ids) for r in rows), self.updates - before))
            return out

        monkeypatch.setattr(TieredCache, "update", update)
        monkeypatch.setattr(worker_module, "run_rows", run_rows)


@pytest.mark.parametrize("prompt_len", [64, 600])
def test_per_chunk_work_does_not_grow_with_the_history(tiny, monkeypatch, prompt_len):
    model, codec = tiny
    layers = model.config.num_hidden_layers
    chunk = 64
    rec = Recorder(monkeypatch)
    w = make_worker(tiny, prefill_chunk=chunk, step_tokens=80, max_active=2)
    ids = ids_of(3, prompt_len)
    copied = regrowth.copied()
    w.start()
    try:
        text, done = Call(w, ids, 4).result()
    finally:
        w.stop()
    assert text == codec.decode(reference(model, ids, 4))
    prefill = rec.forwards[:math.ceil(prompt_len / chunk)]
    assert [n for n, _ in prefill] == [min(chunk, prompt_len - a) for a in range(0, prompt_len, chunk)]
    assert all(u == layers for _, u in rec.forwards)  # one update per layer and forward, whatever the history
    assert all(len(s) == 1 for s in rec.storages.values()), rec.storages  # never a copy of the held K/V
    assert regrowth.copied() == copied  # sized once for the prompt: no regrowth on any tier
    (entry_ids, cache), = stored(w).items()
    assert_kv_matches(model, entry_ids, cache)


def test_a_stored_turn_feeds_only_its_new_tokens(tiny, monkeypatch):
    model, codec = tiny
    w = make_worker(tiny, prefill_chunk=16, step_tokens=32, max_active=2)
    history = ids_of(5, 150)
    w.start()
    try:
        Call(w, history, 6).result()
        (entry_ids,) = stored(w)
        follow = list(entry_ids) + ids_of(6, 10)
        rec = Recorder(monkeypatch)
        before = w.counters["prefilled_tokens"]
        text, done = Call(w, follow, 4).result()
    finally:
        w.stop()
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(entry_ids)
    assert w.counters["prefilled_tokens"] - before == 10  # the new tokens only
    assert rec.forwards[0][0] == 10 and all(u == model.config.num_hidden_layers for _, u in rec.forwards)
    assert text == codec.decode(reference(model, follow, 4))
