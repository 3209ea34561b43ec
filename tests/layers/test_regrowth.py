"""Buffers grow without copying the whole history each time (``layers/capacity.grown_capacity``,
``Buffer.reserve``), and what regrowth copies is counted (``layers/regrowth.copied``).

The reference is the plain count: a buffer that grows a chunk (256 tokens) at a time while 2k
prefill chunks arrive copies its whole history at every chunk (7.5x its bytes at 32k); on the
ladder of 2^k and 1.5 x 2^k chunks it copies 2.25x (2.5x at most, however the tokens arrive), and
reserved for the context (what chunked prefill does) it copies nothing.
"""

from __future__ import annotations

import pytest
import torch

import builders as models
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.prefill import prefill, reserve
from tiercache.layers import regrowth
from tiercache.layers.buffer import Buffer
from tiercache.layers.capacity import CHUNK, capacity_for, grown_capacity
from tiercache.layers.full import FullLayer
from tiercache.layers.tiers import HostTier

H, D = 2, 4  # kv heads, head dim: small rows, the counts are in bytes of these


def _copied(kind: str, fill) -> int:
    before = regrowth.copied()[kind]
    fill()
    return regrowth.copied()[kind] - before


def _feed(layer_or_cache, tokens: int, chunk: int, layers: int = 1) -> None:
    g = torch.Generator().manual_seed(0)
    for s in range(0, tokens, chunk):
        t = min(chunk, tokens - s)
        for i in range(layers):
            k, v = torch.randn(1, H, t, D, generator=g), torch.randn(1, H, t, D, generator=g)
            if isinstance(layer_or_cache, TieredCache):
                layer_or_cache.update(k, v, i)
            else:
                layer_or_cache.update(k, v)


def test_the_ladder_holds_what_is_asked_within_half_again_and_depends_on_the_count_alone():
    steps = sorted({grown_capacity(n) for n in range(1, 200 * CHUNK, 97)})
    assert steps[:9] == [c * CHUNK for c in (1, 2, 3, 4, 6, 8, 12, 16, 24)]
    for n in range(1, 100 * CHUNK, 61):
        cap = grown_capacity(n)
        assert cap >= n and cap % CHUNK == 0
        assert cap <= 1.5 * capacity_for(n)  # at most half again the whole chunks it needs
    for k in range(12):  # a power of two of chunks: exact (32k, 128k tokens)
        assert grown_capacity((1 << k) * CHUNK) == (1 << k) * CHUNK
    assert grown_capacity(5, chunk=1) == 6 and grown_capacity(7, chunk=1) == 8


@pytest.mark.parametrize("chunk", [1, 2048])
def test_growing_to_32k_copies_a_bounded_multiple_of_the_bytes_held(chunk):
    layer = FullLayer(HostTier(pin=False))
    copied = _copied("host", lambda: _feed(layer, 32768, chunk))
    held = layer.nbytes()["cpu"]
    assert len(layer.buffer) == 32768 and held == 2 * H * D * 4 * grown_capacity(32768)
    assert 0 < copied <= 2.5 * held, (copied, held)  # a chunk at a time: 7.5x (2k), 64x (one token)


def test_a_buffer_growing_a_chunk_at_a_time_is_what_the_counter_reports():
    buf = Buffer(HostTier(pin=False), chunk=256, geometric=False)  # whole chunks: sliding, quantized stores
    layer = FullLayer(HostTier(pin=False))
    layer.buffer = buf
    copied = _copied("host", lambda: _feed(layer, 8192, 2048))
    per_token = 2 * H * D * 4
    assert copied == per_token * (2048 + 4096 + 6144)  # the whole history at every chunk


def test_a_reserved_buffer_fills_without_copying_and_holds_whole_chunks_of_the_context():
    layer = FullLayer(HostTier(pin=False))
    layer.reserve(32768 + 100)
    copied = _copied("host", lambda: _feed(layer, 32768, 2048))
    assert copied == 0
    assert layer.nbytes()["cpu"] == 2 * H * D * 4 * capacity_for(32868)
    # past the reservation it grows on the ladder again; reset forgets the reservation
    _feed(layer, 300, 300)
    assert layer.buffer.capacity == grown_capacity(33068)
    layer.reset()
    _feed(layer, 300, 300)
    assert layer.buffer.capacity == grown_capacity(300)


def test_reserving_a_layer_that_holds_tokens_moves_them_once():
    layer = FullLayer(HostTier(pin=False))
    _feed(layer, 1000, 1000)
    before = [t.clone() for t in layer.kv()]
    copied = _copied("host", lambda: layer.reserve(10_000))
    assert copied == 2 * H * D * 4 * 1000 and layer.buffer.capacity == capacity_for(10_000)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.kv()))


def _offloaded():
    return TieredCache.from_policy({"name": "host", "offload": {"device": "cpu"}}, models.build("llama").config)


def test_an_offloaded_32k_prefill_in_2k_chunks_copies_a_bounded_multiple_of_its_host_bytes():
    cache = _offloaded()
    layers = len(cache.layers)
    copied = _copied("host", lambda: _feed(cache, 32768, 2048, layers))
    own = cache.tier_nbytes()["host"]
    assert cache.get_seq_length() == 32768
    assert 0 < copied <= 2.25 * own, (copied, own)  # 7.5x growing a chunk at a time


def test_an_offloaded_32k_prefill_in_2k_chunks_told_its_context_copies_nothing():
    cache = _offloaded()
    reserve(cache, 32768)
    before = regrowth.copied()
    _feed(cache, 32768, 2048, len(cache.layers))
    after = regrowth.copied()
    assert after["host"] == before["host"] and after["device"] == before["device"]


def test_chunked_prefill_reserves_the_prompt():
    model = models.build("llama")
    cache = TieredCache.from_policy({"name": "fp"}, model.config)
    ids = models.prompt(1, 500)
    before = regrowth.copied()["device"]
    prefill(model, ids, cache, 128)
    assert regrowth.copied()["device"] == before  # one allocation per layer, no regrowth
    assert [layer.buffer.capacity for layer in cache.layers] == [capacity_for(500)] * len(cache.layers)
    ref = TieredCache.from_policy({"name": "fp"}, model.config)
    with torch.no_grad():
        model(ids, **cache_arg(ref))
    for a, b in zip(cache.layers, ref.layers):
        torch.testing.assert_close(a.kv(), b.kv(), rtol=1e-4, atol=1e-5)
