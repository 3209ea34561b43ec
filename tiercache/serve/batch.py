"""One forward over several sequences, each against its own ``TieredCache``: ``run_rows(model, rows)``.

    rows = [Row(cache, [12, 7, 9], sample=True), Row(other_cache, [42]), ...]
    out = run_rows(model, rows, workspace)   # workspace: a StepWorkspace kept across steps (optional)
    out.logits      # [R, V] float32: the last token's logits of each row with ``sample=True``, in row order
                    # (no row samples: ``[0, V]``, and the LM head projects no token)
    out.failed      # {row index: exception}: rows whose own part failed (their cache is then inconsistent)

Design (the batch is a scheduling fact, not a cache fact; DESIGN.md, wave 3). The rows are
*packed*, not padded: their tokens are concatenated into one ``[1, T]`` input (``T`` = the sum of
the rows' tokens: one per decoding sequence, a prefill chunk for each prefilling one), with position ids
per row (each row continues from its cache's length). Everything that is per token (embedding,
norms, projections, RoPE, MLP, the LM head) runs once over the ``T`` tokens: the weights are
read once per step whatever the number of sequences, which is where batching wins.
Attention runs through transformers' ``AttentionInterface``: during ``run_rows`` the model's
attention implementation is ``tiercache_packed`` and its cache argument is a ``PackedCache`` over
the rows' caches. Each attention layer calls ``PackedCache.update(k, v, layer)`` with the packed
``[1, Hkv, T, D]`` keys and values. Then:

- the *decoding* rows (one token) whose layer stores every token at full precision
  (``FullLayer``), when there are two or more, are **joined** (``workspace.StepWorkspace``, planned
  once per step): their layers' buffers are slots of one padded K/V per layer, so one indexed
  write stores every joined row's new token in its own cache, and one SDPA with a padding mask
  attends all of them; the masks and index tensors are made once per step;
- every other row (a prefill chunk; a quantized, offloaded or sliding layer; an empty cache) is
  split off and goes through its own ``TieredCache.update`` (so each conversation keeps its own
  policy, tiers, quantization and offload, untouched), and takes its own queries ``[1, H, t, D]``
  against the keys ``[1, Hkv, L, D]`` it returned with SDPA, with its own causal mask: the
  returned keys are the newest ``L`` tokens of the row (a sliding layer returns its window), so
  key ``j`` sits at position ``p + t - L + j`` for queries at ``p .. p + t - 1``; a query sees a
  key at or before it, and within ``sliding_window`` when the layer is a sliding one. A decoding
  row (``t = 1``) needs no mask. A soft-capped model (Gemma 2) attends every row on its own with
  ``eager`` maths, the joined ones over their slots.

When every token of the step is a joined row's (a step of decoding only), nothing is split or
copied per row: the packed keys, queries and outputs are used as they are.
transformers builds no mask of its own for an implementation it has no mask function for. The
rows' outputs are put back in packed order; ``o_proj`` and the rest run batched again.

Faults: a row whose cache update or attention raises is recorded in ``failed`` and given
stand-in keys (its new tokens alone) so the other rows' forward goes on (a fault of the batched
call fails the rows in it); its logits are
meaningless and its cache must be discarded. An exception outside the per-row parts (the
model's own layers) propagates: no row can be trusted then.

Numerics: at full precision each row's logits match its run alone within float32 rounding
(the projections of a packed ``[1, T]`` input group the same sums differently, ~1e-6).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiercache.cache.compat import cache_arg
from tiercache.serve.workspace import StepWorkspace

NAME = "tiercache_packed"


@dataclass(eq=False)
class Row:
    cache: object  # a TieredCache (anything with update(k, v, layer_idx) and get_seq_length())
    ids: list  # token ids to feed after what the cache holds
    sample: bool = True  # keep the last token's logits
    position: int | None = None  # the first token's position (default: the cache's length)


@dataclass
class Output:
    logits: torch.Tensor  # [R, V] for the rows with sample=True, in row order
    failed: dict = field(default_factory=dict)  # row index -> exception


class PackedCache:
    """What the model sees as its cache during a packed forward: at each layer, the rows joined in
    the step workspace (``step.rows(layer)``) take their new token in one write; every other row
    is split off and goes through its own ``TieredCache.update``."""

    def __init__(self, rows: list[Row], spans: list[tuple[int, int]], positions: list[int], workspace, step):
        self.rows, self.spans, self.positions = rows, spans, positions
        self.workspace, self.step = workspace, step  # step: the workspace's plan (None: no row joins)
        self.failed: dict[int, BaseException] = {}
        self.kv: list = [None] * len(rows)  # per row on its own: (keys, values) of the layer being run
        self.layer = None  # the layer being run
        self.joined: tuple = ()  # rows of this layer in the workspace
        self._alone: dict[tuple, list] = {}  # joined rows -> the other rows (one list per set)
        self.masks: dict[tuple, torch.Tensor | None] = {}  # a row's attention mask, made once per step (_attend)

    # transformers asks these of a cache; answered for the packed input as a whole
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def alone(self) -> list[int]:
        """The rows of this layer that are not joined (each its own update and attention)."""
        rows = self._alone.get(self.joined)
        if rows is None:
            joined = set(self.joined)
            rows = self._alone[self.joined] = [i for i in range(len(self.rows)) if i not in joined]
        return rows

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # [1, Hkv, T, D]
        self.layer = layer_idx
        self.joined = self.step.rows(layer_idx) if self.step is not None else ()
        if self.joined:
            try:
                self.workspace.write(self.step, layer_idx, key_states, value_states)
            except Exception as e:  # noqa: BLE001 - these rows fail, the others go on
                for i in self.joined:
                    self.failed.setdefault(i, e)
        for i in self.alone():
            row, (a, b) = self.rows[i], self.spans[i]
            k, v = key_states[:, :, a:b], value_states[:, :, a:b]  # [1, Hkv, t, D]
            if i not in self.failed:
                try:
                    self.kv[i] = row.cache.update(k, v, layer_idx)
                    continue
                except Exception as e:  # noqa: BLE001 - this row fails, the others go on
                    self.failed[i] = e
            self.kv[i] = (k, v)
        return key_states, value_states


def packed_attention(module, query, key, value, attention_mask, *, scaling=None, sliding_window=None,
                     softcap=None, dropout=0.0, tiercache_rows: PackedCache = None, **kwargs):
    """The ``AttentionInterface`` function: the joined decoding rows in one call over the step
    workspace, every other row its own queries against its own cache's keys."""
    batch = tiercache_rows
    if batch is None:
        raise RuntimeError(f"the {NAME!r} attention runs only inside tiercache.serve.batch.run_rows")
    joined = batch.joined
    if joined and softcap is None:
        group = batch.step.group(batch.layer)
        try:
            res = batch.workspace.attend(batch.step, batch.layer, query, scaling=scaling,
                                         window=sliding_window)  # [R, H, D]
        except Exception as e:  # noqa: BLE001 - these rows fail, the others go on
            for i in joined:
                batch.failed.setdefault(i, e)
            res = query.new_zeros(len(joined), query.shape[1], query.shape[3])
        if group.at is None:  # the pack is these rows' tokens, in order
            return res.unsqueeze(0), None  # [1, T, H, D]
    out = torch.empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3],
                      dtype=query.dtype, device=query.device)  # [1, T, H, D]
    alone = batch.alone()
    if joined and softcap is None:
        out[0, group.at.to(out.device)] = res
    elif joined:  # a soft-capped model: each joined row on its own, over its slot
        alone = [*joined, *alone]
        for i in joined:
            batch.kv[i] = batch.workspace.kv(batch.step, batch.layer, i)
    for i in alone:
        a, b = batch.spans[i]
        k, v = batch.kv[i]  # [1, Hkv, L, D]
        q = query[:, :, a:b]  # [1, H, t, D]
        try:
            out[:, a:b] = _attend(q, k, v, batch.positions[i], scaling, sliding_window, softcap,
                                  batch.masks).transpose(1, 2)
        except Exception as e:  # noqa: BLE001 - this row fails, the others go on
            batch.failed.setdefault(i, e)
            out[:, a:b] = 0
    return out, None


