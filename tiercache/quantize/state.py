"""The lifecycle half of ``Quantize``: its state dict, export, ingest and adopt.

    (state_dict, export and adopt first settle the FiniteGuard: a poisoned layer raises its
    pending CacheError and is never saved, forked or moved)
    state_dict(q)            kind, config (the block format), window / max_length, spec, seen,
                             stored, recorded, ``residual.*``, ``sinks.*`` (attention sinks) and ``store.*`` (the
                             packed blocks as held: codes and scales, never dequantized)
    load_state_dict(q, sd)   the same block format only (``CacheError`` otherwise)
    export(q)                (keys, values, seen): blocks dequantized into fresh tensors + residual
    ingest(q, k, v, seen)    the state a layer fed ``seen`` tokens ending with ``k, v`` holds under
                             the KIVI residual rule: the first ``sink_tokens`` exact (full layers),
                             ``r(seen - sinks)`` newest tokens in the residual, the older ones in
                             whole blocks (boundaries multiples of ``group_size`` from the first
                             token after the sinks), each block quantized from its
                             full-precision values exactly as an update would
    adopt(q, other)          the held state of another Quantize of the same block format; the
                             packed rows move store to store (``store.export()`` ->
                             ``store.ingest()``), never re-quantized

Sliding layers: the store keeps the blocks that cover the window, and, while recording
(``set_recording(True)`` before the ingest, as ``retier`` does), every block packed since recording
began: the ingested layer holds what a recording layer fed the same tokens holds (its store's
blocks, residual and ``recorded`` count), so a later crop rolls back as that one's would. When the
given tokens do not start at the first token, recording is taken to have begun where they exceed
the window's ``window - 1`` (what a recording ``SlidingLayer`` holds). When ``k`` starts later than
the oldest of those blocks (a full-precision sliding layer keeps only ``window - 1`` tokens), the
missing head of that block is filled with copies of the oldest given token before it is
quantized: those positions lie before the window and are never attended, but the block's
scale spans them, so the visible part of that one block may differ slightly from a layer fed
every token (documented; every other block and the residual are exactly as fed).

The sliding rule, in full (``Policy.resolve`` decides which sliding layers are quantized: not one
whose window fits in the residual, ``window - 1 <= residual_length``). A quantized sliding layer's
state (packed rows, residual, counters; a buffer's allocated room aside) is a function of the
tokens seen and the K/V of those it holds: one update, chunks, a prefill then single tokens,
``load_state_dict``, ``adopt`` (retier within a block format) and ``ingest`` of every token all
give the same bits. ``ingest`` from a source that lacks the tokens before the window (a
full-precision sliding layer) gives the same bits too unless a block it keeps began before the
window; only those rows differ, as above. No rule can close that gap while every token of the
window stays attended: the fresh layer's record of that block's visible tokens is codes under a
scale that spans the slid-out ones, and the source has the visible tokens exactly and the
slid-out ones not at all (docs/compat.md, "A quantized sliding layer: one rule").
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from tiercache.errors import CacheError
from tiercache.quantize.finite import describe, refuse_non_finite
from tiercache.layers.state import check_ingest, expect, field, nest, part, spec_from, spec_state


def state_dict(q) -> dict:
    q.finite.settle()  # a poisoned layer is refused, never saved (quantize/finite.py)
    return {"kind": "quantize", "config": dataclasses.asdict(q.config), "window": q.window,
            "max_length": q.limit, "spec": spec_state(q.spec), "seen": q.seen, "stored": q.stored,
            "recorded": q.recorded,
            **nest("residual.", q.residual.state_dict()), **nest("sinks.", q.sinks.state_dict()),
            **nest("store.", q.store.state_dict())}


def load_state_dict(q, sd: dict) -> None:
    expect(sd, "quantize")
    saved = sd.get("config")
    if isinstance(saved, dict):  # a file from before a field existed held that field's default
        saved = {f.name: f.default for f in dataclasses.fields(q.config)} | saved
        saved["packed_attention"] = q.packed_attention  # how a step reads the blocks, not their format
    if saved != dataclasses.asdict(q.config):
        raise CacheError(f"state of a quantize layer: block format {sd.get('config')} differs from this layer's "
                         f"{dataclasses.asdict(q.config)}; use retier to change the quantization")
    spec = spec_from(sd.get("spec"))
    seen, stored = field(sd, "seen", "quantize"), field(sd, "stored", "quantize", bool)
    q.reset()
    if spec is None:
        q.store.load_state_dict(part(sd, "store."))  # empty, but a sliding store's recording flag counts
        return
    with _emptied_on_error(q):
        q.residual.load_state_dict(part(sd, "residual."), spec)
        q.sinks.load_state_dict(part(sd, "sinks."), spec)
        q.store.load_state_dict(part(sd, "store."))
    q.spec, q.codecs, q.seen, q.stored = spec, q._codecs(spec), seen, stored
    q.recorded = min(max(int(sd.get("recorded", 0)), 0), seen)  # (absent in states saved before it)


@torch.no_grad()
def export(q, parts: int = 8):
    """Every held token, oldest first: the sinks (exact), the blocks decoded a few runs at a time
    (the decoder's temporaries stay a fraction of the layer; without ``key_gain``: the tokens as
    given, quantized, for a layer of another policy to take), then the residual: fresh
    ``[B, H, S, D]`` tensors on the compute device."""
    q.finite.settle()
    if q.spec is None:
        return None
    s, g = q.spec, q.g
    rows = q.store.export()[:2] if q.stored else None  # the store's protocol: no fetch to a device mirror
    n = 0 if rows is None else rows[0].shape[2]
    held, sinks = len(q.residual), len(q.sinks)  # the sinks (the first tokens seen, exact) come first
    outs = [torch.empty((s.batch, s.heads, sinks + n * g + held, d), dtype=s.dtype, device=s.device)
            for d in (s.key_dim, s.value_dim)]  # [B, H, S, D]
    step = max(1, -(-n // parts))
    for i, out in enumerate(outs):
        if sinks:
            out.narrow(2, 0, sinks).copy_(q.sinks.view()[i])
        for at in range(0, n, step):
            m = min(step, n - at)
            q.codecs[i].decode_plain(rows[i].narrow(2, at, m).to(s.device), out.narrow(2, sinks + at * g, m * g))
        if held:
            out.narrow(2, sinks + n * g, held).copy_(q.residual.view()[i])
    return outs[0], outs[1], q.seen


@torch.no_grad()
def ingest(q, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
    from tiercache.quantize.geometry import flush_split

    spec = check_ingest(key, value, seen, "quantize", whole=q.window is None)
    if q.limit is not None and seen > q.limit:
        raise CacheError(f"static storage holds at most max_length={q.limit} tokens, cannot take {seen}; "
                         "raise max_length in the policy or use storage: full")
    refuse_non_finite(key, value, lambda: describe(key, value, seen - key.shape[2], q.g))
    sinks = min(seen, q.n_sinks)  # the first tokens stay exact (sliding layers keep none)
    if sinks:  # a full layer is given every token: the sinks are its first ones
        sink_k, sink_v = key.narrow(2, 0, sinks), value.narrow(2, 0, sinks)
        key, value = key.narrow(2, sinks, key.shape[2] - sinks), value.narrow(2, sinks, value.shape[2] - sinks)
    seen -= sinks
    g, s = q.g, key.shape[2]
    r = seen - flush_split(0, seen, q.r, g)  # residual tokens (KIVI rule)
    total = (seen - r) // g  # blocks a fed layer packed
    recorded = _recorded(q, s, seen)
    if q.window is None:
        kept = total
    else:  # blocks its store keeps: the window's when recording began, and every one packed since
        before = flush_split(0, seen - recorded, q.r, g) // g  # blocks packed when recording began
        kept = min(before, q.store_window - 1) + total - before
    need = kept * g + r
    if s < need:  # sliding: the oldest kept block starts before the given tokens (module docstring)
        key, value = (_pad_front(t, need - s) for t in (key, value))
    key, value = key.narrow(2, key.shape[2] - need, need), value.narrow(2, value.shape[2] - need, need)
    codecs = q._codecs(spec)
    q.reset()
    with _emptied_on_error(q):
        if total:
            rows = [_encode(c, t.narrow(2, 0, kept * g), g) for c, t in zip(codecs, (key, value))]  # [B, H, N, row]
            q.store.ingest(rows[0], rows[1], total)
        q.residual.replace(0, key.narrow(2, kept * g, r), value.narrow(2, kept * g, r))
        if sinks:
            q.sinks.replace(0, sink_k, sink_v)
    q.spec, q.codecs, q.seen, q.stored, q.recorded = spec, codecs, seen + sinks, bool(total), recorded


@contextlib.contextmanager
def _emptied_on_error(q):
    """A refusal (``CacheError``) inside the block leaves the layer empty, as new."""
    try:
        yield
    except CacheError:
        q.reset()
        raise


def _recorded(q, given: int, seen: int) -> int:
    """The tokens a recording sliding layer fed ``seen`` tokens recorded, from the ``given`` it
    holds: all of them when it holds every token, else those beyond the window's ``window - 1``."""
    if q.window is None or not q.recording:
        return 0
    return seen if given >= seen else max(0, given - (q.window - 1))


