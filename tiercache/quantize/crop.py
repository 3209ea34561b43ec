"""Crops of a ``Quantize`` layer (``tiercache.quantize.processor``): its ``validate_crop`` and ``crop``.

    validate(q, n)   ``CacheError`` (nothing changed) when ``crop(q, n)`` would be refused
    crop(q, n)       remove the newest ``n`` tokens (past the start: every token, as transformers'
                     ``DynamicLayer``)

A crop within the residual truncates it; one reaching into the blocks drops whole blocks from the
store and moves the kept head of the cut block back into the residual, dequantized (what attention
saw); one past the tokens after the attention sinks takes the newest sinks too. Emptying the
layer (or everything after its sinks) is always exact, even on a sliding layer whose window
dropped blocks. Every path forgets the non-finite flags of the updates it drops (``FiniteGuard``).
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import check_crop


def _crop_into_blocks(q, n: int) -> None:
    """Drop the blocks the crop reaches; the kept head of the cut block goes back to the residual."""
    drop, keep, blocks, have = _crop_blocks(q, n)
    restored = None
    if keep:
        at = have - drop
        restored = [torch.empty((*b.shape[:2], q.g, d), dtype=q.spec.dtype, device=b.device)
                    for b, d in zip(blocks, (q.spec.key_dim, q.spec.value_dim))]  # [B, H, G, D]
        for codec, b, out in zip(q.codecs, blocks, restored):
            codec.decode_plain(b[:, :, at : at + 1], out)  # back to the residual as given
    q.store.crop(drop)  # raises (nothing changed yet) when the store cannot
    q.residual.clear()
    if restored is not None:
        device = q.spec.device
        q.residual.replace(0, restored[0][:, :, :keep].to(device), restored[1][:, :, :keep].to(device))


def validate(q, n: int) -> None:
    n = check_crop(n, q.seen)  # past the start: every token (transformers empties the layer)
    after = q.seen - len(q.sinks)  # tokens after the sinks; a crop past them takes sinks too
    n = min(n, after)
    if len(q.residual) < n < after:  # (emptying everything after the sinks is always exact)
        _crop_blocks(q, n)


def _crop_blocks(q, n: int):
    """For a crop reaching into the blocks: (blocks dropped, tokens of the cut block kept,
    the held blocks, how many); raises ``CacheError``, changing nothing, when it cannot."""
    cut = n - len(q.residual)  # tokens to remove from the blocks
    drop = -(-cut // q.g)  # whole blocks dropped from the store
    keep = drop * q.g - cut  # head of the cut block that stays (dequantized)
    blocks = q._held_blocks()
    have = 0 if blocks is None else blocks[0].shape[2]
    if drop > have:
        raise CacheError(
            f"cannot crop {n} tokens: {cut} of them are in quantized blocks but only {have} blocks "
            f"({have * q.g} tokens) are kept; tokens before the window are gone; call "
            "activate_past_recording() before updates you may want to roll back"
        )
    try:
        q.store.validate_crop(drop)
    except CacheError:  # the store speaks in blocks; say it in tokens
        # from None: the store's refusal counts blocks of a store the caller never sees; chaining
        # it would show a second, contradictory-looking message in block units
        raise CacheError(
            f"cannot crop {n} tokens from a quantized sliding layer (window {q.window}): the blocks "
            "before the window are gone; call activate_past_recording() before "
            "updates you may want to roll back"
        ) from None
    return drop, keep, blocks, have


def crop(q, n: int) -> None:
    n = check_crop(n, q.seen)  # past the start: every token (transformers empties the layer)
    extra = max(0, n - (q.seen - len(q.sinks)))  # the newest sinks go too
    _crop_after_sinks(q, n - extra)
    q.sinks.truncate(extra)
    q.seen -= extra
    q.finite.crop_to(q.seen)  # every path: a flag of a dropped update no longer counts


def _crop_after_sinks(q, n: int) -> None:
    if n and n == q.seen - len(q.sinks):  # everything after the sinks, whatever a window dropped
        if q.stored:
            q.store.crop(q.store.seq_length())
        q.residual.clear()
    elif n <= len(q.residual):
        if q.stored:
            q.store.crop(0)  # a sliding store trims what it kept for a rollback
        q.residual.truncate(n)
    else:
        _crop_into_blocks(q, n)
    q.seen -= n
    q.recorded = 0
