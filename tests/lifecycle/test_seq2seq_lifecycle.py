"""Lifecycle of encoder-decoder caches: ``TieredEncoderDecoderCache.retier`` / ``save`` / ``load``.

Exact: continuing a loaded cache gives the logits of continuing the saved one, bit for bit, and a
retier into quantization gives the logits of a cache of that policy fed the same K/V (``_fed``:
as decoding feeds them, the cross K/V once, the self K/V a token at a time; feeding the decoder
tokens instead would differ, since a quantized cross-attention changes the K/V written) (both
halves: the self-attention per the policy, the cross-attention per its ``cross_attention``
section), on tiny BART, T5 and Whisper models. The reference for "nothing changed" is the cache's
own full-precision K/V before the operation.
"""

from __future__ import annotations

import pytest
import torch

from builders import SEQ2SEQ, build, build_seq2seq, seq2seq_inputs
from tiercache import CacheError, TieredCache, TieredEncoderDecoderCache
from tiercache.layers.cross import CrossAttention
from tiercache.cache.compat import cache_arg

Q4 = {"bits": 4, "group_size": 8, "residual_length": 4}
HOST = {"device": "cpu", "prefetch": 1}
POLICIES = {
    "fp": {},
    "offload": {"offload": HOST, "cross_attention": {"offload": HOST}},
    "int4": {"quantize": Q4, "cross_attention": {"quantize": Q4}},
    "int4-cross-host": {"quantize": Q4, "cross_attention": {"quantize": Q4, "offload": HOST}},
    "cross-disk": {"quantize": {**Q4, "bits": 2}, "cross_attention": {"offload": {"device": "disk"}}},
}


def _policy(name: str, tmp_path) -> dict:
    p = {"name": name, **POLICIES[name]}
    cross = p.get("cross_attention", {})
    if cross.get("offload", {}).get("device") == "disk":
        p["cross_attention"] = {**cross, "offload": {**cross["offload"], "path": str(tmp_path)}}
    return p


def _tokens(model, n: int, batch: int = 2, seed: int = 9) -> torch.Tensor:
    tokens = torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))  # [B, n]
    tokens[:, 0] = model.config.decoder_start_token_id
    return tokens


def _steps(model, cache, enc, tokens) -> torch.Tensor:
    """Logits of one-token decoder steps over ``tokens``: [B, n, V]."""
    with torch.no_grad():
        return torch.cat([model(encoder_outputs=enc, decoder_input_ids=tokens[:, i : i + 1],
                                **cache_arg(cache)).logits for i in range(tokens.shape[1])], dim=1)


def _setup(name):
    model, inputs = build_seq2seq(name), seq2seq_inputs(name)
    with torch.no_grad():
        enc = model.get_encoder()(**inputs)
    return model, enc, _tokens(model, 14), _tokens(model, 4, seed=10)  # 14: int4 self-attention blocks exist


def _fed(source, policy, config):
    """A cache of ``policy`` fed ``source``'s K/V as decoding feeds them: the cross-attention K/V
    once per layer, the self-attention K/V one token at a time (the reference of a retier)."""
    cache = TieredCache.for_encoder_decoder(policy, config)
    for i, (k, v, ck, cv) in enumerate(source.to_legacy()):  # [B, H, T, D] each
        cache.cross_attention_cache.update(ck, cv, i)
        cache.is_updated[i] = True
        for t in range(k.shape[2]):
            cache.self_attention_cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], i)
    return cache


