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


def test_a_cache_leaves_the_step_workspace_before_the_store_gets_it(tiny, monkeypatch):
    """Requests ending at different steps while others decode on: a finishing request's cache,
    lent slots of the worker's step workspace while it decoded, holds memory of its own when it is
    handed to the store's thread, and its entry keeps its tokens' K/V while newcomers take the
    freed slots."""
    from tiercache.serve.sequence import Sequence

    model, codec = tiny
    w = make_worker(tiny, max_active=3)
    real, seen = Sequence.hand_back, []

    def storages(cache):
        return {t.untyped_storage().data_ptr() for layer in cache.layers if layer.kv() is not None
                for t in layer.kv()}

    def hand_back(self):  # on the worker thread: before the next step can touch the workspace
        cache = self.cache
        slots = {t.untyped_storage().data_ptr() for s in list(w.workspace._spaces.values()) for t in (s.keys, s.values)}
        before = cache is not None and bool(storages(cache) & slots)
        real(self)
        seen.append((before, cache is not None and bool(storages(cache) & slots)))

    monkeypatch.setattr(Sequence, "hand_back", hand_back)
    w.start()
    try:
        prompts = [ids_of(30 + i, 12 + 5 * i) for i in range(5)]
        lengths = [4, 14, 8, 11, 6]
        calls = [Call(w, p, n, logit_bias={"257": -100}) for p, n in zip(prompts, lengths)]
        answers = [call.result()[0] for call in calls]
    finally:
        w.stop()
    assert any(before for before, _ in seen)  # some caches were lent when their request ended
    assert not any(after for _, after in seen)
    entries = stored(w)
    assert len(entries) == 5
    for ids, cache in entries.items():
        assert_kv_matches(model, ids, cache)
    for p, n, text in zip(prompts, lengths, answers):
        ref = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, **cache_arg(DynamicCache()),
                             pad_token_id=258, sequence_bias={(257,): -100.0})[0, len(p):].tolist()
        assert text == codec.decode(ref)


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
    w = make_worker(tiny, queue_size=1, timeout=1e-9)  # already past its deadline when it is admitted
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
        # device: two entries (a request's reservation ends before its entry is stored); host and disk: one each
        assert s["entries"] == {"device": 2, "host": 1, "disk": 1}, s
        assert s["demotions"] == 3 and s["evictions"] == 0
        for ids, cache, rung in w.store.entries():
            twin = cache.fork()
            twin.retier(POLICY)
            assert_kv_matches(model, ids, twin)
        # the conversation on disk (the first): promoted back, its next turn reuses it exactly
        p = prompts[0] + firsts[0] + ids_of(99, 10)
        text, done = Call(w, p, 6).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts[0]) + len(firsts[0])
        assert text == codec.decode(reference(model, p, 6))
    finally:
        w.stop()


def test_persisted_entries_survive_a_restart_and_corrupt_ones_are_refused(tiny, tmp_path, caplog):
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
    (tmp_path / "p" / "entry-junk.tiercache").write_bytes(b"not a cache")  # named by no manifest: not loaded
    w2 = make_worker(tiny)
    with caplog.at_level("ERROR", logger="tiercache.serve"):
        got = load_entries(w2.store, tmp_path / "p", model.config, codec.vocab_size)
    assert got.count == 2 and got.refused == [files[1].name]
    assert sum("persist: refusing" in r.message and "sha256" in r.message for r in caplog.records) == 1
    assert files[1].exists()  # refused and kept: never deleted by a load
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