def _mask(t: int, length: int, position: int, window, device) -> torch.Tensor | None:
    """``[t, L]`` bool (True: attend) for queries at ``position ..`` over the newest ``L`` keys; None: all."""
    if t == 1 and (window is None or length <= window):
        return None
    q = torch.arange(position, position + t, device=device)[:, None]  # [t, 1]
    k = torch.arange(position + t - length, position + t, device=device)[None, :]  # [1, L]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    return mask


def _attend(q, k, v, position, scaling, window, softcap, masks: dict | None = None):
    """``[1, H, t, D]`` attention of ``q`` ``[1, H, t, D]`` over ``k``, ``v`` ``[1, Hkv, L, D]``.
    ``masks``: where the mask is kept for the next layer of the same step (every layer of a row
    has the same shape and positions; a long prefill chunk's mask is ``t x L``)."""
    _, heads, t, dim = q.shape
    length, groups = k.shape[2], q.shape[1] // k.shape[1]
    folds = groups if softcap is None else 1
    key = (t, length, position, window, folds, q.device)
    if masks is not None and key in masks:
        mask = masks[key]
    else:
        mask = _mask(t, length, position, window, q.device)
        if mask is not None and folds > 1:
            mask = mask.repeat(folds, 1)  # [g*t, L]: the folded query rows below
        if masks is not None:
            masks[key] = mask
    if softcap is None:  # the query heads sharing a K/V head folded into its query rows: one SDPA, no repeat
        folded = q.reshape(1, k.shape[1], groups * t, dim)  # [1, Hkv, g*t, D]
        out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scaling)
        return out.reshape(1, heads, t, dim)  # [1, Hkv, g*t, D] -> [1, H, t, D]: a GPU backend may lay it out head-last
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [1, H, L, D]
    scores = torch.matmul(q, k.transpose(2, 3)) * (scaling if scaling is not None else dim ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap  # [1, H, t, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, packed_attention)
        _registered = True


@contextmanager
def _implementation(model):
    """The model's attention implementation is ``NAME`` inside, its own again after."""
    _register()
    config = model.config
    before = {"": config._attn_implementation}  # the setter recurses into sub-configs: restore each one's
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            before[key] = getattr(sub, "_attn_implementation", None)
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = before


def run_rows(model, rows: list[Row], workspace: StepWorkspace | None = None) -> Output:
    """One forward of ``model`` over ``rows`` (each ``ids`` non-empty), each against its own cache.
    ``workspace``: the step workspace kept across steps (default: a new one, dropped after)."""
    if not rows or any(not row.ids for row in rows):
        raise ValueError("run_rows needs at least one row, each with at least one token id")
    device = next(model.parameters()).device
    spans, positions, ids, pos, keep = [], [], [], [], []
    for row in rows:
        start = row.cache.get_seq_length() if row.position is None else row.position
        a = len(ids)
        ids.extend(row.ids)
        pos.extend(range(start, start + len(row.ids)))
        spans.append((a, len(ids)))
        positions.append(start)
        if row.sample:
            keep.append(len(ids) - 1)
    own = workspace is None  # a workspace for this call only: every cache's memory its own again after
    workspace = StepWorkspace() if own else workspace
    members, seen = [], set()
    for i, row in enumerate(rows):  # one slot per cache (a cache twice in a step is its own call)
        if len(row.ids) == 1 and id(row.cache) not in seen:
            members.append((i, row.cache, positions[i], spans[i][0]))
        seen.add(id(row.cache))
    step = workspace.plan(members, len(ids))  # fewer than two: none joins, and no copy is kept
    batch = PackedCache(rows, spans, positions, workspace, step)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
    position_ids = torch.tensor([pos], dtype=torch.long, device=device)  # [1, T]
    # [R]; none (a step of closing rows only: their K/V are wanted, not their logits) skips the LM head
    logits_to_keep = torch.tensor(keep, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), _implementation(model):
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=logits_to_keep,
                        tiercache_rows=batch, **cache_arg(batch))
    finally:
        if own:
            workspace.clear()
    logits = out.logits[0].float()  # [R, V]
    return Output(logits, batch.failed)
