"""store.yaml: the shipped example works end to end; bad input names the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from tiercache import PolicyError, TieredCache
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg
from tiercache.serve.config import load_store_config

EXAMPLE = Path(__file__).resolve().parents[2] / "configs" / "serve" / "store.yaml"


def test_the_example_ladder_moves_a_cache_down_and_back():
    cfg = load_store_config(EXAMPLE)
    assert cfg.budget == {"device": 512 * 2**20, "host": 2 * 2**30, "disk": 8 * 2**30}
    model, _ = load_model("tiny-random")
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(0))
    cache, ref = TieredCache.from_policy({"name": "full"}, model.config), DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, **cache_arg(cache))
        model(input_ids=ids, **cache_arg(ref))
    full = cache.tier_nbytes()["device"]
    held = []
    for rung in cfg.ladder:
        cache.retier(rung)
        held.append(cache.tier_nbytes())
    assert held[0] == {"host": full}  # offload: all of it on the host, as is
    # int4: blocks on the host then on disk; only the last partial group (300 % 64 tokens) on the device
    partial = full * (300 % 64) // 512  # the full-precision buffer holds 512 tokens (two chunks)
    assert held[1]["device"] == held[2]["device"] == partial
    assert 0 < held[1]["host"] < full / 4 and "host" not in held[2] and held[2]["disk"] == held[1]["host"]
    cache.retier({"name": "full"})
    assert cache.get_seq_length() == 300
    k, _ = cache.layers[0].kv()
    # int4 rungs are lossy: the keys come back close, not equal
    assert torch.nn.functional.cosine_similarity(k.flatten(), ref.layers[0].keys.flatten(), dim=0) > 0.98


@pytest.mark.parametrize("data, words", [
    ({"budget": {"gpu": "1GiB"}}, "unknown tier(s) ['gpu']"),
    ({"budget": {"device": "lots"}}, "store.budget.device"),
    ({"ladder": "disk"}, "store.ladder: expected a list"),
    ({"ladder": ["missing.yaml"]}, "store.ladder[0]: policy file 'missing.yaml' not found"),
    ({"ladder": [{"quantize": {"bits": 3}}]}, "store.ladder[0]"),
    ({"block_size": 0}, "store.block_size"),
    ({"budgets": {}}, "unknown field(s) ['budgets']"),
])
def test_bad_store_configs_name_the_field(data, words):
    with pytest.raises(PolicyError) as e:
        load_store_config(data)
    assert words in str(e.value)
