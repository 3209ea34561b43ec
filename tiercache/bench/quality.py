"""Quality against full precision: teacher-forced decode perplexity and greedy-token agreement.

Interface (all pure functions of a model and a cache; no timing here)
- ``reference(model, ids, prompt_len) -> (nll [M], top1 [M])``: per-token NLL and argmax for
  ``ids[prompt_len:]`` from one no-cache forward pass over all of ``ids`` (the exact reference).
- ``decode_nll(model, cache, ids, prompt_len, tick=None) -> (nll [M], top1 [M])``: prefill ``ids[:prompt_len]``
  through ``cache``, then feed the continuation one token at a time (teacher forcing), so every
  prediction after the first reads the cache as it stands (quantized, offloaded, ...).
- ``perplexity(nll) -> float``: ``exp(mean(nll))``.
- ``agreement(a, b) -> float``: fraction of positions where two token sequences agree.
- ``prefix_match(a, b) -> int``: length of their common prefix.

``ids`` is ``[T]`` (batch 1); ``M = T - prompt_len`` predictions, of ``ids[prompt_len]`` ...
``ids[T-1]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tiercache.cache.compat import cache_arg


@torch.no_grad()
def reference(model, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = ids.to(model.device)[None]  # [1, T]
    logits = model(input_ids=x, use_cache=False).logits[0, prompt_len - 1 : -1].float()  # [M, V]
    nll = F.cross_entropy(logits, x[0, prompt_len:], reduction="none")  # [M]
    return nll.cpu(), logits.argmax(-1).cpu()


@torch.no_grad()
def decode_nll(model, cache, ids: torch.Tensor, prompt_len: int, tick=None) -> tuple[torch.Tensor, torch.Tensor]:
    x = ids.to(model.device)  # [T]
    logits = model(input_ids=x[None, :prompt_len], **cache_arg(cache), use_cache=True).logits[0, -1]  # [V]
    nll, top1 = [], []
    for t in range(prompt_len, x.numel()):
        logits = logits.float()
        nll.append(F.cross_entropy(logits[None], x[t : t + 1]))
        top1.append(logits.argmax())
        if t + 1 < x.numel():
            logits = model(input_ids=x[None, t : t + 1], **cache_arg(cache), use_cache=True).logits[0, -1]
            if tick:
                tick(1)
    return torch.stack(nll).cpu(), torch.stack(top1).cpu()  # [M], [M]


def perplexity(nll: torch.Tensor) -> float:
    return math.exp(nll.double().mean().item())


def agreement(a, b) -> float:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    n = min(a.numel(), b.numel())
    return float((a[:n] == b[:n]).double().mean().item()) if n else 1.0


def prefix_match(a, b) -> int:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0].item()) if diff.numel() else n
