"""One cache write and one attention call per layer for the decoding rows of a step: ``StepWorkspace``.

    ws = StepWorkspace()                        # the worker keeps one across steps
    step = ws.plan([(row, cache, position, at), ...], tokens)   # this step's decoding rows; None: none joins
    step.rows(layer)                            # the rows joined at ``layer`` (a tuple, in plan order)
    ws.write(step, layer, keys, values)         # packed [1, Hkv, T, D]: every joined row's new token, one write
    ws.attend(step, layer, query, scaling=..., window=None)   # packed query [1, H, T, D] -> [R, H, D]
    ws.release(cache)                           # the cache's memory is its own again
    ws.clear()                                  # every cache's memory its own again; the workspace dropped
    ws.nbytes() -> {"workspace": bytes}

Why: a step of R decoding sequences would otherwise make R cache updates and R attention calls
per layer, each with its own Python. Here each full-precision layer has one padded pair
``keys`` / ``values`` ``[S, Hkv, C, D]``; a decoding sequence has a slot ``s`` in it, and each of
its full-precision layers is *lent* that slot: the layer's buffer (``FullLayer.buffer``) is
pointed at the views ``[1, Hkv, C, D]`` of slot ``s`` (its held tokens copied in once, when it
takes the slot). From then on the sequence's own cache and its slot are the same memory: one
indexed write per layer (``write``) stores the step's new token of every joined row in its own
cache, and its buffer counts it; one SDPA with a padding mask (``attend``) reads them all. The
masks and index tensors are made once per step (per distinct set of joined rows), not per layer.

Each conversation keeps its own ``TieredCache``: its policy, tiers and store entry are its own,
and what it holds is what its own updates would hold. Anything else that writes to a lent layer
(the cache's own ``update``, a ``crop``) works on the same memory; a layer that outgrows its
slot, or is re-gathered, moves to memory of its own and is simply lent again (copied in) the next
time it joins.

Giving the memory back: a cache that leaves the step (it is not among the next step's decoding
rows, ``release(cache)``, ``clear()``, or fewer than two rows decode) gets its held tokens
copied into a buffer of its own, allocated as its layer allocates on regrowth
(``Buffer.ingest``: the same capacity ladder, its reservation honoured). The worker releases a
cache before it hands it to the store's thread: the store, ``fork`` and ``persist`` never hold
memory of a slot another sequence may take next.

What may join (decided per row and layer at ``plan``): a row feeding one token at ``position``
whose layer is ``FullLayer`` storage on the compute tier, batch 1, holding exactly ``position``
tokens, with the workspace layer's heads, head size, dtype and device. Everything else (prefill
chunks, quantized, offloaded, sliding and static storage, an empty cache) keeps its own update
and attention call (``batch.PackedCache``).

Memory: ``nbytes`` is the workspace's tensors, all of it lent: each lent cache's ``nbytes()``
reports its slot (``[1, Hkv, C, D]`` per layer), so no second copy of the K/V is kept; the
overhead is the padding of every slot to the longest row (rounded up to 128 tokens, grown 1.5x).
A lent buffer is marked (``Buffer.lent``): a fork of its cache (the ``n`` choices of a request)
allocates the room its tokens take in memory of their own, not its slot's padded capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tiercache.layers.full import FullLayer
from tiercache.layers.tiers import ComputeTier

TOKEN_ROUND = 128  # capacity unit (tokens)


def _round(n: int) -> int:
    return -(-n // TOKEN_ROUND) * TOKEN_ROUND


class _Space:
    """One layer's padded K/V ``[S, Hkv, C, D]`` and the buffers lent its slots:
    ``lent[s] = (buffer, keys view, values view)``."""

    def __init__(self, spec, slots: int, tokens: int):
        shape = (slots, spec.heads, tokens, spec.key_dim)
        self.keys = torch.zeros(shape, dtype=spec.dtype, device=spec.device)  # zeros: padding stays finite
        self.values = torch.zeros(shape[:3] + (spec.value_dim,), dtype=spec.dtype, device=spec.device)
        self.lent: dict[int, tuple] = {}

    def fits(self, spec) -> bool:
        k, v = self.keys, self.values
        return (spec.batch, spec.heads, spec.key_dim, spec.value_dim, spec.dtype, spec.device) == \
            (1, k.shape[1], k.shape[3], v.shape[3], k.dtype, k.device)

    def grow(self, slots: int, tokens: int) -> None:
        """Room for ``slots`` slots of ``tokens`` tokens; the lent buffers follow their slots."""
        s, _, c, _ = self.keys.shape
        if slots <= s and tokens <= c:
            return
        c2 = c if tokens <= c else _round(max(tokens, c + c // 2))
        keys, values = self.keys, self.values
        # both allocated before either is replaced: an allocation that fails leaves the space as it was
        new_k = keys.new_zeros((max(slots, s), keys.shape[1], c2, keys.shape[3]))  # [S, H, C, D]
        new_v = values.new_zeros((max(slots, s), values.shape[1], c2, values.shape[3]))  # [S, H, C, Dv]
        new_k[:s, :, :c] = keys
        new_v[:s, :, :c] = values
        self.keys, self.values = new_k, new_v
        for slot, (buf, kv, vv) in list(self.lent.items()):
            if buf.keys is kv and buf.values is vv:
                self.lend(slot, buf, copy=False)
            else:  # it moved to memory of its own meanwhile
                del self.lent[slot]

    def lend(self, s: int, buf, copy: bool = True) -> None:
        """Point ``buf`` at slot ``s`` (its held tokens copied in first, unless they are there)."""
        n = len(buf)
        if copy:
            self.keys[s, :, :n] = buf.keys[0, :, buf.start:buf.end]
            self.values[s, :, :n] = buf.values[0, :, buf.start:buf.end]
        kv, vv = self.keys.narrow(0, s, 1), self.values.narrow(0, s, 1)  # [1, Hkv, C, D]
        buf.lend(kv, vv, n)  # (marked lent: a copy of it, a fork, allocates its own room, not the slot's padding)
        self.lent[s] = (buf, kv, vv)

    def give_back(self, s: int) -> None:
        """Slot ``s``'s buffer holds its tokens in memory of its own again."""
        lent = self.lent.pop(s, None)
        if lent is not None and lent[0].keys is lent[1] and lent[0].values is lent[2]:
            buf = lent[0]
            if len(buf):
                k, v = buf.view()  # [1, Hkv, n, D] views of the slot, alive while copied
                buf.ingest(k, v, buf.spec)
            else:
                buf.detach()

    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@dataclass(eq=False)