def test_a_fault_in_one_sequence_fails_only_its_request(tiny):
    """Three requests share every step; one's cache update raises at its third step: it gets a 500
    and stores nothing, the others answer as alone and are stored."""
    model, codec = tiny
    w = make_worker(tiny, prefill_chunk=8, step_tokens=32)
    real = w.new_cache
    made = []

    def new_cache(tokens):
        cache = real(tokens)
        made.append(cache)
        if len(made) == 2:  # the second request's cache
            update, calls = cache.update, []

            def flaky(k, v, layer_idx, *args, **kwargs):
                calls.append(layer_idx)
                if len(calls) == 2 * model.config.num_hidden_layers + 1:  # its third step, layer 0
                    raise RuntimeError("device lost")
                return update(k, v, layer_idx, *args, **kwargs)

            cache.update = flaky
        return cache

    w.new_cache = new_cache
    prompts = [ids_of(5 + i, 20) for i in range(3)]
    calls = [Call(w, p, 6) for p in prompts]  # queued first: all three start in the same steps
    w.start()
    try:
        with pytest.raises(APIError, match=r"internal error \(id [0-9a-f]+\)") as e:  # the text stays in the log
            calls[1].result()
        assert e.value.status == 500
        for i in (0, 2):
            assert calls[i].result()[0] == codec.decode(reference(model, prompts[i], 6))
        assert w.counters["failed"] == 1
        assert all(list(ids[:20]) != prompts[1] for ids in stored(w))  # nothing half-done was stored
        assert len(w.store) == 2
    finally:
        w.stop()


def test_a_failing_step_fails_its_requests_and_the_next_ones_run(tiny, monkeypatch):
    import tiercache.serve.worker as worker_module

    model, codec = tiny
    w = make_worker(tiny)
    real, steps = worker_module.run_rows, []

    def flaky(m, rows, *rest):
        steps.append(len(rows))
        if len(steps) == 2:  # the first request's first decode step
            raise RuntimeError("device lost")
        return real(m, rows, *rest)

    monkeypatch.setattr(worker_module, "run_rows", flaky)
    w.start()
    try:
        with pytest.raises(APIError, match=r"internal error \(id [0-9a-f]+\)") as e:  # the text stays in the log
            Call(w, ids_of(5, 20), 4).result()
        assert e.value.status == 500 and len(w.store) == 0  # nothing half-done was stored
        p = ids_of(6, 20)
        assert Call(w, p, 4).result()[0] == codec.decode(reference(model, p, 4))
        assert w.counters["failed"] == 1
    finally:
        w.stop()


def test_a_long_prompt_arrives_a_chunk_a_step_beside_a_running_stream(tiny, monkeypatch):
    """While one request decodes, a 120-token prompt is fed 16 tokens a step in the same forwards;
    no step holds more than ``step_tokens``; both answers are those of ``generate``."""
    import tiercache.serve.worker as worker_module

    model, codec = tiny
    w = make_worker(tiny, prefill_chunk=16, step_tokens=24, max_active=4)
    real, steps = worker_module.run_rows, []

    def recorded(m, rows, *rest):
        steps.append([(len(r.ids), r.sample) for r in rows])
        return real(m, rows, *rest)

    monkeypatch.setattr(worker_module, "run_rows", recorded)
    w.start()
    try:
        short, long = ids_of(7, 10), ids_of(8, 120)
        first = Call(w, short, 60)
        while not first.events:  # the first is decoding
            threading.Event().wait(0.01)
        second = Call(w, long, 5)
        assert first.result()[0] == codec.decode(reference(model, short, 60))
        assert second.result()[0] == codec.decode(reference(model, long, 5))
    finally:
        w.stop()
    assert all(sum(n for n, _ in step) <= 24 for step in steps)
    shared = [step for step in steps if len(step) == 2 and step[1][0] == 16]
    assert len(shared) >= 6, steps  # the long prompt: 16 tokens a step, beside the decoding token
    assert all(step[0] == (1, True) for step in shared)


def test_a_burst_of_prompts_is_prefilled_in_shared_steps_within_the_chunk(tiny, monkeypatch):
    """Four 30-token prompts arriving at once share the steps' 24 prompt tokens, oldest first (not
    one prompt per step); no step feeds more than ``prefill_chunk`` prompt tokens; every answer is
    that of ``generate``."""
    import tiercache.serve.worker as worker_module

    model, codec = tiny
    w = Worker(model, codec, POLICY, model_name="m", store=None, prefill_chunk=24, step_tokens=40, max_active=4)
    real, steps = worker_module.run_rows, []

    def recorded(m, rows, *rest):
        steps.append([len(r.ids) for r in rows])
        return real(m, rows, *rest)

    monkeypatch.setattr(worker_module, "run_rows", recorded)
    prompts = [ids_of(20 + i, 30) for i in range(4)]
    calls = [Call(w, p, 6) for p in prompts]  # queued before the loop starts: admitted together
    w.start()
    try:
        for call, p in zip(calls, prompts):
            assert call.result()[0] == codec.decode(reference(model, p, 6))
    finally:
        w.stop()
    chunks = [[n for n in step if n > 1] for step in steps]
    assert [c for c in chunks if c] == [[24], [6, 18], [12, 12], [18, 6], [24]]
    assert [len(step) - len(c) for step, c in zip(steps, chunks)][:5] == [0, 0, 1, 2, 3]  # decoding beside them


