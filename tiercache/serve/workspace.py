"""One attention call per layer for the decoding rows of a step: ``StepWorkspace``.

    ws = StepWorkspace()                       # the worker keeps one across steps
    slots = ws.begin(caches)                   # each decoding row's slot (rows of earlier steps keep theirs)
    out = ws.attend(layer, slots, lengths, views, new_k, new_v, query, scaling=..., window=None)  # [R, H, D]
    ws.nbytes() -> {"workspace": bytes}

Why: a step of R decoding sequences would otherwise run R attention calls per layer, each with
its own Python. Here each full-precision layer keeps a padded copy of the rows' keys and values,
``keys`` / ``values`` ``[S, Hkv, C, D]`` (slot ``s`` holds one sequence, tokens ``0 .. n_s - 1``
at their positions), and the step's queries attend to all of it in one SDPA call with a padding
mask. The copy is kept across steps: a sequence that decoded at the previous step only has its
newest token written (one indexed write for all rows); a sequence new to its slot, or whose
cache no longer matches what the slot holds (its length moved otherwise than by one token), is
copied in whole once. Capacity grows geometrically (tokens by 1.5x, slots as needed), so no step
concatenates a history.

What may join (decided by the caller, ``batch.PackedCache``): a row feeding one token whose
layer stores every token at full precision (``FullLayer``: what it returns is what it was given,
tokens ``0 .. position``), with the step's dtype. Everything else (prefill chunks, quantized,
offloaded and sliding-window storage, soft-capped attention) keeps its own call. The copy is of
what the sequence's own cache returned: its ``TieredCache`` still takes every update, and its
policy, tiers and store entry are its own; the workspace only reads.

Memory: the workspace holds a second copy of the joined layers' K/V, padded to the longest
row (``nbytes``); it is dropped when a step has no decoding row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOKEN_ROUND = 128  # capacity unit (tokens)


class _Layer:
    """The padded copy of one layer: ``keys`` / ``values`` ``[S, Hkv, C, D]``, ``held[s]`` tokens of slot ``s``."""

    def __init__(self, like: torch.Tensor, slots: int, tokens: int):  # like: [R, Hkv, D]
        shape = (slots, like.shape[1], tokens, like.shape[2])
        self.keys = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.values = torch.zeros(shape, dtype=like.dtype, device=like.device)
        self.held = [0] * slots

    def fits(self, like: torch.Tensor) -> bool:
        return (self.keys.dtype, self.keys.device, self.keys.shape[1], self.keys.shape[3]) == \
            (like.dtype, like.device, like.shape[1], like.shape[2])

    def grown(self, slots: int, tokens: int) -> "_Layer":
        """This layer with room for ``slots`` slots and ``tokens`` tokens (self when it has it)."""
        s, _, c, _ = self.keys.shape
        if slots <= s and tokens <= c:
            return self
        c2 = c if tokens <= c else _round(max(tokens, c + c // 2))
        bigger = _Layer(self.keys[:, :, 0], max(slots, s), c2)  # like: [S, Hkv, D]
        bigger.keys[:s, :, :c] = self.keys
        bigger.values[:s, :, :c] = self.values
        bigger.held[:s] = self.held
        return bigger


def _round(n: int) -> int:
    return -(-n // TOKEN_ROUND) * TOKEN_ROUND


class StepWorkspace:
    def __init__(self):
        self._slot: dict[int, tuple[object, int]] = {}  # id(cache) -> (cache, slot)
        self._layers: dict[int, _Layer] = {}

    def begin(self, caches: list) -> list[int]:
        """The slot of each cache of this step's decoding rows. Slots of caches not in the step are
        freed (their sequence ended or is not decoding); a new cache takes the lowest free slot and
        is copied in whole at its first ``attend``. No cache at all: the memory is dropped."""
        keep = {id(c) for c in caches}
        for key in [k for k in self._slot if k not in keep]:
            del self._slot[key]
        if not caches:
            self._layers.clear()
            return []
        used = {s for _, s in self._slot.values()}
        slots, free = [], (s for s in range(len(caches) + len(used)) if s not in used)
        for cache in caches:
            entry = self._slot.get(id(cache))
            if entry is None or entry[0] is not cache:
                entry = (cache, next(free))
                self._slot[id(cache)] = entry
                for layer in self._layers.values():  # what the slot held belonged to another sequence
                    if entry[1] < len(layer.held):
                        layer.held[entry[1]] = -1
            slots.append(entry[1])
        return slots

    def attend(self, layer: int, slots: list[int], lengths: list[int], views: list, new_k: torch.Tensor,
               new_v: torch.Tensor, query: torch.Tensor, *, scaling=None, window=None) -> torch.Tensor:
        """``[R, H, D]``: one SDPA of ``query`` ``[R, H, D]`` (row ``r``'s one token at position
        ``lengths[r] - 1``) over slot ``slots[r]``, whose cache returned ``views[r]`` (``(k, v)``,
        ``[1, Hkv, lengths[r], D]``) after taking ``new_k`` / ``new_v`` ``[R, Hkv, D]``."""
        space = self._layers.get(layer)
        if space is None or not space.fits(new_k):
            space = _Layer(new_k, max(slots) + 1, _round(max(lengths)))
        space = self._layers[layer] = space.grown(max(slots) + 1, max(lengths))
        for s, n, (k, v) in zip(slots, lengths, views):
            if space.held[s] != n - 1:  # new to the slot, or moved otherwise: copy it in whole
                space.keys[s, :, :n - 1] = k[0, :, :n - 1]
                space.values[s, :, :n - 1] = v[0, :, :n - 1]
            space.held[s] = n
        slot_t = torch.tensor(slots, device=new_k.device)  # [R]
        length_t = torch.tensor(lengths, device=new_k.device)  # [R]
        space.keys[slot_t, :, length_t - 1] = new_k  # [R, Hkv, D]: the newest token of every row at once
        space.values[slot_t, :, length_t - 1] = new_v
        return self._sdpa(space, slot_t, length_t, query, scaling, window)

    @staticmethod
    def _sdpa(space: _Layer, slot_t, length_t, query, scaling, window) -> torch.Tensor:
        rows, heads, dim = query.shape
        n, kv_heads, tokens = int(slot_t.max()) + 1, space.keys.shape[1], int(length_t.max())
        dense = rows == n and bool((slot_t == torch.arange(n, device=slot_t.device)).all())
        if dense:
            q, held = query, length_t
        else:  # slots with no row this step: a stand-in query over one token, its output unused
            q = query.new_zeros(n, heads, dim)
            q[slot_t] = query
            held = torch.ones(n, dtype=length_t.dtype, device=length_t.device)
            held[slot_t] = length_t
        q = q.view(n, kv_heads, heads // kv_heads, dim)  # query heads sharing a K/V head as its query rows
        at = torch.arange(tokens, device=q.device)[None, :]  # [1, C]
        mask = at < held[:, None]  # [n, C]
        if window is not None:
            mask &= at >= held[:, None] - window
        out = F.scaled_dot_product_attention(q, space.keys[:n, :, :tokens], space.values[:n, :, :tokens],
                                             attn_mask=mask[:, None, None, :], scale=scaling)  # [n, Hkv, g, D]
        out = out.reshape(n, heads, dim)
        return out if dense else out[slot_t]

    def forget(self, slots: list[int]) -> None:
        """What ``slots`` hold can no longer be trusted (their step failed): copied in whole next time."""
        for layer in self._layers.values():
            for s in slots:
                if s < len(layer.held):
                    layer.held[s] = -1

    def nbytes(self) -> dict[str, int]:
        n = sum(t.numel() * t.element_size() for layer in self._layers.values() for t in (layer.keys, layer.values))
        return {"workspace": n}
