"""A mini benchmark run on tiny-random: two policies and DynamicCache, plus rows that cannot run."""

import json

import torch

from tiercache.bench import main, setups


def test_mini_bench_runs(tmp_path, capsys):
    fp = tmp_path / "fp.yaml"
    fp.write_text("name: fp\n")
    q = tmp_path / "q4.yaml"
    q.write_text("name: q4\nquantize: {backend: native, bits: 4, group_size: 32, residual_length: 16}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nquantize: {bits: 3}\n")
    out = tmp_path / "out"
    rc = main(["--model", "tiny-random", "--policies", str(fp), str(q), str(bad), "--baselines", "dynamic,bogus",
               "--context", "48", "--new-tokens", "4", "--quality-tokens", "8", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert set(rows) == {"fp", "q4", "bad", "DynamicCache", "bogus"}
    for name in ("fp", "q4", "DynamicCache"):
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["cache_total"] > 0, rows[name]
    assert abs(rows["fp"]["ppl_delta"]) < 1e-3 and rows["fp"]["top1_agreement"] == 1.0
    assert rows["DynamicCache"]["greedy_agreement"] == 1.0
    assert "policy error" in rows["bad"]["note"] and "unknown baseline" in rows["bogus"]["note"]
    printed = capsys.readouterr().out
    assert "| q4 | tiercache |" in printed and str(out / "bench.png") in printed


def test_transformers_cache_bytes_counts_every_tensor():
    from transformers import DynamicCache

    from tiercache.bench.tiny import tiny_random

    config = tiny_random().config
    cache = DynamicCache(config=config)
    for i in range(config.num_hidden_layers):
        cache.update(torch.zeros(1, 2, 10, 64), torch.zeros(1, 2, 10, 64), i)  # [B, H, T, D]
    assert setups.cache_nbytes(cache) == {"cpu": config.num_hidden_layers * 2 * 2 * 10 * 64 * 4}