def _held(cache) -> list:
    return [t for layer in cache.to_legacy() for t in layer]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _layer_policies(cache) -> list:
    halves = (cache.self_attention_cache, cache.cross_attention_cache)
    return [[layer.policy for layer in half.layers] for half in halves]


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_continuing_a_loaded_encoder_decoder_cache_is_bit_identical(name, policy, tmp_path):
    model, enc, first, then = _setup(name)
    pol = _policy(policy, tmp_path / "tier")
    cache = TieredCache.for_encoder_decoder(pol, model.config)
    _steps(model, cache, enc, first)
    path = tmp_path / "ed.safetensors"
    cache.save(path, token_ids=first)
    loaded = TieredEncoderDecoderCache.load(path, model.config, offload_path=tmp_path / "tier")  # where it was
    assert type(loaded) is TieredEncoderDecoderCache and loaded.token_ids == first.tolist()
    assert loaded.is_updated == cache.is_updated == {0: True, 1: True, 2: True}
    assert _layer_policies(loaded) == _layer_policies(cache)
    assert all(isinstance(layer, CrossAttention) for layer in loaded.cross_attention_cache.layers)
    assert _same(_held(loaded), _held(cache))
    assert torch.equal(_steps(model, loaded, enc, then), _steps(model, cache, enc, then))
    loaded.close(), cache.close()


def test_an_empty_cache_round_trips_with_is_updated_false(tmp_path):
    """Saved before the first step: the loaded cache still writes the cross K/V once, as a fresh one does."""
    model, enc, first, _ = _setup("bart")
    cache = TieredCache.for_encoder_decoder(_policy("int4", tmp_path), model.config)
    cache.save(tmp_path / "empty.safetensors")
    loaded = TieredEncoderDecoderCache.load(tmp_path / "empty.safetensors", model.config)
    assert loaded.is_updated == {0: False, 1: False, 2: False} and loaded.token_ids is None
    assert torch.equal(_steps(model, loaded, enc, first), _steps(model, cache, enc, first))


@pytest.mark.parametrize("target", ["int4", "int4-cross-host", "offload"])
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_retier_equals_a_cache_of_the_new_policy_fed_the_same_tokens(name, target, tmp_path):
    model, enc, first, then = _setup(name)
    cache = TieredCache.for_encoder_decoder({}, model.config)
    _steps(model, cache, enc, first)
    fresh, before = _fed(cache, _policy(target, tmp_path), model.config), _held(cache)
    cache.retier(_policy(target, tmp_path))
    assert _same(_held(cache), _held(fresh)) and _same(_held(cache), before) == (target == "offload")
    assert cache.self_attention_cache.policy.name == cache.cross_attention_cache.policy.name == target
    assert _layer_policies(cache) == _layer_policies(fresh)
    assert all(isinstance(layer, CrossAttention) for layer in cache.cross_attention_cache.layers)
    assert cache.is_updated == fresh.is_updated
    assert torch.equal(_steps(model, cache, enc, then), _steps(model, fresh, enc, then))


def test_load_with_a_policy_retiers_both_halves_on_the_way_in(tmp_path):
    model, enc, first, then = _setup("whisper")
    cache = TieredCache.for_encoder_decoder({}, model.config)
    _steps(model, cache, enc, first)
    fresh = _fed(cache, _policy("int4-cross-host", tmp_path), model.config)
    cache.save(tmp_path / "fp.safetensors")
    loaded = TieredEncoderDecoderCache.load(tmp_path / "fp.safetensors", model.config,
                                            policy=_policy("int4-cross-host", tmp_path))
    assert _layer_policies(loaded) == _layer_policies(fresh)
    assert loaded.cross_attention_cache.tier_nbytes()["host"] > 0
    assert "host" not in cache.cross_attention_cache.tier_nbytes()
    assert torch.equal(_steps(model, loaded, enc, then), _steps(model, fresh, enc, then))


@pytest.mark.parametrize("bad,match", [
    ({"storage": "static", "max_length": 2}, "layer 0 holds 14 tokens.*static max_length is 2"),
    ({"cross_attention": {"quantize": {"bits": 3}}}, r"policy\.cross_attention\.quantize"),
])
def test_a_policy_that_cannot_hold_the_cache_is_refused_before_any_layer_moves(bad, match):
    model, enc, first, then = _setup("bart")
    cache = TieredCache.for_encoder_decoder({"cross_attention": {"quantize": Q4}}, model.config)
    _steps(model, cache, enc, first)
    held, policies = _held(cache), _layer_policies(cache)
    with pytest.raises(CacheError, match=match):
        cache.retier(bad)
    assert _same(_held(cache), held) and _layer_policies(cache) == policies