def test_a_failed_batch_pick_falls_back_to_each_row_alone(tiny, monkeypatch):
    """When picking a step's tokens at once raises, each row picks alone: the answers are unchanged."""
    import tiercache.serve.worker as worker_module

    model, codec = tiny
    w = Worker(model, codec, POLICY, model_name="m", store=None, max_active=4)
    tries = []

    def broken(samplers, logits):
        tries.append(len(samplers))
        raise RuntimeError("injected fault")

    monkeypatch.setattr(worker_module, "pick_rows", broken)
    prompts = [ids_of(30 + i, 12) for i in range(3)]
    calls = [Call(w, p, 5) for p in prompts]
    w.start()
    try:
        for call, p in zip(calls, prompts):
            assert call.result()[0] == codec.decode(reference(model, p, 5))
    finally:
        w.stop()
    assert max(tries) == 3 and w.counters["failed"] == 0


def test_step_settings_are_checked(tiny):
    with pytest.raises(ValueError, match="step_tokens .4. must be more than max_active .4."):
        make_worker(tiny, max_active=4, step_tokens=4)
    with pytest.raises(ValueError, match="prefill_chunk must be a whole number >= 1, got 0"):
        make_worker(tiny, prefill_chunk=0)


def test_a_request_cancelled_mid_prefill_stores_the_part_it_fed(tiny, monkeypatch):
    import tiercache.serve.worker as worker_module

    model, _ = tiny
    w = make_worker(tiny, prefill_chunk=16, step_tokens=32)
    real, steps = worker_module.run_rows, []
    p = ids_of(9, 100)
    call = None

    def recorded(m, rows, *rest):
        out = real(m, rows, *rest)
        steps.append(rows)
        if len(steps) == 3:
            call.job.cancel()  # after 48 of its 100 prompt tokens
        return out

    monkeypatch.setattr(worker_module, "run_rows", recorded)
    call = Call(w, p, 5)
    w.start()
    try:
        for _ in range(1000):
            if w.active == 0 and len(w.store):
                break
            threading.Event().wait(0.01)
    finally:
        w.stop()
    (ids, cache), = stored(w).items()
    assert list(ids) == p[:48] and not any(kind == "delta" for kind, _ in call.events)
    assert_kv_matches(model, ids, cache)


# -- the store keeps what fits (issue 32) -----------------------------------------------------------------

def test_a_finished_request_is_stored_after_its_reservation_is_released(tiny):
    """An entry bigger than half the budget stays where it is: the request that made it has ended."""
    w = make_worker(tiny, budget={"device": int(1.5 * MiB)})  # the entry (1 MiB) and its reservation (1 MiB): 2 MiB
    w.start()
    try:
        p = ids_of(50, 30)
        Call(w, p, 6).result()
        s = w.store.stats()
        assert len(w.store) == 1 and s["evictions"] == 0 and s["entries"]["device"] == 1, s
        assert s["reserved"]["device"] == 0
        text, done = Call(w, p + reference(tiny[0], p, 6) + [7, 8, 9], 6).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == 36
    finally:
        w.stop()


def test_admission_does_not_count_the_entry_it_takes_out(tiny):
    """The next turn's reservation covers the entry it continues: that entry is not also counted."""
    model, codec = tiny
    w = make_worker(tiny, budget={"device": int(2.5 * MiB)})
    w.start()
    try:
        p = ids_of(51, 30)
        first = reference(model, p, 6)
        Call(w, p, 6).result()  # an entry of 1 MiB
        p2 = p + first + ids_of(52, 250)  # 286 tokens + 6: a reservation of 2 MiB; with the entry, 3 MiB
        text, done = Call(w, p2, 6).result()
        assert done["usage"]["prompt_tokens_details"]["cached_tokens"] == len(p) + len(first)
        assert text == codec.decode(reference(model, p2, 6))
    finally:
        w.stop()


