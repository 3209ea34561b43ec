"""Quality against full precision: teacher-forced decode perplexity and greedy-token agreement.

Interface (all pure functions of a model and a cache; no timing here)
- ``reference(model, ids, prompt_len) -> (nll [M], top1 [M])``: per-token NLL and argmax for
  ``ids[prompt_len:]`` from one no-cache forward pass over all of ``ids`` (the exact reference).
- ``decode_nll(model, cache, ids, prompt_len, tick=None) -> (nll [M], top1 [M])``: prefill ``ids[:prompt_len]``
  through ``cache``, then feed the continuation one token at a time (teacher forcing), so every
  prediction after the first reads the cache as it stands (quantized, offloaded, ...).
- ``reference_logp`` / ``decode_logp``: the same two passes, returning the log-probabilities ``[M, V]``
  of every prediction (``reference`` and ``decode_nll`` are their NLL and argmax).
- ``kld(ref_logp, logp) -> [M]``: KL(P_ref || Q) per position in nats, the reference distribution
  first (llama.cpp's ``--kl-divergence``); its mean is the KLD the benchmark and ``tiercache tune`` report.
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
def reference_logp(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    x = ids.to(model.device)[None]  # [1, T]
    logits = model(input_ids=x, use_cache=False).logits[0, prompt_len - 1 : -1]  # [M, V]
    return F.log_softmax(logits.float(), dim=-1).cpu()


@torch.no_grad()
def decode_logp(model, cache, ids: torch.Tensor, prompt_len: int, tick=None) -> torch.Tensor:
    x = ids.to(model.device)  # [T]
    logits = model(input_ids=x[None, :prompt_len], **cache_arg(cache), use_cache=True).logits[0, -1]  # [V]
    rows = []
    for t in range(prompt_len, x.numel()):
        rows.append(F.log_softmax(logits.float(), dim=-1).cpu())
        if t + 1 < x.numel():
            logits = model(input_ids=x[None, t : t + 1], **cache_arg(cache), use_cache=True).logits[0, -1]
            if tick:
                tick(1)
    return torch.stack(rows)  # [M, V]


def nll_top1(logp: torch.Tensor, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token NLL ``[M]`` of ``ids[prompt_len:]`` and the argmax ``[M]`` of log-probs ``[M, V]``."""
    target = ids[prompt_len:].to(logp.device)
    return -logp.gather(-1, target[:, None])[:, 0], logp.argmax(-1)


def reference(model, ids: torch.Tensor, prompt_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    return nll_top1(reference_logp(model, ids, prompt_len), ids, prompt_len)


def decode_nll(model, cache, ids: torch.Tensor, prompt_len: int, tick=None) -> tuple[torch.Tensor, torch.Tensor]:
    return nll_top1(decode_logp(model, cache, ids, prompt_len, tick), ids, prompt_len)


def kld(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``sum_v p(v) (log p(v) - log q(v))`` per position; ``[M, V]`` log-probs in, ``[M]`` out."""
    if ref_logp.shape != logp.shape:
        raise ValueError(f"kld: shapes differ: reference {tuple(ref_logp.shape)}, candidate {tuple(logp.shape)}")
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0.0)  # [M]


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
