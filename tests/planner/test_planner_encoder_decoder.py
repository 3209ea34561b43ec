"""``plan(..., encoder_length=N)`` matches ``nbytes()`` of an encoder-decoder cache after ``generate``.

As ``test_planner_cache.py`` does for decoder-only models: per tier, per layer of each half, and
the shared buffers (device mirrors, dequantization workspace: each half has its own). Host-tier
allocations are reported under their own name (``HostTier.place`` patched) so that on a
CPU-only machine device and host are compared apart.
"""

import pytest
import torch

from builders import SEQ2SEQ, build_seq2seq, seq2seq_inputs
from tiercache import PolicyError, TieredCache
from tiercache.planner.api import plan, tier_bytes
from tiercache.layers.tiers import HostTier
from tiercache.cache.compat import cache_arg

Q4 = {"bits": 4, "group_size": 8, "residual_length": 8}
POLICIES = {
    "fp": {},
    "cross-int4": {"cross_attention": {"quantize": Q4}},
    "cross-host": {"cross_attention": {"offload": {"device": "cpu"}}},
    "cross-disk-int4": {"cross_attention": {"quantize": Q4, "offload": {"device": "disk"}}},
    "self-int4-host-cross-host": {"quantize": Q4, "offload": {"device": "cpu", "prefetch": 2},
                                  "cross_attention": {"offload": {"device": "cpu"}}},
    "self-static-cross-int4-host": {"storage": "static", "max_length": 64,
                                    "cross_attention": {"quantize": Q4, "offload": {"device": "cpu"}}},
}
LENGTHS = {"bart": 100, "t5": 300, "whisper": 10}  # encoder inputs (Whisper: always 16 encoder tokens)


def shared_parts(cache) -> tuple[int, int]:
    """(device mirror slots, workspace) of both halves, in bytes."""
    slots = work = 0
    for half in (cache.self_attention_cache, cache.cross_attention_cache):
        w = half.workspace_nbytes().get("cpu", 0)
        slots += half.shared_nbytes().get("cpu", 0) - w
        work += w
    return slots, work


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("name", SEQ2SEQ)
def test_plan_equals_the_generated_cache(name, policy, monkeypatch):
    monkeypatch.setattr(HostTier, "place", lambda self, device: "host")
    model = build_seq2seq(name)
    inputs = seq2seq_inputs(name, batch=2, length=LENGTHS[name])
    cache = TieredCache.for_encoder_decoder(POLICIES[policy], model.config)
    with torch.no_grad():
        model.generate(**inputs, **cache_arg(cache), max_new_tokens=40, min_new_tokens=40, num_beams=2)
    decoded, encoded = cache.get_seq_length(), cache.cross_attention_cache.get_seq_length()
    batch = cache.self_attention_cache.batch_size
    assert (batch, decoded) == (4, 40)  # 2 inputs x 2 beams; the start token and 39 fed back
    p = plan(POLICIES[policy], model.config, batch, decoded, encoder_length=encoded)

    slots, work = shared_parts(cache)
    assert (slots, work) == (p.mirrors, p.workspace)
    assert tier_bytes(cache.nbytes(), "cpu") == p.bytes, p.table()
    # the whole footprint's cache lines count both halves: the real cache's bytes, per tier
    assert {t: p.whole.line("kv cache", t) for t in p.bytes} == tier_bytes(cache.nbytes(), "cpu")
    assert f"cross-attention at {encoded} encoder tokens" in p.table()
    for half, rows in ((cache.self_attention_cache, p.layers), (cache.cross_attention_cache, p.cross_layers)):
        assert len(half.layers) == len(rows)
        for layer, row in zip(half.layers, rows):
            assert tier_bytes(layer.nbytes(), "cpu") == row.bytes, f"{row.layer_type} {row.index}"
    assert sum(tier_bytes(cache.cross_nbytes(), "cpu").values()) > 0
    cache.close()


def test_without_encoder_length_the_table_says_cross_attention_is_not_counted():
    config = build_seq2seq("bart").config
    without, with_ = plan({}, config, 1, 64), plan({}, config, 1, 64, encoder_length=100)
    assert "cross-attention K/V are not counted" in without.table() and not without.cross_layers
    assert with_.bytes["device"] > without.bytes["device"] and "cross_attention" in with_.table()


def test_encoder_length_is_refused_for_decoder_only_models_and_bad_values():
    from builders import build

    with pytest.raises(PolicyError, match="decoder-only"):
        plan({}, build("llama").config, 1, 64, encoder_length=10)
    with pytest.raises(PolicyError, match="encoder_length must be an integer >= 1"):
        plan({}, build_seq2seq("t5").config, 1, 64, encoder_length=0)


def test_cli_plan_counts_cross_attention(capsys):
    from tiercache.cli import main

    assert main(["plan", "configs/int4-kivi.yaml", "--model", "Whisper-large-v3", "--context", "448",
                 "--encoder-length", "1500", "--batch", "4"]) == 0
    out = capsys.readouterr().out
    assert "encoder 1500 tokens" in out and "cross_attention" in out
    # 32 layers x batch 4 x 20 heads x 1536 tokens (whole chunks) x 64 x K and V x fp16
    assert "960.0 MiB" in out
    assert main(["plan", "configs/default.yaml", "--model", "Llama-3-8B", "--context", "64",
                 "--encoder-length", "8"]) == 1
    assert "decoder-only" in capsys.readouterr().err
