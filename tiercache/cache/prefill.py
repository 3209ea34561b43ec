"""Chunked prefill: a long prompt goes through the cache in chunks, then ``model.generate`` decodes.

Interface
    generate(model, input_ids, cache, prefill_chunk=None, attention_mask=None, **generate_kwargs)
        -> what ``model.generate`` returns (the prompt and the new tokens)
    prefill(model, input_ids, cache, chunk, attention_mask=None) -> None
        runs ``input_ids`` through ``cache`` in chunks of ``chunk`` tokens (no logits kept)
    reserve(cache, tokens) -> None
        tells each layer of ``cache`` the context it will hold (the layer protocol's ``reserve``
        hook; no-op for caches without it): a full-precision buffer (host or device) then
        allocates that room once, and the chunks copy nothing when they land. ``prefill``
        reserves the prompt, ``generate`` the prompt plus ``max_new_tokens``.

Why: ``generate`` prefills the whole prompt in one forward, so its activations grow with the
prompt (at 128k tokens one MLP activation of an 8B model is 3.7 GB). In chunks of ``C`` tokens
they grow with ``C`` (the attention over the whole history is still needed: see
``tiercache.planner.activations``), and the planner says which ``C`` fits (``Plan.prefill_chunk``).

How: all prompt tokens but the last are run through ``model(input_ids=chunk,
cache=cache, attention_mask=mask[:, :end], position_ids=..., logits_to_keep=1)``
under ``torch.no_grad()``; positions follow ``generate``'s rule (``cumsum(mask) - 1``, padding at
0; without a mask ``arange``). Then ``model.generate`` gets the whole prompt and its mask with the
cache already holding all but the last token: as transformers does when continuing from a
cache, it feeds only the tokens the cache has not seen (the last one) and decodes from there.
Any ``transformers.Cache`` works (``TieredCache``, ``DynamicCache``, ``QuantizedCache`` ...), in
every layer kind (quantized, offloaded, sliding windows: a sliding layer keeps its window across
chunks as across decode steps).

Exactness: at full precision a chunked prefill computes the same attention as a one-shot one,
but the matrix products run on different shapes, so logits agree to float rounding (fp32:
within 1e-4 relative on the test models), not bit for bit; greedy tokens are equal unless two
logits tie within that rounding.

Errors: ``ValueError`` (``tiercache.CacheError``) for a chunk that is not an int >= 1, input ids
that are not ``[batch, tokens]`` integers, a mask of another shape, or a cache that already
holds tokens (``prefill`` appends a whole prompt; crop or reset it first).
"""

from __future__ import annotations

import inspect

import torch

from tiercache.cache.compat import cache_arg
from tiercache.errors import CacheError


def generate(model, input_ids: torch.Tensor, cache, prefill_chunk: int | None = None, attention_mask=None,
             **generate_kwargs):
    """Prefill ``input_ids`` in chunks of ``prefill_chunk`` tokens (default: the plan's, for the
    cache's policy, else 2048), then ``model.generate(..., cache=cache)``
    (the keyword of ``tiercache.cache.compat``: ``past_key_values`` on older transformers)."""
    _check_ids(input_ids, attention_mask)
    if prefill_chunk is None:
        prefill_chunk = default_chunk(model, input_ids, cache, generate_kwargs.get("max_new_tokens") or 0)
    reserve(cache, input_ids.shape[1] + (generate_kwargs.get("max_new_tokens") or 0))
    prefill(model, input_ids[:, :-1], cache, prefill_chunk,
            None if attention_mask is None else attention_mask[:, :-1])
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return model.generate(input_ids, attention_mask=attention_mask, **cache_arg(cache), **generate_kwargs)


@torch.no_grad()
def prefill(model, input_ids: torch.Tensor, cache, chunk: int, attention_mask=None) -> None:
    _check_ids(input_ids, attention_mask, allow_empty=True)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise CacheError(f"prefill_chunk must be an int >= 1 (tokens per prefill forward), got {chunk!r}")
    if cache.get_seq_length() != 0:
        raise CacheError(f"prefill needs an empty cache, this one holds {cache.get_seq_length()} tokens; "
                         "reset() or crop it first")
    n = input_ids.shape[1]
    reserve(cache, n)
    if attention_mask is not None:
        positions = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # [B, T]
    else:
        positions = torch.arange(n, device=input_ids.device).unsqueeze(0)  # [1, T]
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        mask = attention_mask[:, :end] if attention_mask is not None else torch.ones(
            input_ids.shape[0], end, dtype=torch.long, device=input_ids.device)
        model(input_ids=input_ids[:, start:end], attention_mask=mask, position_ids=positions[:, start:end],
              **cache_arg(cache), use_cache=True, **keep)


def reserve(cache, tokens: int) -> None:
    for layer in getattr(cache, "layers", ()):
        hook = getattr(layer, "reserve", None)
        if callable(hook):
            hook(tokens)


def default_chunk(model, input_ids: torch.Tensor, cache, new_tokens: int = 0) -> int:
    """The plan's chunk for this cache's policy and model (2048 capped at the prompt without one)."""
    from tiercache.planner.activations import DEFAULT_CHUNK

    policy = getattr(cache, "policy", None)
    if policy is None:
        return min(DEFAULT_CHUNK, max(1, input_ids.shape[1]))
    from tiercache.planner.api import plan

    device = "cuda" if input_ids.device.type == "cuda" else "cpu"
    p = plan(policy, model, input_ids.shape[0], input_ids.shape[1] + new_tokens, device=device)
    return p.prefill_chunk


def _check_ids(input_ids, attention_mask, allow_empty: bool = False) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        got = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise CacheError(f"input_ids must be an integer tensor [batch, tokens], got {got}")
    if input_ids.shape[1] == 0 and not allow_empty:
        raise CacheError("input_ids holds no tokens: give at least one prompt token")
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
        raise CacheError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {got}")