class _Group:
    """The per-step tensors of one set of joined rows (shared by every layer that joins the same rows)."""

    rows: tuple  # row ids, in plan order
    slot: torch.Tensor  # [R] each row's slot
    pos: torch.Tensor  # [R] each row's new token's position
    at: torch.Tensor | None  # [R] each row's token in the pack; None: the pack is these rows' tokens, in order
    n: int  # slots the SDPA covers (max slot + 1)
    dense: bool  # the rows are slots 0 .. n-1 in order
    tokens: int  # keys the SDPA reads (max position + 1)
    held: torch.Tensor  # [n] tokens each covered slot attends to (1 for a slot with no row: its output unused)
    masks: dict = field(default_factory=dict)  # (window, dtype) -> additive mask [n, 1, 1, tokens]
    flats: dict = field(default_factory=dict)  # (workspace shape, device) -> flat row indices [Hkv * R]

    def flat(self, shape, device) -> torch.Tensor:
        """Row index of each (K/V head, joined row)'s new token in a ``[S, Hkv, C, D]`` workspace
        seen as ``[S * Hkv * C, D]``, heads outer: ``((slot * Hkv + head) * C + position)``."""
        key = (tuple(shape), device)
        t = self.flats.get(key)
        if t is None:
            _, heads, tokens, _ = shape
            slot, pos = self.slot.cpu(), self.pos.cpu()
            t = (slot[None, :] * heads + torch.arange(heads)[:, None]) * tokens + pos[None, :]
            t = self.flats[key] = t.reshape(-1).to(device)
        return t

    def mask(self, window, dtype) -> torch.Tensor:
        key = (window, dtype)
        m = self.masks.get(key)
        if m is None:
            at = torch.arange(self.tokens, device=self.held.device)[None, :]  # [1, C]
            keep = at < self.held[:, None]  # [n, C]
            if window is not None:
                keep &= at >= self.held[:, None] - window
            m = self.masks[key] = torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(
                ~keep, float("-inf"))[:, None, None, :]
        return m


class Step:
    """One step's plan: per layer, the group of rows joined at it and their buffers."""

    def __init__(self):
        self.groups: dict[int, _Group] = {}  # layer -> its group
        self.buffers: dict[int, list] = {}  # layer -> the joined rows' buffers, in the group's order
        self.slots: dict = {}  # row -> slot

    def rows(self, layer: int) -> tuple:
        g = self.groups.get(layer)
        return g.rows if g is not None else ()

    def group(self, layer: int) -> _Group:
        return self.groups[layer]


