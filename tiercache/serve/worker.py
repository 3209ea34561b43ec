"""The model worker: one thread owns the model and runs every forward pass.

    worker = Worker(model, codec, policy, model_name="tiny", store=store, max_active=8,
                    queue_size=32, timeout=600.0, metrics=None, prefill_chunk=256, step_tokens=512)
    worker.start()
    job = worker.prepare(request, emit)    # tokenize and check (APIError 400/404), no model work;
                                           # job.scope: the tenant and cache_salt its cache is filed under
    worker.submit(job)                     # APIError 429 (with Retry-After) when the queue is full
    job.cancel()                           # the client went away: stops at the next token
    worker.stop() -> bool                  True once the thread has ended (``worker.stopped``)

``emit(kind, **data)`` is called on the worker thread: ``("delta", text=...)``, then
``("done", finish_reason=..., usage=...)``, or ``("error", error=APIError)``.

Scheduling: up to ``max_active`` sequences are active (or being prepared). Each turn of the loop is one *step*: one
forward of the model over every active sequence (``tiercache.serve.batch.run_rows``: the rows
are packed into one input, each sequence has its own ``TieredCache``; the decoding rows'
full-precision layers are slots of ``self.workspace``: one cache write and one attention call per
layer for all of them, the rest per sequence). A step
holds one token of every decoding sequence plus prefill chunks: the sequences still prefilling,
oldest first, share ``min(prefill_chunk, step_tokens - decoding rows)`` tokens of their prompts
(after the store's prefix reuse), each taking what it still needs until the share is spent: a
burst of new conversations starts together, a long prompt arrives a chunk per step, and no step
holds more than one ``prefill_chunk`` beside the decoding tokens (running streams never freeze). With a store, every store call runs on the store's own thread
(``tiercache.serve.keeper.StoreKeeper``), never on the step thread: a job is handed to it, which
reserves the bytes its cache may grow to (prompt + max_tokens, from the planner;
``job.reservation``; demoting or evicting entries to make room; until there is room the job waits
at the head of the line), checks the store out (the local store, or Redis behind it) and hands a
ready ``Sequence`` back: the job joins the batch at the next step, and the streams never wait for
a lookup or a demotion. Handing a cache back (``store.put(..., release=)``: first the
reservation, then the entry is counted, then whatever must move is demoted), releasing a
reservation (a request that stores nothing, when it leaves the active set: ``_retire``) and
splitting one are calls handed over in order (``keeper.run``). ``active`` counts the sequences
in the batch, those being prepared and the calls not yet done (a finished request is idle once
its cache is back in the store). The ``n`` choices of one request
split it (``store.split``; ``adopt`` takes the forked ones, rows from the next step on). A request
whose cache cannot fit the budget even alone is refused by ``prepare``, before any work.

Timeouts: a job past ``timeout`` seconds since submission stops with a 504 error (what it had
computed is kept in the store). An exception in one sequence's part of a step (its cache update,
its attention, its sampling) fails only that request (500); an exception of the step's forward
as a whole fails the requests of that step (no cache it touched can be trusted).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

from tiercache.serve.batch import run_rows
from tiercache.serve.errors import APIError, internal_error
from tiercache.serve.keeper import StoreKeeper
from tiercache.serve.protocol import DEFAULT_MAX_TOKENS, Request
from tiercache.serve.sampling import pick_rows
from tiercache.serve.sequence import Sequence
from tiercache.serve.tenants import SHARED, Scope
from tiercache.serve.workspace import StepWorkspace

log = logging.getLogger("tiercache.serve")

PREFILL_CHUNK = 256  # prompt tokens one step feeds at most (a laptop CPU: ~20-60 ms on a 135M model)
STEP_TOKENS = 512  # tokens one step feeds at most: decoding tokens + the prefill chunk


@dataclass(eq=False)
class Job:
    request: Request
    ids: list
    max_tokens: int
    need: dict
    emit: object
    submitted: float = field(default_factory=time.perf_counter)
    deadline: float = float("inf")
    cancelled: threading.Event = field(default_factory=threading.Event)
    reservation: object = None  # the store's Reservation while admitted
    scope: Scope = SHARED  # whose stored prefixes it may use and where its cache goes (tenant, cache_salt)

    def cancel(self) -> None:
        self.cancelled.set()


def context_length(model, policy) -> int:
    """Tokens the model can attend to: ``max_position_embeddings`` (and a static ``max_length``)."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    limits = [getattr(cfg, "max_position_embeddings", None), getattr(policy, "max_length", None)]
    limits = [n for n in limits if isinstance(n, int) and n > 0]
    return min(limits) if limits else 2048


