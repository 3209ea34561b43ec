"""Random operation programs on every chain a policy builds, checked step by step against ``Ref``.

A program is a hypothesis-drawn sequence of cache operations, applied through ``TieredCache``
(as a model and ``generate`` use it): update (prefills and single tokens), crop (into the
quantized blocks too, and past what a sliding layer kept), beam reorder, batch select (indices
and boolean masks), repeat-interleave, reset, past recording on and off. After every operation
each layer must answer exactly what its plain full-precision model answers (``torch.equal``):
the update's keys and values and their shapes, ``kv()``, ``seq_length()``, ``mask_sizes()``;
``nbytes()`` must be non-negative, never shrink on an update (a quantized layer's blocks;
its full-precision residual shrinks when packed), be zero after a reset (and a disk
tier must then hold no file). An operation that must be refused raises ``CacheError`` naming
the layer and leaves every layer exactly as it was.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvmodel import (CHAINS, LAYER_KINDS, PROGRAM_OPS, Chain, assert_update, describe, files_under, layer_bytes,
                     same_snapshot, snapshot, tokens)
from tiercache.errors import CacheError

OPS = ["update"] * 5 + ["crop"] * 2 + ["reorder", "select", "repeat", "reset", "record", "stop-record"]
MAX_BATCH = 4


class Driver:
    """One cache and its per-layer references, driven in lockstep."""

    def __init__(self, chain: Chain, path: str):
        self.chain, self.path = chain, path
        self.cache = chain.build(path)
        self.refs = chain.refs(self.cache)
        self.batch = None

    # -- operations ------------------------------------------------------------------------------
    def update(self, batch: int, t: int, seed: int) -> None:
        batch = self.batch or batch
        if self.refs[0].overflows(t):
            before = snapshot(self.cache)
            with pytest.raises(CacheError, match="layer 0: static storage is full"):
                self.cache.update(*tokens(batch, t, self.chain.dtype, seed), 0)
            assert same_snapshot(before, snapshot(self.cache))
            return
        for i, (layer, ref) in enumerate(zip(self.cache.layers, self.refs)):
            k, v = tokens(batch, t, self.chain.dtype, seed * 7 + i)
            assert self.cache.get_mask_sizes(t, i) == ref.mask_sizes(t)
            grows = ref.quant.store if ref.quant is not None else layer  # a residual shrinks when it is packed
            grown_from = layer_bytes(grows)
            want = ref.update(k, v)
            out = self.cache.update(k, v, i)
            assert_update(out, want, ref.out_length())
            ref.sync_packed()
            if not layer.is_sliding:
                assert layer_bytes(grows) >= grown_from and layer_bytes(layer) > 0, "nbytes must grow with tokens"
        self.batch = batch

    def crop(self, n: int, positive: bool) -> None:
        seen = self.refs[0].seen
        allowed = [ref.crop_allowed(n) for ref in self.refs]
        lenient = [ref.storage == "sliding" and ref.quant is not None and 0 <= n for ref in self.refs]
        before = snapshot(self.cache)
        if positive and 0 < seen - n:  # transformers 4.x's "keep the first x": refused, as in 5.x
            with pytest.raises(CacheError, match="positive value is not supported"):
                self.cache.crop(seen - n)
            assert same_snapshot(before, snapshot(self.cache)), "a refused crop changed the cache"
            return
        arg = -n
        try:
            self.cache.crop(arg)
        except CacheError as e:
            assert not all(allowed), f"crop({n}) of {seen} tokens refused: {e}"
            assert "layer " in str(e)
            assert same_snapshot(before, snapshot(self.cache)), "a refused crop changed the cache"
            return
        # Accepted: a plain layer refusing may only be a quantized sliding one, which keeps whole blocks.
        assert all(a or q for a, q in zip(allowed, lenient)), f"crop({n}) of {seen} accepted, expected CacheError"
        for ref in self.refs:
            ref.crop(n)

    def batch_op(self, op: str, index: torch.Tensor | None, repeats: int = 1) -> None:
        if op == "reorder":
            self.cache.reorder_cache(index)
        elif op == "select":
            self.cache.batch_select_indices(index)
            if index.dtype == torch.bool:
                index = index.nonzero().flatten()
        else:
            self.cache.batch_repeat_interleave(repeats)
            index = torch.arange(self.batch).repeat_interleave(repeats)
        for ref in self.refs:
            ref.gather(index)
        self.batch = index.numel()

    def empty_batch_op(self, op: str, batch: int) -> None:
        """On a cache never written (or reset), batch operations change nothing and raise nothing."""
        before = snapshot(self.cache)
        if op == "reorder":
            self.cache.reorder_cache(torch.arange(batch).flip(0))
        elif op == "select":
            self.cache.batch_select_indices(torch.arange(batch)[:1])
        else:
            self.cache.batch_repeat_interleave(2)
        assert same_snapshot(before, snapshot(self.cache))

    def reset(self) -> None:
        self.cache.reset()
        for ref in self.refs:
            ref.reset()
        self.batch = None
        assert all(layer_bytes(layer) == 0 for layer in self.cache.layers)
        if self.chain.on_disk:
            assert files_under(self.path) == [], "a reset cache must hold no file"

    def record(self, on: bool) -> None:
        if on:
            self.cache.activate_past_recording()
        else:
            for layer in self.cache.layers:
                layer.record_past = False  # what transformers' generate does after a deferred stop
        for ref in self.refs:
            ref.record_past(on)

    # -- the invariants after every operation ----------------------------------------------------
    def check(self, q: int) -> None:
        assert self.cache.get_seq_length() == self.refs[0].seen
        for i, (layer, ref) in enumerate(zip(self.cache.layers, self.refs)):
            assert layer.seq_length() == ref.seen, f"layer {i}"
            assert layer.mask_sizes(q) == ref.mask_sizes(q), f"layer {i}"
            ref.check_held(layer.kv())
        sizes = self.cache.nbytes()
        assert all(isinstance(n, int) and n >= 0 for n in sizes.values()), sizes


def run_program(chain: Chain, data) -> None:
    with tempfile.TemporaryDirectory() as path:
        d = Driver(chain, path)
        try:
            for _ in range(data.draw(st.integers(1, PROGRAM_OPS), label="ops")):
                op = data.draw(st.sampled_from(OPS), label="op")
                if op in ("reorder", "select", "repeat") and d.batch is None:
                    d.empty_batch_op(op, data.draw(st.integers(1, 3), label="batch"))  # a no-op, as in transformers
                    op = "update"
                if op == "update":
                    t = data.draw(st.one_of(st.just(1), st.integers(1, 24)), label="tokens")
                    d.update(data.draw(st.integers(1, 3), label="batch"), t, data.draw(st.integers(0, 2**16), label="seed"))
                elif op == "crop":
                    n = data.draw(st.integers(0, d.refs[0].seen + 3), label="crop")  # past the start too
                    d.crop(n, data.draw(st.booleans(), label="positive"))
                elif op == "reorder":
                    idx = data.draw(st.lists(st.integers(0, d.batch - 1), min_size=d.batch, max_size=d.batch), label="beams")
                    d.batch_op("reorder", torch.tensor(idx))
                elif op == "select":
                    rows = data.draw(st.lists(st.integers(0, d.batch - 1), min_size=1, max_size=d.batch, unique=True), label="rows")
                    if data.draw(st.booleans(), label="mask"):
                        mask = torch.zeros(d.batch, dtype=torch.bool)
                        mask[rows] = True
                        d.batch_op("select", mask)
                    else:
                        d.batch_op("select", torch.tensor(rows))
                elif op == "repeat":
                    r = data.draw(st.integers(1, max(1, MAX_BATCH // d.batch)), label="repeats")
                    d.batch_op("repeat", None, r)
                elif op == "reset":
                    d.reset()
                else:
                    d.record(op == "record")
                d.check(data.draw(st.integers(1, 3), label="query"))
        finally:
            d.cache.close()
        assert files_under(path) == []


@pytest.mark.parametrize("chain", [pytest.param(c, id=c.id) for c in CHAINS])
@given(data=st.data())
def test_random_program_matches_reference(chain, data):
    run_program(chain, data)


@pytest.mark.parametrize("chain", [pytest.param(c, id=c.id) for c in CHAINS])
def test_policy_builds_the_chain_it_names(chain):
    cache = chain.build(tempfile.gettempdir())
    inner = {"full": "FullLayer", "static": "StaticLayer"}[chain.storage]
    for kind, layer in zip(LAYER_KINDS, cache.layers):
        name = "SlidingLayer" if kind == "sliding_attention" else inner
        if chain.offload != "resident":
            name = f"Offload({name})"
        if chain.quantized:
            name = f"Quantize({name})"
        assert describe(layer) == name
    cache.close()
