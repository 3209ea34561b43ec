"""Teacher-forced decoding from a seeded cache: perplexity, top-1 and decode time of one setup.

Interface
- ``teacher_forced(model, cache, prefilled, continuation) -> Forced``: ``cache`` holds the prompt
  (``seeded.seed``); the first prediction is the prefill's last logits, then each token of
  ``continuation`` ``[M]`` is fed alone (one decode step, reading the cache as it stands), so
  ``M`` predictions are scored. ``Forced``: ``nll`` ``[M]``, ``top1`` ``[M]``, ``seconds`` (the
  ``M - 1`` decode steps, wall clock) and ``steps``.
- ``greedy(model, cache, prefilled, steps) -> list[int]``: free-running greedy tokens from the
  prefill's last logits (``steps + 1`` tokens).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tiercache.cache.compat import cache_arg


@dataclass
class Forced:
    nll: torch.Tensor  # [M]
    top1: torch.Tensor  # [M]
    seconds: float
    steps: int

    @property
    def tok_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else float("nan")


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def teacher_forced(model, cache, prefilled, continuation: torch.Tensor) -> Forced:
    x = continuation.to(model.device)  # [M]
    logits = prefilled.logits
    nll, top1 = [], []
    _sync(model.device)
    start = time.perf_counter()
    for t in range(x.numel()):
        logits = logits.float()
        nll.append(F.cross_entropy(logits[None], x[t : t + 1]))
        top1.append(logits.argmax())
        if t + 1 < x.numel():
            logits = model(input_ids=x[None, t : t + 1], **cache_arg(cache), use_cache=True).logits[0, -1]
    _sync(model.device)
    seconds = time.perf_counter() - start
    return Forced(torch.stack(nll).cpu(), torch.stack(top1).cpu(), seconds, x.numel() - 1)


@torch.no_grad()
def greedy(model, cache, prefilled, steps: int) -> list[int]:
    nxt = prefilled.logits.argmax().view(1, 1)  # [1, 1]
    out = [int(nxt)]
    for _ in range(steps):
        nxt = model(input_ids=nxt, **cache_arg(cache), use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        out.append(int(nxt))
    return out