class Worker:
    def __init__(self, model, codec, policy, *, model_name: str, store=None, max_active: int = 8,
                 queue_size: int = 32, timeout: float = 600.0, metrics=None, prefill_chunk: int = PREFILL_CHUNK,
                 step_tokens: int = STEP_TOKENS):
        from tiercache.models.spec import ModelSpec

        self.model, self.codec, self.policy, self.store = model, codec, policy, store
        self.model_name = model_name
        self.spec = ModelSpec.from_config(model.config)
        self.device = next(model.parameters()).device
        self.context = context_length(model, policy)
        self.max_active, self.timeout, self.metrics = max_active, timeout, metrics
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        for name, n in (("prefill_chunk", prefill_chunk), ("step_tokens", step_tokens), ("max_active", max_active)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {n!r}")
        if step_tokens <= max_active:
            raise ValueError(f"step_tokens ({step_tokens}) must be more than max_active ({max_active}): a step holds "
                             "one token of every decoding request and still needs room for a prefill chunk")
        self.prefill_chunk, self.step_tokens = prefill_chunk, step_tokens
        self.counters = {"prefilled_tokens": 0, "requests": 0, "failed": 0}
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._active: list[Sequence] = []
        self.workspace = StepWorkspace()  # the decoding rows' one attention call per layer, kept across steps
        self._ready: queue.SimpleQueue = queue.SimpleQueue()  # from the keeper: a Sequence, or None
        self._preparing = 0  # jobs handed to the keeper, not yet back through _ready
        self._wake = threading.Event()  # a job was submitted or is ready
        self.keeper = StoreKeeper(self, store, self._hand_over) if store is not None else None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tiercache-worker", daemon=True)

    # -- the HTTP side ---------------------------------------------------------------------------
    def prepare(self, request: Request, emit) -> Job:
        if request.model != self.model_name:
            raise APIError(404, f"model {request.model!r} not found; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        if request.kind == "chat":
            ids = self.codec.chat(request.messages)
        elif isinstance(request.prompt, str):
            ids = self.codec.encode(request.prompt)
        else:
            ids = list(request.prompt)
            bad = [t for t in ids if not 0 <= t < self.codec.vocab_size]
            if bad:
                raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{self.codec.vocab_size - 1})",
                               param="prompt")
        where = "messages" if request.kind == "chat" else "prompt"
        if not ids:
            raise APIError(400, f"{where} encodes to no tokens", param=where)
        room = self.context - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt has {len(ids)} tokens; this model's context is {self.context} tokens "
                           f"(prompt + max_tokens must fit), so the prompt may have at most {self.context - 1}",
                           param=where, code="context_length_exceeded")
        max_tokens = request.max_tokens if request.max_tokens is not None else min(room, DEFAULT_MAX_TOKENS)
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} is past the context: the prompt has {len(ids)} tokens and "
                           f"the context is {self.context}, so max_tokens may be at most {room}",
                           param="max_tokens", code="context_length_exceeded")
        need = self._need(len(ids) + max_tokens, request.n)
        job = Job(request, ids, max_tokens, need, emit, scope=Scope.of(request.tenant, request.cache_salt))
        job.deadline = job.submitted + self.timeout
        return job

    def _need(self, tokens: int, copies: int = 1) -> dict:
        if self.store is None:
            return {}
        from tiercache.planner.api import human, plan

        need = {t: int(n) * copies for t, n in plan(self.policy, self.spec, 1, tokens).bytes.items()}
        for tier, n in need.items():
            budget = self.store.budget.get(tier)
            if budget is not None and n > budget:
                caches = f"{copies} KV caches (n)" if copies > 1 else "KV cache"
                raise APIError(400, f"this request's {caches} ({tokens} tokens: prompt + max_tokens) needs "
                               f"{human(n)} on the {tier} tier, more than the store's whole {tier} budget of "
                               f"{human(budget)}; lower max_tokens, shorten the conversation or raise the budget",
                               param="max_tokens", code="kv_budget_exceeded")
        return need

    def submit(self, job: Job) -> None:
        if self._stopping.is_set():
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, f"the server is busy ({self._queue.maxsize} requests queued); retry shortly",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        self.counters["requests"] += 1
        self._wake.set()

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    @property
    def active(self) -> int:
        """Requests in the batch, being prepared, or handing their cache back."""
        return len(self._active) + self._preparing + (self.keeper.pending if self.keeper is not None else 0)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        if self.keeper is not None:
            self.keeper.start()
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop (active requests end cancelled, kept in the store; queued ones get 503),
        then the keeper (its queued calls done). True when both threads have ended; False when one
        is still busy after ``timeout`` seconds: then the caches may still change, and nothing may
        save or close the store."""
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive() and self.keeper is not None and self.keeper.close(timeout):
            self._drain_ready()  # prepared after the loop's drain: their calls now run at once
        if not self.stopped:
            log.error("the worker is still running %gs after the stop (inside a forward or a store call?)", timeout)
        return self.stopped

    @property
    def stopped(self) -> bool:
        """Both threads have ended (or never started): no step or store call is running and none will."""
        return not self._thread.is_alive() and (self.keeper is None or not self.keeper.alive)

    def store_call(self, fn) -> None:
        """``fn(store)`` on the keeper's thread, after the calls handed over before it."""
        self.keeper.run(fn)

    def release(self, job) -> None:
        """End ``job``'s reservation (read when the call runs: a split may have replaced it)."""
        if self.keeper is not None:
            self.store_call(lambda store: job.reservation is not None and store.release(job.reservation))

    def _hand_over(self, seq) -> None:
        """The keeper's answer for one job (on its thread): a ready Sequence, or None (answered)."""
        self._ready.put(seq)
        self._wake.set()

    # -- what sequences call ---------------------------------------------------------------------
    def new_cache(self, tokens: int):
        from tiercache.cache.tiered import TieredCache

        return TieredCache.from_policy(self.policy, self.model.config, context_length=tokens)

    def adopt(self, seq: Sequence) -> None:
        """A sequence forked by an active one (a choice of ``n``): runs from the next turn on."""
        if not seq.done:
            self._active.append(seq)
        else:
            self.release(seq.job)

    def count(self, name: str, n: int) -> None:
        self.counters[name] += n

    def observe(self, name: str, value: float) -> None:
        if self.metrics is not None:
            self.metrics.observe(name, value)

    # -- the loop --------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.clear()
            self._admit()
            if not self._active:
                self._wake.wait(0.1)
                continue
            self._step()
        self._drain()

    def _admit(self) -> None:
        """Ready sequences join the batch; queued jobs go to the keeper (or start) while slots are free."""
        self._active.extend(self._take_ready())
        while len(self._active) + self._preparing < self.max_active:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                self._admit_one(job)
            except Exception as e:  # noqa: BLE001 - the loop must go on
                log.exception("admitting a request failed")
                self.counters["failed"] += 1
                job.emit("error", error=internal_error(e, "could not start"))

    def _admit_one(self, job: Job) -> None:
        """Hand ``job`` to the keeper (with a store), start it (without), or answer it."""
        if job.cancelled.is_set():
            return
        if time.perf_counter() > job.deadline:
            job.emit("error", error=APIError(504, f"the request timed out after {self.timeout:g}s in the queue",
                                             code="timeout"))
            return
        if self.keeper is not None:
            self._preparing += 1
            self.keeper.admit(job)
            return
        self._active.append(Sequence(job, self))

    def _step(self) -> None:
        """One forward over every active sequence (see the module docstring)."""
        now = time.perf_counter()
        for seq in list(self._active):
            job = seq.job
            if job.cancelled.is_set():
                self._guard(seq, lambda s: s.stop("cancelled"))
            elif now > job.deadline:
                self._guard(seq, lambda s: s.stop("timeout", APIError(504, f"the request timed out after "
                                                                      f"{self.timeout:g}s", code="timeout")))
        decoding = [s for s in self._active if not s.prefilling]
        prefilling = [s for s in self._active if s.prefilling]  # oldest first
        budget = min(self.prefill_chunk, self.step_tokens - len(decoding))  # prompt tokens of this step, shared
        rows, seqs = [], []
        for seq in decoding + prefilling:
            if seq.prefilling and budget < 1:
                break
            row = self._guard(seq, lambda s: s.row(budget if s.prefilling else 1))
            if row is not None:
                rows.append(row)
                seqs.append(seq)
                if seq.prefilling:
                    budget -= len(row.ids)
        if not rows:
            return
        try:
            out = run_rows(self.model, rows, self.workspace)
        except Exception as e:  # noqa: BLE001 - the step failed as a whole: its requests fail
            log.exception("a step of %d requests failed", len(rows))
            for seq in seqs:
                self._fail(seq, e)
            return
        at = {i: n for n, i in enumerate(i for i, row in enumerate(rows) if row.sample)}  # row -> its logits row
        picks = self._pick({n: seqs[i] for i, n in at.items() if i not in out.failed}, out.logits)
        for i, (seq, row) in enumerate(zip(seqs, rows)):
            if i in out.failed:
                log.error("request failed in its part of a step", exc_info=out.failed[i])
                self._fail(seq, out.failed[i])
            else:
                logits = out.logits[at[i]] if i in at else None
                self._guard(seq, lambda s: s.advance(row, logits, picks.get(at.get(i))))

    @staticmethod
    def _pick(seqs: dict, logits) -> dict:
        """``{logits row: token}`` for ``seqs`` (``{logits row: Sequence}``) at once; ``{}`` when that
        fails (no sampler changed): each then picks alone, and a fault fails only its request."""
        try:
            return dict(zip(seqs, pick_rows([s.sampler for s in seqs.values()], logits[list(seqs)]))) if seqs else {}
        except Exception:  # noqa: BLE001 - retried row by row
            log.exception("picking a step's tokens at once failed; picking them one by one")
            return {}

    def _guard(self, seq: Sequence, op):
        """``op(seq)``; an exception fails only ``seq``; a finished ``seq`` leaves the active set."""
        result = None
        try:
            result = op(seq)
        except Exception as e:  # noqa: BLE001 - one request fails, the server goes on
            log.exception("request failed")
            self._fail(seq, e)
        self._retire(seq)
        return result

    def _fail(self, seq: Sequence, e: BaseException) -> None:
        if not seq.done:
            if not seq.closing:  # a closing request has its whole answer: only its entry is lost
                self.counters["failed"] += 1
            seq.stop("error", internal_error(e, "generation failed"))
        self._retire(seq)

    def _retire(self, seq: Sequence) -> None:
        if seq.done and seq in self._active:
            self._active.remove(seq)
            self.release(seq.job)  # nothing if its put ended it already

    def _drain(self) -> None:
        err = APIError(503, "the server is shutting down", code="shutting_down")
        for seq in self._active:
            seq.stop("cancelled", err)
            self.release(seq.job)
        self._active.clear()
        self._drain_ready()
        while True:
            try:
                self._queue.get_nowait().emit("error", error=err)
            except queue.Empty:
                break

    def _drain_ready(self) -> None:
        """Sequences the keeper prepared that never joined the batch: cancelled, their cache kept."""
        err = APIError(503, "the server is shutting down", code="shutting_down")
        for seq in self._take_ready():
            seq.stop("cancelled", err)
            self.release(seq.job)

    def _take_ready(self):
        """The sequences the keeper has prepared so far (each no longer counted as preparing); a
        None it handed back (a request it answered itself) is counted and skipped."""
        while True:
            try:
                seq = self._ready.get_nowait()
            except queue.Empty:
                return
            self._preparing -= 1
            if seq is not None:
                yield seq
