"""``cache.retier(policy)``: in place, layer by layer, no new prefill.

Compared with plain references: a cache of the new policy fed the same tokens (lossless moves
and moves into quantization give bit-identical next logits), the original's dequantized values
(out of quantization), the original's packed bytes (same block format)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

import builders as models
from lifecycle.policies import POLICIES, feed, filled, next_logits, policy
from tiercache import CacheError, TieredCache
from tiercache.lifecycle.meter import AllocationMeter

LOSSLESS = ["fp", "static", "host", "disk"]
QUANT = ["int4", "int4-host", "int2-token", "hqq"]
PAIRS = [(a, b) for a in LOSSLESS + QUANT for b in LOSSLESS + QUANT if a != b]


@pytest.mark.parametrize("family", ["llama", "mistral"])
@pytest.mark.parametrize("a,b", PAIRS, ids=[f"{a}-to-{b}" for a, b in PAIRS])
def test_retier_gives_the_state_of_the_new_policy(family, a, b):
    model = models.build(family)
    ids, nxt = models.prompt(1, 30), models.prompt(1, 3, seed=4)
    cache = filled(model, a, ids)
    original = [layer.export() for layer in cache.layers]
    original = [(k.clone(), v.clone(), s) for k, v, s in original]
    cache.retier(policy(b))
    assert cache.policy.name == b and cache.get_seq_length() == 30
    assert [layer.policy for layer in cache.layers] == cache.policy.resolve(cache.model)
    same_format = POLICIES[a].get("quantize") == POLICIES[b].get("quantize")
    # A full-precision sliding layer keeps only window - 1 tokens: into quantization, the oldest
    # block of the new layer reaches before them (tiercache.quantize.state), so there
    # only the window's tail is compared, within quantization error.
    approx = family == "mistral" and a in LOSSLESS and b in QUANT
    if a in LOSSLESS or same_format:  # bit-identical to a cache of the new policy fed the same tokens
        ref = filled(model, b, ids)
        for x, y in zip(cache.layers, ref.layers):
            (k, v, s), (k2, v2, s2) = x.export(), y.export()
            assert s == s2 and k.shape == k2.shape
            if approx:
                assert torch.equal(k[:, :, -2:], k2[:, :, -2:]) and (k - k2)[:, :, -7:].abs().max() < 0.5
            else:
                assert torch.equal(k, k2) and torch.equal(v, v2)
        logits, ref_logits = next_logits(model, cache, nxt), next_logits(model, ref, nxt)
        assert torch.allclose(logits, ref_logits, atol=0.05) if approx else torch.equal(logits, ref_logits)
    elif b in LOSSLESS:  # out of quantization: exactly the dequantized values the cache held
        for layer, (k, v, s) in zip(cache.layers, original):
            k2, v2, s2 = layer.export()
            n = k2.shape[2]  # (a sliding layer keeps its window of them)
            assert s2 == s and torch.equal(k2, k[:, :, -n:]) and torch.equal(v2, v[:, :, -n:])
    else:  # between block formats: re-quantized from the dequantized values, close to them
        for layer, (k, v, s) in zip(cache.layers, original):
            k2, v2, s2 = layer.export()
            n = min(k.shape[2], k2.shape[2])
            assert s2 == s and (k2[:, :, -n:] - k[:, :, -n:]).abs().max() < 1.5
        assert torch.isfinite(next_logits(model, cache, nxt)).all()


def test_same_block_format_moves_packed_bytes_as_they_are():
    model = models.build("llama")
    cache = filled(model, "int4", models.prompt(1, 30))
    before = [{k: v.clone() for k, v in layer.state_dict().items() if k.startswith("store.") and
               isinstance(v, torch.Tensor)} for layer in cache.layers]
    cache.retier(policy("int4-host"))
    for layer, rows in zip(cache.layers, before):
        sd = layer.state_dict()
        assert set(layer.tier_nbytes()) == {"host", "device"}
        for key, value in rows.items():
            assert torch.equal(sd[key.replace("store.", "store.inner.")], value)  # the same bytes, now on the host


def test_quantized_host_to_disk_moves_packed_rows_host_to_host(tmp_path, monkeypatch):
    """int4 on the host -> int4 on disk: the packed rows go host copy to host copy (Offload.adopt),
    never exported through the compute device, and stay the very bytes they were."""
    from tiercache.offload.processor import Offload

    model = models.build("llama")
    ids, nxt = models.prompt(1, 30), models.prompt(1, 3, seed=4)
    cache = filled(model, "int4-host", ids)
    before = [{k: v.clone() for k, v in layer.state_dict().items() if k.startswith("store.")
               and isinstance(v, torch.Tensor)} for layer in cache.layers]

    def through_the_device(self):
        raise AssertionError("the packed rows must not be exported through the compute device")

    monkeypatch.setattr(Offload, "export", through_the_device)
    cache.retier(policy("int4-disk", tmp_path))
    monkeypatch.undo()
    for layer, rows in zip(cache.layers, before):
        assert set(layer.tier_nbytes()) == {"disk", "device"}
        sd = layer.state_dict()
        for key, value in rows.items():
            assert torch.equal(sd[key], value)
    ref = filled(model, policy("int4-disk", tmp_path / "ref"), ids)
    assert torch.equal(next_logits(model, cache, nxt), next_logits(model, ref, nxt))

def _snapshot(cache):
    return [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in layer.state_dict().items()}
            for layer in cache.layers], cache.policy, list(cache.layers)


def _unchanged(cache, snap):
    states, pol, layers = snap
    assert cache.policy is pol and all(a is b for a, b in zip(cache.layers, layers))
    for layer, state in zip(cache.layers, states):
        now = layer.state_dict()
        assert now.keys() == state.keys()
        for k in now:
            assert torch.equal(now[k], state[k]) if isinstance(now[k], torch.Tensor) else now[k] == state[k]


@pytest.mark.parametrize("bad, match", [
    ({"name": "small", "storage": "static", "max_length": 16}, "holds 30 tokens.*max_length is 16"),
    ({"name": "small-q", "storage": "static", "max_length": 16, "quantize": POLICIES["int4"]["quantize"]},
     "max_length is 16"),
    ({"name": "other-model", "overrides": [{"layers": [7], "quantize": None}]}, "out of range"),
    ({"name": "x", "quantize": {"bits": 5}}, "bits"),
    ("/no/such/policy.yaml", "policy"),
])
def test_a_policy_that_cannot_hold_the_cache_is_refused_before_any_layer_moves(bad, match):
    model = models.build("llama")
    cache = filled(model, "int4-host", models.prompt(1, 30))
    snap = _snapshot(cache)
    with pytest.raises((CacheError, ValueError), match=match):
        cache.retier(bad)
    _unchanged(cache, snap)


def test_a_failure_while_moving_puts_moved_layers_back(monkeypatch):
    model = models.build("llama")
    ids = models.prompt(1, 30)
    cache = filled(model, "fp", ids)
    snap = _snapshot(cache)
    from tiercache.layers.full import FullLayer

    calls = []
    real = FullLayer.ingest

    def failing(self, k, v, seen):  # the third layer's host tier is full
        calls.append(1)
        if len(calls) == 3:
            raise CacheError("disk tier: no space left (injected)")
        return real(self, k, v, seen)

    monkeypatch.setattr(FullLayer, "ingest", failing)
    with pytest.raises(CacheError, match="layer 2.*injected"):
        cache.retier(policy("host"))
    monkeypatch.setattr(FullLayer, "ingest", real)
    states, pol, _ = snap
    assert cache.policy is pol and [layer.policy for layer in cache.layers] == pol.resolve(cache.model)
    for layer, state in zip(cache.layers, states):
        k, v, _ = layer.export()
        assert torch.equal(k, state["buffer.keys"]) and torch.equal(v, state["buffer.values"])
    ref = filled(model, "fp", ids)
    nxt = models.prompt(1, 2, seed=8)
    assert torch.equal(next_logits(model, cache, nxt), next_logits(model, ref, nxt))


G32 = {"bits": 4, "group_size": 32, "residual_length": 64}  # groups of a real deployment (meta ~6%)
PEAK = {"fp": {}, "host": {"offload": {"device": "cpu"}}, "int4": {"quantize": G32},
        "int4-host": {"quantize": G32, "offload": {"device": "cpu"}},
        "int2-token": {"quantize": {**G32, "bits": 2, "key_axis": "token"}}}


@pytest.mark.parametrize("a,b", [(a, b) for a in PEAK for b in PEAK if a != b])
def test_peak_extra_memory_is_about_one_layer_at_full_precision(a, b):
    cfg = LlamaConfig(num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, hidden_size=256)
    cache = TieredCache.from_policy({"name": a, **PEAK[a]}, cfg)
    feed(cache, [512])
    layer_fp = 2 * 1 * 4 * 512 * 32 * 4  # K and V, [1, 4, 512, 32] float32
    with AllocationMeter([*cache.state_dict().values(), *cache.shared_buffers()]) as meter:
        cache.retier({"name": b, **PEAK[b]})
    extra = meter.peak - max(meter.net, 0)  # above what the cache holds before or after
    assert extra <= 1.5 * layer_fp, f"peak extra {extra / layer_fp:.2f} layers at full precision"
    assert meter.peak < 3 * layer_fp or meter.net > 0  # never a second whole cache (6 layers)


@pytest.mark.parametrize("b", ["fp", "host", "disk"])
def test_a_recording_sliding_layer_keeps_its_rollback_tokens_through_a_lossless_retier(b, tmp_path):
    # Mistral (every layer slides, window 8) while recording (assisted decoding): the move used to
    # ingest before setting the recording flag, so the sliding layer kept only window - 1 tokens
    # and a crop that worked before the retier was refused after it.
    model = models.build("mistral")
    ids = models.prompt(1, 14)
    cache, ref = (TieredCache.from_policy(policy("fp"), model.config) for _ in range(2))
    for c in (cache, ref):
        c.activate_past_recording()
        next_logits(model, c, ids)
    held = [layer.keys for layer in cache.layers]
    cache.retier(policy(b, tmp_path))
    assert all(torch.equal(layer.keys, k) for layer, k in zip(cache.layers, held))  # [B, H, 14, D]: all recorded
    for c in (cache, ref):
        c.crop(-10)  # back before the window: only the recorded tokens make this possible
    nxt = models.prompt(1, 2, seed=5)
    assert torch.equal(next_logits(model, cache, nxt), next_logits(model, ref, nxt))