class StepWorkspace:
    def __init__(self):
        self._slot: dict[int, tuple[object, int]] = {}  # id(cache) -> (cache, slot)
        self._spaces: dict[int, _Space] = {}  # layer -> its padded K/V

    # -- slots -----------------------------------------------------------------------------------
    def _begin(self, caches: list) -> list[int]:
        """The slot of each cache. Caches not in the list give their slot back (their memory their
        own again); a new cache takes the lowest free slot."""
        keep = {id(c) for c in caches}
        for key in [k for k in self._slot if k not in keep]:
            self._give_back(self._slot.pop(key)[1])
        used = {s for _, s in self._slot.values()}
        free = (s for s in range(len(caches) + len(used)) if s not in used)
        slots = []
        for cache in caches:
            entry = self._slot.get(id(cache))
            if entry is None or entry[0] is not cache:
                entry = self._slot[id(cache)] = (cache, next(free))
            slots.append(entry[1])
        return slots

    def _give_back(self, slot: int) -> None:
        for space in self._spaces.values():
            space.give_back(slot)

    def release(self, cache) -> None:
        """``cache`` leaves the workspace: its lent layers hold their tokens in memory of their own."""
        entry = self._slot.get(id(cache))
        if entry is not None and entry[0] is cache:
            del self._slot[id(cache)]
            self._give_back(entry[1])

    def clear(self) -> None:
        """Every cache leaves; the workspace's tensors are dropped."""
        self._begin([])
        self._spaces.clear()

    # -- a step ----------------------------------------------------------------------------------
    def plan(self, members: list, tokens: int) -> Step | None:
        """This step's joins. ``members``: ``(row, cache, position, at)`` of each decoding row (one
        token at ``position``, at index ``at`` of the packed ``tokens``; one entry per cache).
        Fewer than two: nothing joins and every cache's memory is its own (``clear``)."""
        if len(members) < 2:
            self.clear()
            return None
        slots = self._begin([m[1] for m in members])
        step, groups = Step(), {}
        pure = tokens == len(members) and [m[3] for m in members] == list(range(tokens))
        layer_lists = [getattr(m[1], "layers", None) or () for m in members]
        for layer in range(max(len(layers) for layers in layer_lists)):
            joined = self._join(layer, members, layer_lists, slots)
            if len(joined) < 2:  # one row alone: its own call (it keeps its slot, nothing is copied)
                continue
            rows = tuple(members[j][0] for j, _ in joined)
            g = groups.get(rows)
            if g is None:
                g = groups[rows] = self._group(rows, [(slots[j], members[j][2], members[j][3]) for j, _ in joined],
                                               pure and len(joined) == len(members))
            step.groups[layer] = g
            step.buffers[layer] = [buf for _, buf in joined]
        step.slots = {m[0]: s for m, s in zip(members, slots)}
        return step if step.groups else None

    def _join(self, layer: int, members: list, layer_lists: list, slots: list) -> list:
        """``[(member index, buffer)]`` of the rows whose ``layer`` joins, each lent its slot. A
        buffer still reading its slot and holding ``position`` tokens joins on two identity checks;
        any other is checked in full, and copied in."""
        space = self._spaces.get(layer)
        joined, fresh = [], []
        for j, layers in enumerate(layer_lists):
            kv = layers[layer] if layer < len(layers) else None
            if type(kv) is not FullLayer:
                continue
            buf = kv.buffer
            if buf.end - buf.start != members[j][2]:
                continue
            if space is not None:
                lent = space.lent.get(slots[j])
                if lent is not None and lent[0] is buf and buf.keys is lent[1] and buf.values is lent[2] \
                        and buf.start == 0:
                    joined.append((j, buf))
                    continue
            if buf.spec is not None and buf.keys is not None and type(buf.tier) is ComputeTier:
                fresh.append((j, buf))
        if len(joined) + len(fresh) < 2:
            return []
        if fresh:
            if space is None or (not joined and not space.fits(fresh[0][1].spec)):  # a new layout: start over
                if space is not None:
                    for s in list(space.lent):
                        space.give_back(s)
                space = self._spaces[layer] = _Space(fresh[0][1].spec, max(slots) + 1, TOKEN_ROUND)
            fresh = [(j, buf) for j, buf in fresh if space.fits(buf.spec)]
            joined += fresh
            if len(joined) < 2:
                return []
        space.grow(max(slots[j] for j, _ in joined) + 1, max(members[j][2] for j, _ in joined) + 1)
        for j, buf in fresh:
            space.give_back(slots[j])  # whatever the slot was lent before (a layer that moved off it)
            space.lend(slots[j], buf)
        if fresh:
            joined.sort(key=lambda jb: jb[0])  # back in plan order
        return joined

    @staticmethod
    def _group(rows: tuple, entries: list, pure: bool) -> _Group:
        """``entries``: ``(slot, position, at)`` of each joined row."""
        slots = [e[0] for e in entries]
        n = max(slots) + 1
        dense = slots == list(range(n))
        slot_t = torch.tensor(slots)
        pos_t = torch.tensor([e[1] for e in entries])
        held = torch.ones(n, dtype=torch.long)
        held[slot_t] = pos_t + 1
        at = None if pure else torch.tensor([e[2] for e in entries])
        return _Group(rows, slot_t, pos_t, at, n, dense, int(pos_t.max()) + 1, held)

    def write(self, step: Step, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """The joined rows' new token (packed ``key`` / ``value`` ``[1, Hkv, T, D]``) into their
        caches at ``layer``: one indexed copy each (rows of the flattened ``[S * Hkv * C, D]``
        workspace), and each buffer counts the token."""
        g, space = step.groups[layer], self._spaces[layer]
        k, v = key[0], value[0]  # [Hkv, T, D]
        if g.at is not None:
            at = _on(g, "at", k.device)
            k, v = k.index_select(1, at), v.index_select(1, at)  # [Hkv, R, D]
        rows = g.flat(space.keys.shape, k.device)  # [Hkv * R]: (head, row) order, as k's
        space.keys.view(-1, space.keys.shape[3]).index_copy_(0, rows, k.reshape(-1, k.shape[2]))
        space.values.view(-1, space.values.shape[3]).index_copy_(0, rows, v.reshape(-1, v.shape[2]))
        for buf in step.buffers[layer]:
            buf.end += 1

    def attend(self, step: Step, layer: int, query: torch.Tensor, *, scaling=None, window=None) -> torch.Tensor:
        """``[R, H, D]``: one SDPA of the joined rows' queries (packed ``query`` ``[1, H, T, D]``)
        over their slots, each row its tokens ``0 .. position`` (the last ``window`` when given)."""
        g, space = step.groups[layer], self._spaces[layer]
        q = query[0] if g.at is None else query[0].index_select(1, _on(g, "at", query.device))  # [H, R, D]
        q = q.transpose(0, 1)  # [R, H, D]
        _, heads, dim = q.shape
        kv_heads = space.keys.shape[1]
        if not g.dense:  # slots with no row this step: a stand-in query over one token, its output unused
            full = q.new_zeros(g.n, heads, dim)
            full[_on(g, "slot", q.device)] = q
            q = full
        q = q.reshape(g.n, kv_heads, heads // kv_heads, dim)  # query heads sharing a K/V head as its query rows
        out = F.scaled_dot_product_attention(q, space.keys[:g.n, :, :g.tokens], space.values[:g.n, :, :g.tokens],
                                             attn_mask=_mask_on(g, window, q), scale=scaling)  # [n, Hkv, g, D]
        out = out.reshape(g.n, heads, dim)
        return out if g.dense else out[_on(g, "slot", q.device)]

    def kv(self, step: Step, layer: int, row) -> tuple[torch.Tensor, torch.Tensor]:
        """A joined row's keys and values at ``layer`` after ``write``, ``[1, Hkv, position + 1, D]``
        (for a row attended on its own: a soft-capped model)."""
        g = step.groups[layer]
        i = g.rows.index(row)
        s, n = int(g.slot[i]), int(g.pos[i]) + 1
        space = self._spaces[layer]
        return space.keys[s:s + 1, :, :n], space.values[s:s + 1, :, :n]

    def nbytes(self) -> dict[str, int]:
        return {"workspace": sum(space.nbytes() for space in self._spaces.values())}


def _on(g: _Group, name: str, device) -> torch.Tensor:
    """``g.<name>`` on ``device`` (moved there once, kept)."""
    t = getattr(g, name)
    if t.device != device:
        t = t.to(device)
        setattr(g, name, t)
    return t


def _mask_on(g: _Group, window, q: torch.Tensor) -> torch.Tensor:
    if g.held.device != q.device:
        g.held = g.held.to(q.device)
        g.masks.clear()
    return g.mask(window, q.dtype)