def test_a_failure_while_moving_the_cross_half_puts_both_halves_back(monkeypatch):
    model, enc, first, then = _setup("t5")
    cache, ref = (TieredCache.for_encoder_decoder({}, model.config) for _ in range(2))
    _steps(model, cache, enc, first), _steps(model, ref, enc, first)
    held, policies = _held(cache), _layer_policies(cache)
    real = CrossAttention.ingest

    def failing(self, k, v, seen):  # the host tier fills up at the second cross-attention layer (once)
        failing.calls += 1
        if failing.calls == 2:
            raise CacheError("host tier: out of memory (injected)")
        return real(self, k, v, seen)

    failing.calls = 0
    monkeypatch.setattr(CrossAttention, "ingest", failing)
    with pytest.raises(CacheError, match="layer 1.*injected"):
        cache.retier(POLICIES["offload"])
    monkeypatch.setattr(CrossAttention, "ingest", real)
    assert failing.calls == 3  # the cross half had begun (one layer moved, and moved back)
    assert _layer_policies(cache) == policies and cache.self_attention_cache.policy.name != "offload"
    assert all(isinstance(layer, CrossAttention) for layer in cache.cross_attention_cache.layers)
    assert _same(_held(cache), held) and "cpu" in cache.nbytes() and len(cache.nbytes()) == 1
    assert torch.equal(_steps(model, cache, enc, then), _steps(model, ref, enc, then))


def test_loading_one_kind_of_save_as_the_other_names_the_mismatch(tmp_path):
    model, enc, first, _ = _setup("bart")
    cache = TieredCache.for_encoder_decoder({}, model.config)
    _steps(model, cache, enc, first)
    cache.save(tmp_path / "ed.safetensors")
    with pytest.raises(CacheError, match="holds an encoder-decoder cache, not a decoder-only one.*"
                                         "TieredEncoderDecoderCache.load"):
        TieredCache.load(tmp_path / "ed.safetensors", model.config)
    llama = build("llama")
    decoder_only = TieredCache.from_policy({}, llama.config)
    h, dk, dv = decoder_only.model.kv_shape(0)
    decoder_only.update(torch.randn(1, h, 3, dk), torch.randn(1, h, 3, dv), 0)
    decoder_only.save(tmp_path / "d.safetensors")
    with pytest.raises(CacheError, match="holds a decoder-only cache, not an encoder-decoder one.*TieredCache.load"):
        TieredEncoderDecoderCache.load(tmp_path / "d.safetensors", model.config)


def test_a_damaged_cross_attention_tensor_is_named(tmp_path):
    model, enc, first, _ = _setup("bart")
    cache = TieredCache.for_encoder_decoder({}, model.config)
    _steps(model, cache, enc, first)
    path = tmp_path / "ed.safetensors"
    cache.save(path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # the last tensor written is the cross half's last layer's
    path.write_bytes(bytes(raw))
    with pytest.raises(CacheError, match=r"cross_attention\.layers\.2\..* sha256"):
        TieredEncoderDecoderCache.load(path, model.config)


def test_the_cross_half_alone_retiers_as_cross_attention_and_is_saved_with_its_pair(tmp_path):
    model, enc, first, then = _setup("bart")
    cache = TieredCache.for_encoder_decoder({}, model.config)
    _steps(model, cache, enc, first)
    fresh = _fed(cache, {"cross_attention": {"quantize": Q4}}, model.config)
    cache.cross_attention_cache.retier({"cross_attention": {"quantize": Q4}})  # the self half stays as it is
    assert _layer_policies(cache) == _layer_policies(fresh)
    assert torch.equal(_steps(model, cache, enc, then), _steps(model, fresh, enc, then))
    with pytest.raises(CacheError, match="saved with its pair: save the TieredEncoderDecoderCache"):
        cache.cross_attention_cache.save(tmp_path / "x")
    assert not any(tmp_path.iterdir())
