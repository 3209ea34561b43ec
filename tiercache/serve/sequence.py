"""One request's generation on the worker thread: ``Sequence(job, worker)``.

    row = seq.row(budget)      the tokens it feeds this step (``tiercache.serve.batch.Row``), or None
    seq.advance(row, logits, token)   after the step's forward: ``logits`` ``[V]`` when ``row.sample``;
                               ``token``: its pick when the worker sampled the batch at once (else picked here)
    seq.stop(reason, error=None)   end it early (``cancelled`` / ``timeout`` / ``error``)
    seq.done                   it has finished and handed its cache back

Phases, one row per worker step (the worker batches the rows of every active sequence):
``prefill`` (the first row checks the store out for the longest stored prefix, then feeds the
rest of the prompt, at most ``budget`` tokens per step, sampling the first token after the last
chunk), ``decode`` (the last sampled token, sampling the next), ``closing`` (after a normal
finish, with a store: the last sampled token is fed once more, no sampling, after the client has
its answer, so the entry covers the prompt plus every generated token and the next turn's
``cached_tokens`` covers the whole answer).

What goes back to the store (``hand_back``), filed under the job's scope (its tenant and
``cache_salt``: the checkout looked only there too): the cache and exactly the token ids whose K/V it
holds (``fed`` of the prompt + generated ids). A cancelled or timed-out request keeps what it fed
so far, a part of the prompt included, with no extra forward. A failed one keeps nothing.
Before it leaves the worker thread the cache is released from the worker's step workspace
(``StepWorkspace.release``: its lent layers hold their tokens in memory of their own again).

Sampling: the worker picks every sampling row of a step at once (``sampling.pick_rows`` over the
step's logits, each row through its sequence's ``Sampler``: penalties, ``logit_bias``,
temperature / ``top_p``, a generator seeded by ``seed``, log-probabilities); a forked choice's
first token, or a row whose batch pick failed, is picked here (``Sampler.pick``). The entries it recorded go out with the text they belong to (``delta`` /
``done`` events carry ``logprobs``).

Choices (``n > 1``): choice 0 prefills the prompt once; the step that samples its first token
forks its cache for each other choice (``TieredCache.fork``), each fork draws its own first token
from the same logits with its own sampler, then runs as a sequence of its own (``worker.adopt``;
a row of every later step), its events tagged ``index=i``. The store reservation
(``job.reservation``, n caches) is split between them (``store.split``), each choice's share
released when it ends; only choice 0 has a closing step and hands its cache back to the store
(``store.put(..., release=)`` ends its share first, then the entry is counted).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tiercache.cache.prefill import reserve
from tiercache.serve.batch import Row
from tiercache.serve.errors import APIError, internal_error
from tiercache.serve.sampling import Sampler
from tiercache.serve.text import TextStream


def _tagged(emit, index: int):
    return lambda kind, **data: emit(kind, index=index, **data)


class Sequence:
    def __init__(self, job, worker, choice: int = 0):
        self.job, self.w, self.choice = job, worker, choice
        req = job.request
        self.cache = None
        self.cached = 0  # prompt tokens reused from the store
        self.fed = 0  # tokens of ids + generated whose K/V the cache holds
        self.generated: list[int] = []
        self.text = TextStream(worker.codec.decode, req.stop)
        self.sampler = Sampler(req, worker.codec, worker.device, choice)
        self.done = False
        self.closing = False
        self.finish_reason = None
        self.t_first = None

    @property
    def prefilling(self) -> bool:
        return not self.done and not self.generated

    # -- steps -----------------------------------------------------------------------------------
    def row(self, budget: int) -> Row | None:
        """This step's row: a prefill chunk of at most ``budget`` tokens, or one token."""
        if self.done:
            return None
        if self.cache is None:  # without a store (with one, the keeper checked it out)
            self.checkout()
        if self.prefilling:
            ids = self.job.ids[self.fed:self.fed + max(1, budget)]
            return Row(self.cache, ids, sample=self.fed + len(ids) == len(self.job.ids), position=self.fed)
        return Row(self.cache, [self.generated[-1]], sample=not self.closing, position=self.fed)

    def advance(self, row: Row, logits: torch.Tensor | None, token: int | None = None) -> None:
        """The forward fed ``row``: count it; take ``token`` (or sample one from ``logits`` ``[V]``)
        when the row asked for logits."""
        self.fed += len(row.ids)
        if self.prefilling:
            self.w.count("prefilled_tokens", len(row.ids))
        if self.closing:
            return self.hand_back()
        if row.sample:
            if self.t_first is None:
                self.t_first = time.perf_counter()
                self.w.observe("ttft", self.t_first - self.job.submitted)
                if self.job.request.n > 1 and not self.choice:
                    self._fork_choices(logits)
            self._accept(logits, token)

    def checkout(self) -> None:
        """The store's longest prefix of the prompt, or a new cache (the keeper's thread, with a store),
        reserved for the whole prompt: a full-precision layer allocates that room once, so the
        prefill chunks land in place instead of regrowing and copying the held K/V as the history
        grows. Not ``max_tokens`` too: a stored entry keeps its capacity, and an answer that stops
        early must not leave unused room charged to the store (decode grows geometrically)."""
        ids = self.job.ids
        cache, n = self.w.store.checkout(ids, scope=self.job.scope) if self.w.store is not None else (None, 0)
        if cache is None:
            cache, n = self.w.new_cache(len(ids) + self.job.max_tokens), 0
        reserve(cache, len(ids))  # room for the whole prompt at once: no prefill chunk copies the held K/V
        self.cache, self.cached, self.fed = cache, n, n

    def _fork_choices(self, logits: torch.Tensor) -> None:
        n = self.job.request.n
        children = []
        try:
            for i in range(1, n):
                job = dataclasses.replace(self.job, reservation=None, emit=_tagged(self.job.emit, i))
                child = Sequence(job, self.w, choice=i)
                child.cache, child.cached, child.fed = self.cache.fork(), self.cached, self.fed
                child.t_first = self.t_first
                children.append(child)
        except Exception:  # this request fails whole; its full reservation is released with it
            for child in children:
                child._discard()
            raise
        if self.job.reservation is not None:  # each choice's share, released when that choice ends
            family = [self, *children]

            def split(store, whole=self.job.reservation):
                for seq, share in zip(family, store.split(whole, n)):
                    seq.job.reservation, seq.job.need = share, share.need

            self.w.store_call(split)  # before any call that releases a share: calls run in order
        for child in children:
            try:
                child._accept(logits)
            except Exception as e:  # noqa: BLE001 - this choice fails (and with it the request)
                child.stop("error", internal_error(e, "generation failed"))
            self.w.adopt(child)

    def _accept(self, logits: torch.Tensor, token: int | None = None) -> None:
        token = self.sampler.pick(logits) if token is None else token
        self.generated.append(token)
        if token in self.w.codec.eos_ids:
            return self._finish("stop")
        delta = self.text.push(token)
        if delta:
            self.job.emit("delta", text=delta, **self.sampler.take())
        if self.text.stopped:
            return self._finish("stop")
        if len(self.generated) >= self.job.max_tokens:
            return self._finish("length")

    # -- endings ---------------------------------------------------------------------------------
    def usage(self) -> dict:
        n = len(self.job.ids)
        return {"prompt_tokens": n, "completion_tokens": len(self.generated),
                "total_tokens": n + len(self.generated), "prompt_tokens_details": {"cached_tokens": self.cached}}

    def _finish(self, reason: str) -> None:
        tail = self.text.finish()
        if tail:
            self.job.emit("delta", text=tail, **self.sampler.take())
        self.finish_reason = reason
        self.job.emit("done", finish_reason=reason, usage=self.usage(), **self.sampler.take())
        if len(self.generated) > 1:
            self.w.observe("decode", (len(self.generated) - 1) / max(time.perf_counter() - self.t_first, 1e-9))
        if self.w.store is not None and not self.choice:
            self.closing = True  # the next step feeds the last token, then hands the cache back
        else:
            self.hand_back()

    def stop(self, reason: str, error=None) -> None:
        """End early: ``error`` (an APIError) is sent unless the client already has its answer;
        the cache is kept unless ``reason == 'error'``."""
        if self.done:
            return
        if error is not None and not self.closing:
            self.job.emit("error", error=error)
        if reason == "error":
            self._discard()
        else:
            self.hand_back()

    def hand_back(self) -> None:
        """The cache goes to the store with the ``fed`` token ids it holds (closed without a store)."""
        self.done = True
        cache, self.cache = self.cache, None
        if cache is None:
            return
        if self.w.store is None or self.choice or self.fed == 0:  # one entry per request: choice 0's
            cache.close()
            return self.w.workspace.release(cache)  # (closed first: nothing is copied out)
        self.w.workspace.release(cache)  # its memory its own again before the store's thread sees it
        # the reservation ends first (read when the call runs: a split may replace it), then the entry is counted
        ids, job = (self.job.ids + self.generated)[:self.fed], self.job
        self.w.store_call(lambda store: store.put(ids, cache, release=job.reservation, scope=job.scope))

    def _discard(self) -> None:
        self.done = True
        if self.cache is not None:
            self.cache.close()
            self.w.workspace.release(self.cache)  # (closed first: nothing is copied out)
            self.cache = None
