"""store.yaml: the shipped example works end to end; bad input names the field."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from tiercache import PolicyError, TieredCache
from tiercache.models.load import load_model
from tiercache.cache.compat import cache_arg
from tiercache.policy.schema import Policy
from tiercache.serve.config import load_store_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "configs" / "serve" / "store.yaml"


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
    ({"budget": {"gpu": "1GiB"}}, "store.budget: unknown key, got 'gpu'; allowed: 'device' | 'host' | 'disk'"),
    ({"budget": {"device": "lots"}}, "store.budget.device"),
    ({"ladder": "disk"}, "store.ladder: expected a list"),
    ({"ladder": ["missing.yaml"]}, "store.ladder[0]: policy file 'missing.yaml' not found"),
    ({"ladder": [{"quantize": {"bits": 3}}]}, "store.ladder[0]"),
    ({"block_size": 0}, "store.block_size"),
    ({"budgets": {}}, "store.budgets: unknown field; allowed: budget, ladder, block_size, min_match, remote"),
])
def test_bad_store_configs_name_the_field(data, words):
    with pytest.raises(PolicyError) as e:
        load_store_config(data)
    assert words in str(e.value)


def test_a_key_given_twice_is_refused(tmp_path):
    for text in ("budget: {device: 1GiB}\nbudget: {device: 2GiB}\n",
                 "remote:\n  url: redis://127.0.0.1:6379/0\n  ttl: 1d\n  ttl: 2d\n"):
        path = tmp_path / "store.yaml"
        path.write_text(text)
        with pytest.raises(PolicyError, match="is given twice in one mapping"):
            load_store_config(path)


def _yaml_blocks(page: str):
    text = (ROOT / "docs" / page).read_text()
    return [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "ladder:" in b or "remote:" in b]


@pytest.mark.parametrize("page", ["serving-store.md", "remote.md"])
def test_the_docs_store_examples_load(page, tmp_path):
    blocks = _yaml_blocks(page)
    assert blocks
    (tmp_path / "serve").mkdir()
    shutil.copy(ROOT / "configs" / "offload-cpu.yaml", tmp_path / "offload-cpu.yaml")  # as configs/serve/ sees it
    for block in blocks:
        path = tmp_path / "serve" / "store.yaml"
        path.write_text(block)
        cfg = load_store_config(path)
        assert all(isinstance(r, Policy) for r in cfg.ladder)


def test_every_shipped_store_config_loads():
    for path in sorted((ROOT / "configs" / "serve").glob("*.yaml")):
        cfg = load_store_config(path)
        assert cfg.ladder and all(isinstance(r, Policy) for r in cfg.ladder), path
