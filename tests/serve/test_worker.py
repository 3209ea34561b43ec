"""The worker without HTTP, on the randomly initialised tiny model (its greedy tokens depend on every
position of the context, so a K/V that does not match its token ids changes them).

References: ``model.generate`` with transformers' ``DynamicCache`` (greedy) for answers, a fresh
full-precision prefill for the K/V an entry holds."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import DynamicCache

from tiercache.models.load import load_model
from tiercache.policy.schema import load_policy
from tiercache.cache.compat import cache_arg
from tiercache.serve.chat import Codec
from tiercache.serve.errors import APIError
from tiercache.serve.protocol import parse_completion
from tiercache.serve.store import PrefixStore
from tiercache.serve.worker import Worker

POLICY = load_policy({"name": "full"})
MiB = 2**20


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny-random")
    return model, Codec(tok)


def make_worker(tiny, budget=None, ladder=(), **kw):
    model, codec = tiny
    store = PrefixStore([POLICY, *ladder], budget or {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    return Worker(model, codec, POLICY, model_name="m", store=store, **kw)


def ids_of(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids, n) -> list[int]:
    """Greedy tokens up to ``n``, ending at (and including) the end-of-sequence token."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, **cache_arg(DynamicCache()),
                         pad_token_id=258, eos_token_id=257)[0, len(ids):].tolist()
    return out[: out.index(257) + 1] if 257 in out else out


class Call:
    def __init__(self, worker, prompt, max_tokens, **fields):
        self.worker = worker
        self.events, self.finished = [], threading.Event()
        req = parse_completion({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
        self.job = worker.prepare(req, self.emit)
        worker.submit(self.job)

    def emit(self, kind, **data):
        self.events.append((kind, data))
        if kind in ("done", "error"):
            self.finished.set()

    def result(self, timeout=60):
        assert self.finished.wait(timeout), "no answer in time"
        for _ in range(int(timeout * 100)):  # the cache goes back to the store after the answer
            if self.worker.active == 0 and self.worker.queue_length == 0:
                break
            threading.Event().wait(0.01)
        kind, data = self.events[-1]
        if kind == "error":
            raise data["error"]
        return "".join(d["text"] for k, d in self.events if k == "delta"), data


def stored(worker) -> dict:
    return {tuple(ids): cache for ids, cache, _ in worker.store.entries()}


def assert_kv_matches(model, ids, cache):
    """The entry's K/V are those of its token ids (a fresh prefill, full precision)."""
    ref = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([list(ids)]), **cache_arg(ref))
    for i, layer in enumerate(cache.layers):
        k, v = layer.kv()
        assert k.shape == ref.layers[i].keys.shape
        torch.testing.assert_close(k, ref.layers[i].keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(v, ref.layers[i].values, atol=1e-4, rtol=1e-4)


def test_turns_reuse_the_stored_prefix_and_answer_like_generate(tiny):
    model, codec = tiny
    w = make_worker(tiny)
    w.start()
    try:
        p1 = ids_of(1, 40)
        text, done = Call(w, p1, 12).result()
        r1 = reference(model, p1, 12)
        assert text == codec.decode(r1) and done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the entry holds the prompt and every generated token (the last one fed after the answer)
        entry = stored(w)
        assert list(entry) == [tuple(p1 + r1)]
        assert_kv_matches(model, p1 + r1, entry[tuple(p1 + r1)])
        p2 = p1 + r1 + ids_of(2, 20)
        text, done = Call(w, p2, 12).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p1) + len(r1)
        assert text == codec.decode(reference(model, p2, 12))
        # an edited earlier token: only the tokens before it are shared
        p3 = list(p2)
        p3[10] = (p3[10] + 1) % 256
        text, done = Call(w, p3, 8).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 10
        assert text == codec.decode(reference(model, p3, 8))
        assert len(w.store) == 2  # the edit branched: both conversations are kept
        for ids, cache in stored(w).items():
            assert_kv_matches(model, ids, cache)
    finally:
        w.stop()


def test_concurrent_requests_each_get_what_they_get_alone(tiny):
    model, codec = tiny
    w = make_worker(tiny, max_active=3)
    w.start()
    try:
        prompts = [ids_of(10 + i, 20 + 7 * i) for i in range(6)]
        calls = [Call(w, p, 10) for p in prompts]
        for p, call in zip(prompts, calls):
            assert call.result()[0] == codec.decode(reference(model, p, 10))
    finally:
        w.stop()


def test_cancel_keeps_a_consistent_entry(tiny):
    model, _ = tiny
    w = make_worker(tiny)
    w.start()
    try:
        p = ids_of(3, 30)
        call = Call(w, p, 500)
        while not call.events:
            threading.Event().wait(0.01)
        call.job.cancel()
        for _ in range(500):
            if w.active == 0 and len(w.store):
                break
            threading.Event().wait(0.01)
        (ids, cache), = stored(w).items()
        assert len(ids) < len(p) + 500 and list(ids[: len(p)]) == p
        assert_kv_matches(model, ids, cache)
    finally:
        w.stop()


def test_budget_evicts_and_answers_stay_right(tiny):
    model, codec = tiny
    w = make_worker(tiny, budget={"device": int(2.5 * MiB)})  # two 1 MiB entries (one 256-token chunk)
    w.start()
    try:
        prompts = [ids_of(20 + i, 30) for i in range(4)]
        for p in prompts:
            assert Call(w, p, 6).result()[0] == codec.decode(reference(model, p, 6))
        s = w.store.stats()
        assert s["evictions"] >= 2 and s["bytes"]["device"] <= 2.5 * MiB
        p = prompts[0] + reference(model, prompts[0], 6) + [1, 2, 3]  # evicted: prefilled again, same answer
        text, done = Call(w, p, 6).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert text == codec.decode(reference(model, p, 6))
    finally:
        w.stop()


def test_a_request_that_cannot_fit_alone_is_refused_before_any_work(tiny):
    w = make_worker(tiny, budget={"device": MiB})
    with pytest.raises(APIError, match="needs 2.0 MiB on the device tier") as e:
        Call(w, ids_of(4, 300), 10)
    assert e.value.status == 400 and e.value.param == "max_tokens" and w.queue_length == 0


def test_full_queue_is_429_and_timeout_is_504(tiny):
    w = make_worker(tiny, queue_size=1, timeout=0.0)
    Call(w, [1, 2, 3], 2)
    with pytest.raises(APIError) as e:
        Call(w, [1, 2, 3], 2)
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    w.start()
    try:
        with pytest.raises(APIError) as e:
            Call(w, [4, 5, 6], 2).result()
    finally:
        w.stop()
    assert e.value.status == 504


@pytest.mark.parametrize("prompt, max_tokens, param, words", [
    pytest.param([7] * 4096, 1, "prompt", "context is 4096", id="prompt-over-context"),
    pytest.param([1, 2], 4095, "max_tokens", "at most 4094", id="max-tokens-past-context"),
    pytest.param([1, 999], 1, "prompt", "outside the vocabulary", id="token-out-of-vocab"),
])
def test_prepare_refuses_what_cannot_run(tiny, prompt, max_tokens, param, words):
    w = make_worker(tiny)
    with pytest.raises(APIError, match=words) as e:
        Call(w, prompt, max_tokens)
    assert e.value.status == 400 and e.value.param == param


def lossless_ladder(tmp_path):
    return [load_policy({"name": "host", "offload": {"device": "cpu"}}),
            load_policy({"name": "disk", "offload": {"device": "disk", "path": str(tmp_path)}})]


def test_demoted_conversations_come_back_exact(tiny, tmp_path):
    model, codec = tiny
    budget = {"device": int(2.5 * MiB), "host": int(1.5 * MiB), "disk": int(1.5 * MiB)}
    w = make_worker(tiny, budget=budget, ladder=lossless_ladder(tmp_path))
    w.start()
    try:
        prompts = [ids_of(30 + i, 30) for i in range(4)]
        firsts = [reference(model, p, 6) for p in prompts]
        for p in prompts:
            Call(w, p, 6).result()
        s = w.store.stats()
        # device: one entry beside a request's reservation; host and disk: one each; the rest evicted
        assert s["entries"] == {"device": 1, "host": 1, "disk": 1}, s
        assert s["demotions"] == 5 and s["evictions"] == 1
        for ids, cache, rung in w.store.entries():
            twin = cache.fork()
            twin.retier(POLICY)
            assert_kv_matches(model, ids, twin)
        # the conversation on disk (the second): promoted back, its next turn reuses it exactly
        p = prompts[1] + firsts[1] + ids_of(99, 10)
        text, done = Call(w, p, 6).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[1]) + len(firsts[1])
        assert text == codec.decode(reference(model, p, 6))
    finally:
        w.stop()