def adopt(q, other) -> None:
    if not q.can_adopt(other):
        raise CacheError(f"adopt: block formats differ ({other.config} vs {q.config}); use ingest(*export())")
    other.finite.settle()  # the source's pending non-finite refusal surfaces; nothing changed yet
    if other.spec is None:
        q.reset()
        return
    host_to_host = other.stored and q.store.can_adopt(other.store)  # both offloaded: rows never reach the device
    rows = other.store.export() if other.stored and not host_to_host else None  # packed rows [B, H, N, row], blocks seen
    q.reset()
    with _emptied_on_error(q):
        if host_to_host:
            q.store.adopt(other.store)
        elif rows is not None:
            q.store.ingest(*rows)
        if len(other.residual):
            q.residual.replace(0, *other.residual.view())
        if len(other.sinks):
            q.sinks.replace(0, *other.sinks.view())
    q.spec, q.codecs, q.seen, q.stored = other.spec, q._codecs(other.spec), other.seen, other.stored
    q.recorded = other.recorded


def _encode(codec, x: torch.Tensor, g: int, parts: int = 8) -> torch.Tensor:
    """``codec.encode(x)`` in a few runs of blocks (blocks are independent, so the bytes are the
    same): the encoder's temporaries stay a fraction of the layer, not a full-precision copy."""
    b, h, t, _ = x.shape
    n = t // g
    rows = torch.empty((b, h, n, codec.row_bytes), dtype=torch.uint8, device=x.device)  # [B, H, N, row]
    step = max(1, -(-n // parts))
    for at in range(0, n, step):
        m = min(step, n - at)
        rows.narrow(2, at, m).copy_(codec.encode(x.narrow(2, at * g, m * g)))
    return rows


def _pad_front(t: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` copies of the oldest token (zeros when there is none) before ``t`` ``[B, H, S, D]``."""
    b, h, s, d = t.shape
    head = t[:, :, :1].expand(b, h, n, d) if s else t.new_zeros((b, h, n, d))
    return torch.cat([head, t], dim=2)
