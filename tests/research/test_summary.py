"""The real-model summary: bits per element by hand, merging runs (and refusing runs that did
not measure the same thing), the table, the plot and the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from research import summary
from tiercache.models.spec import ModelSpec

BENCH = Path(__file__).resolve().parents[2] / "bench"
MODEL = ModelSpec("probe", 2, ("full_attention", "full_attention"), 2, 64)
Q4 = {"backend": "native", "bits": 4, "group_size": 64, "residual_length": 128}


def test_bits_per_element_by_hand():
    assert summary.bits_per_element("dynamic", MODEL) == 16.0
    assert summary.bits_per_element("quanto-int2", MODEL) == 2.5  # + a bf16 scale and zero point per 64
    # int4, groups of 64 channels x ... : 2048 code bytes + 64 groups x (scale, offset) x 2 bytes per 4096
    assert summary.bits_per_element(Q4, MODEL) == 4.5
    k8 = {"name": "k8", "quantize": Q4, "overrides": [{"layers": [0], "quantize": {"key_bits": 8}}]}
    assert summary.bits_per_element(k8, MODEL) == ((8.5 + 4.5) / 2 + 4.5) / 2
    fp0 = {"name": "fp0", "quantize": Q4, "overrides": [{"layers": [0], "quantize": None}]}
    assert summary.bits_per_element(fp0, MODEL) == (16 + 4.5) / 2
    assert summary.bits_per_element({**Q4, "meta_bits": 8}, MODEL) < 4.3  # a byte each, plus the row's grids
    assert summary.bits_per_element("int4-sinks.yaml", MODEL) == 4.5  # a config file under configs/


def ppl_run(rows: dict, ref=(4.0, 8.0), tokens=256) -> dict:
    def row(name, deltas):
        spread = {k: {"per_text": [], "mean": d, "lo": d - 0.01, "hi": d + 0.01, "pooled": d}
                  for k, d in zip(("code", "prose"), deltas)}
        return {"name": name, "ppl": dict(zip(("code", "prose"), ref)), "ppl_spread": spread}

    meta = {"model": "probe", "prompt": 1024, "tokens": tokens, "texts_per_kind": 8, "texts": ["code", "prose"]}
    return {"meta": meta, "rows": [row("DynamicCache", (0.0, 0.0))] + [row(n, d) for n, d in rows.items()]}


def test_merge_perplexity_and_its_refusals():
    meta, rows = summary.merge_perplexity([ppl_run({"a": (0.01, 0.02)}), ppl_run({"b": (0.1, 0.2)})])
    assert list(rows) == ["DynamicCache", "a", "b"] and meta["runs"] == 2 and meta["texts"] == ["code", "prose"]
    with pytest.raises(ValueError, match="not the same texts"):
        summary.merge_perplexity([ppl_run({"a": (0, 0)}), ppl_run({"b": (0, 0)}, ref=(4.1, 8.0))])
    with pytest.raises(ValueError, match="tokens"):
        summary.merge_perplexity([ppl_run({"a": (0, 0)}), ppl_run({"b": (0, 0)}, tokens=128)])
    with pytest.raises(ValueError, match="'a' is in two runs"):
        summary.merge_perplexity([ppl_run({"a": (0, 0)}), ppl_run({"a": (0, 0)})])
    no_ref = ppl_run({"a": (0, 0)})
    no_ref["rows"] = no_ref["rows"][1:]
    with pytest.raises(ValueError, match="no DynamicCache row"):
        summary.merge_perplexity([no_ref])


def ret_run(seed: int, counts: dict) -> dict:
    rows = [{"name": n, "by_length": {str(c): list(fa) for c, fa in by.items()}} for n, by in counts.items()]
    return {"meta": {"seed": seed, "format": "passkey", "samples": 10}, "rows": rows}


def test_merge_retrieval_and_the_delta_over_shared_samples():
    runs = [ret_run(0, {"DynamicCache": {1024: (10, 10), 7168: (6, 10)}, "x": {1024: (9, 10)}}),
            ret_run(0, {"DynamicCache": {7168: (6, 10)}, "x": {7168: (4, 10)}, "y": {7168: (8, 10)}})]
    merged = summary.merge_retrieval(runs)
    assert merged["x"] == {("passkey", 0, 10, 1024): (9, 10), ("passkey", 0, 10, 7168): (4, 10)}
    rows = {r["name"]: r for r in summary.summary_rows({}, merged, {"x": 4.5})}
    assert (rows["x"]["found"], rows["x"]["asked"]) == (13, 20)
    assert rows["x"]["delta"] == pytest.approx(100 * (13 / 20 - 16 / 20))
    assert rows["y"]["delta"] == pytest.approx(100 * (0.8 - 0.6))  # only the 7168 samples it was asked
    assert rows["y"]["bits"] is None and rows["x"]["contexts"] == [1024, 7168]
    with pytest.raises(ValueError, match="disagrees"):
        summary.merge_retrieval(runs + [ret_run(0, {"DynamicCache": {7168: (5, 10)}})])
    with pytest.raises(ValueError, match="repeats"):
        summary.merge_retrieval(runs + [ret_run(0, {"DynamicCache": {7168: (6, 10)}, "x": {7168: (4, 10)}})])
    assert ("passkey", 1, 10, 7168) in summary.merge_retrieval(runs + [ret_run(1, {"x": {7168: (4, 10)}})])["x"]


def test_table_and_plot(tmp_path):
    meta, ppl = summary.merge_perplexity([ppl_run({"int4": (0.005, 0.01), "int2": (0.1, 0.2)})])
    ret = summary.merge_retrieval([ret_run(0, {"DynamicCache": {1024: (10, 10)}, "int4": {1024: (9, 10)}})])
    rows = summary.summary_rows(ppl, ret, {"DynamicCache": 16.0, "int4": 4.5, "int2": 2.5})
    table = summary.markdown(rows, meta)
    assert "| int4 | 4.50 | +0.50% [-0.50, +1.50] | +1.00% [+0.00, +2.00] | 9/10 | -10.0 |" in table
    assert "| int2 | 2.50 | +10.00% [+9.00, +11.00] | +20.00% [+19.00, +21.00] | – | – |" in table
    summary.plot(rows, meta, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 10_000


def run_script(*args, cwd):
    path = os.pathsep.join(p for p in (str(BENCH.parent), os.environ.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, str(BENCH / "plot_real.py"), *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env={**os.environ, "PYTHONPATH": path})


@pytest.mark.slow(seconds=30)  # the script end to end in a fresh process (~27 s on two busy cores)
def test_script(tmp_path):
    a, r = tmp_path / "a.json", tmp_path / "r.json"
    (tmp_path / "mine.yaml").write_text("name: mine\nquantize: {backend: native, bits: 2, group_size: 64}\n")
    run = ppl_run({"int4 +sinks": (0.005, 0.01), "mine.yaml": (0.1, 0.2)})  # a policy file run by path
    run["meta"]["model"] = "tiny"
    a.write_text(json.dumps(run))
    r.write_text(json.dumps(ret_run(0, {"DynamicCache": {1024: (10, 10)}, "int4-sinks": {1024: (9, 10)}})))
    out = tmp_path / "s" / "q.png"
    proc = run_script("--ppl", str(a), "--retrieval", str(r), "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    table = out.with_suffix(".md").read_text()
    assert out.is_file() and "| int4-sinks | 4.50 |" in table and "| mine.yaml | 2.50 |" in table
    bad = run_script("--ppl", str(a), "--setups", "nope", "--out", str(out), cwd=tmp_path)
    assert bad.returncode == 2 and "nope" in bad.stderr
    again = run_script("--ppl", str(a), str(a), "--out", str(out), cwd=tmp_path)
    assert again.returncode == 2 and "two runs" in again.stderr