def test_persisted_entries_survive_a_restart_and_corrupt_ones_are_dropped(tiny, tmp_path, caplog):
    from tiercache.serve.persist import load_entries, save_entries

    model, codec = tiny
    w = make_worker(tiny)
    w.start()
    prompts = [ids_of(40 + i, 25) for i in range(3)]
    for p in prompts:
        Call(w, p, 5).result()
    w.stop()
    kept = {ids for ids, _, _ in w.store.entries()}
    assert save_entries(w.store, tmp_path / "p") == 3 and len(w.store) == 0
    files = sorted((tmp_path / "p").glob("*.tiercache"))
    raw = bytearray(files[1].read_bytes())
    raw[-10] ^= 0xFF  # flip a byte of the last tensor
    files[1].write_bytes(bytes(raw))
    (tmp_path / "p" / "entry-junk.tiercache").write_bytes(b"not a cache")
    w2 = make_worker(tiny)
    with caplog.at_level("ERROR", logger="tiercache.serve"):
        assert load_entries(w2.store, tmp_path / "p", model.config, codec.vocab_size) == 2
    assert sum("persist: dropping" in r.message for r in caplog.records) == 2
    assert not files[1].exists() and len(list((tmp_path / "p").glob("*.tiercache"))) == 2
    for ids, cache, _ in w2.store.entries():
        assert ids in kept
        assert_kv_matches(model, ids, cache)
    # a restarted server answers the next turn from the loaded entry
    ids = next(iter(w2.store.entries()))[0]
    w2.start()
    try:
        p = list(ids) + [10, 20, 30]
        text, done = Call(w2, p, 5).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids)
        assert text == codec.decode(reference(model, p, 5))
    finally:
        w2.stop()


def test_a_failing_step_fails_only_its_request(tiny):
    model, codec = tiny
    w = make_worker(tiny)
    real, calls = w.forward, []

    def flaky(ids, cache):
        calls.append(len(ids))
        if len(calls) == 2:  # the first request's first decode step
            raise RuntimeError("device lost")
        return real(ids, cache)

    w.forward = flaky
    w.start()
    try:
        with pytest.raises(APIError, match="device lost") as e:
            Call(w, ids_of(5, 20), 4).result()
        assert e.value.status == 500 and len(w.store) == 0  # nothing half-done was stored
        p = ids_of(6, 20)
        assert Call(w, p, 4).result()[0] == codec.decode(reference(model, p, 4))
        assert w.counters["failed"] == 1
    finally:
        w.stop()
