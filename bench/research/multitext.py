"""Perplexity over many held-out texts at once: one batched teacher-forced decode, per-text deltas
and their spread.

Interface
- ``windows(tokenizer, kind, count, length, split="heldout") -> ids [N, length]``: ``count``
  non-overlapping windows of the kind's token stream (``texts.code`` / ``texts.prose`` of
  ``split``), in order. ``ValueError`` for an unknown kind or a text too short.
- ``prefill(model, ids [N, P]) -> seeded.Prefilled``: each text prefilled alone (``seeded``;
  no padding, no cross-text attention), then stacked: ``kv`` ``[N, H, P, D]``, ``logits`` ``[N, V]``.
- ``teacher_forced(model, cache, prefilled, continuation [N, M]) -> forced.Forced`` with ``nll`` and
  ``top1`` ``[N, M]``: every text decoded in one batch, one token per step (rows are independent:
  every cache here quantizes each batch row on its own).
- ``spread(nll [N, M], ref_nll [N, M], draws=2000, seed=0) -> dict``: ``per_text`` perplexity
  increase of each text over the reference, their ``mean``, ``lo`` / ``hi`` (a 90% bootstrap
  interval of the mean over texts) and ``pooled`` (the ratio of perplexities over all tokens).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from research import forced, seeded, texts
from tiercache.cache.compat import cache_arg


def windows(tokenizer, kind: str, count: int, length: int, split: str = "heldout") -> torch.Tensor:
    if count < 1 or length < 1:
        raise ValueError(f"windows: count and length must be >= 1, got {count} and {length}")
    if kind not in texts.KINDS:
        raise ValueError(f"text kind must be one of {', '.join(texts.KINDS)}, got {kind!r}")
    text = (texts.code if kind == "code" else texts.prose)(split, max_chars=8 * count * length + 4096)
    ids = texts.encode(tokenizer, text)
    if len(ids) < count * length:
        raise ValueError(f"{split} {kind} text gives {len(ids)} tokens, {count} x {length} asked")
    return torch.tensor(ids[: count * length], dtype=torch.long).view(count, length)  # [N, L]


@torch.no_grad()
def prefill(model, ids: torch.Tensor) -> seeded.Prefilled:
    parts = [seeded.prefill(model, row) for row in ids]  # each [1, H, P, D]
    kv = [tuple(torch.cat([p.kv[i][j] for p in parts]) for j in range(2)) for i in range(len(parts[0].kv))]
    return seeded.Prefilled(kv, torch.stack([p.logits for p in parts]))  # [N, H, P, D], [N, V]


@torch.no_grad()
def teacher_forced(model, cache, prefilled, continuation: torch.Tensor) -> forced.Forced:
    x = continuation.to(model.device)  # [N, M]
    logits = prefilled.logits  # [N, V]
    nll, top1 = [], []
    forced._sync(model.device)
    start = time.perf_counter()
    for t in range(x.shape[1]):
        logits = logits.float()
        nll.append(F.cross_entropy(logits, x[:, t], reduction="none"))  # [N]
        top1.append(logits.argmax(-1))
        if t + 1 < x.shape[1]:
            logits = model(input_ids=x[:, t : t + 1], **cache_arg(cache), use_cache=True).logits[:, -1]
    forced._sync(model.device)
    seconds = time.perf_counter() - start
    return forced.Forced(torch.stack(nll, 1).cpu(), torch.stack(top1, 1).cpu(), seconds, x.shape[1] - 1)


def spread(nll: torch.Tensor, ref_nll: torch.Tensor, draws: int = 2000, seed: int = 0) -> dict:
    if nll.shape != ref_nll.shape or nll.dim() != 2:
        raise ValueError(f"spread: nll and ref_nll must both be [N, M], got {tuple(nll.shape)} and {tuple(ref_nll.shape)}")
    per = (nll.double().mean(1) - ref_nll.double().mean(1)).exp() - 1  # [N]: ppl ratio per text - 1
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, per.numel(), (draws, per.numel()), generator=gen)  # [draws, N]
    means = per[pick].mean(1).sort().values
    lo, hi = means[int(0.05 * (draws - 1))].item(), means[int(0.95 * (draws - 1))].item()
    pooled = (nll.double().mean() - ref_nll.double().mean()).exp().item() - 1
    return {"per_text": per.tolist(), "mean": per.mean().item(), "lo": lo, "hi": hi, "pooled": pooled}