@pytest.mark.parametrize("policy", [
    # packed_attention: false dequantizes into the shared workspace (a packed-attention layer holds none)
    {"name": "int4", "quantize": {"backend": "native", "bits": 4, "group_size": 32, "residual_length": 32,
                                  "packed_attention": False}},
    {"name": "offload", "offload": {"device": "cpu", "prefetch": 1, "pin_memory": False}},
], ids=["dequantization-workspace", "prefetch-slots"])
def test_stored_entries_hold_no_transient_buffers(tiny, policy):
    """A stored entry counts what it holds, not the workspace / slots it used while it was served."""
    from tiercache.cache.tiered import TieredCache

    model, _ = tiny
    policy = load_policy(policy)
    ids = ids_of(53, 100)
    cache = TieredCache.from_policy(policy, model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **cache_arg(cache))
    assert cache.shared_nbytes()  # serving it allocated its transient buffers
    held = {t: n for t, n in cache.tier_nbytes().items()}
    layers_only = sum(layer.tier_nbytes().get("device", 0) for layer in cache.layers)
    store = PrefixStore([policy], {}, lambda c: c.tier_nbytes(), block_size=8, min_match=4)
    store.put(ids, cache)
    assert store.stats()["bytes"]["device"] == layers_only < held["device"]
    assert cache.shared_nbytes() == {}
    # taken out again, it continues exactly as a cache that never let them go
    twin = TieredCache.from_policy(policy, model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]), **cache_arg(twin))
    back, n = store.checkout(ids + [5, 6])
    assert back is cache and n == 100
    with torch.no_grad():
        a = model(input_ids=torch.tensor([[5, 6]]), **cache_arg(back)).logits
        b = model(input_ids=torch.tensor([[5, 6]]), **cache_arg(twin)).logits
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# -- shutdown and the store's own thread -------------------------------------------------------------------

def test_stop_cancels_the_running_request_keeps_its_entry_and_refuses_the_queued_one(tiny):
    """``stop`` (the worker's drain): the running request gets a 503 and the store keeps what it fed;
    the one still queued gets a 503 and never starts."""
    model, _ = tiny
    w = make_worker(tiny, max_active=1)
    w.start()
    p = ids_of(60, 20)
    running = Call(w, p, 3000, logit_bias={"257": -100})  # no end-of-sequence: it runs until stopped
    while not running.events:
        threading.Event().wait(0.01)
    queued = Call(w, ids_of(61, 20), 5)
    assert w.stop() and w.stopped
    for call in (running, queued):
        assert call.finished.is_set()
        kind, data = call.events[-1]
        assert kind == "error" and data["error"].status == 503 and data["error"].code == "shutting_down"
    assert not any(k == "delta" for k, _ in queued.events)
    (ids, cache), = stored(w).items()
    assert list(ids[:20]) == p and 20 < len(ids) < 20 + 3000
    assert_kv_matches(model, ids, cache)
    assert w.store.stats()["reserved"]["device"] == 0


def test_the_step_goes_on_while_a_store_call_waits(tiny, monkeypatch):
    """A checkout that takes 1.5 s (a slow Redis, a big retier) holds only its own request: the
    stream already running gets its tokens meanwhile, and the slow one answers as alone."""
    model, codec = tiny
    w = make_worker(tiny)
    real = w.store.checkout
    slow_started = threading.Event()

    def slow_checkout(ids, **kw):
        if len(ids) == 33:  # the second request's prompt
            slow_started.set()
            threading.Event().wait(1.5)
        return real(ids, **kw)

    monkeypatch.setattr(w.store, "checkout", slow_checkout)
    w.start()
    try:
        first = Call(w, ids_of(62, 10), 3000, logit_bias={"257": -100})
        while not first.events:
            threading.Event().wait(0.01)
        p = ids_of(63, 33)
        second = Call(w, p, 5)
        assert slow_started.wait(10)
        before = len(first.events)
        threading.Event().wait(1.0)  # inside the slow checkout
        assert not second.events and len(first.events) > before + 5  # the stream went on
        first.job.cancel()
        assert second.result()[0] == codec.decode(reference(model, p, 5))
    finally:
        w.stop()
