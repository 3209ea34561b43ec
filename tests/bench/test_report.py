"""The report writes a markdown table, a JSON file and a PNG with the expected fields."""

import json

from tiercache.bench import report

ROWS = [
    {"name": "DynamicCache", "kind": "transformers", "source": "DynamicCache", "note": "", "cache_bytes": {"cpu": 4 << 20},
     "cache_total": 4 << 20, "peak": 5 << 20, "prefill_tok_s": 4000.0, "decode_tok_s": 100.0,
     "ppl": 3.0, "ppl_delta": 0.0, "top1_agreement": 1.0, "greedy_agreement": 1.0, "greedy_prefix": 9},
    {"name": "int4-kivi", "kind": "tiercache", "source": "inline", "note": "", "cache_bytes": {"cpu": 1 << 20},
     "cache_total": 1 << 20, "shared_total": 1 << 18, "peak": 3 << 20, "prefill_tok_s": 3000.0, "decode_tok_s": 80.0,
     "ppl": 3.1, "ppl_delta": 0.1, "top1_agreement": 0.97, "greedy_agreement": 0.5, "greedy_prefix": 4},
    {"name": "broken", "kind": "transformers", "source": "?", "note": "failed: ImportError: no hqq"},
]
META = {"model": "tiny", "device": "cpu", "dtype": "float32", "context": 64, "new_tokens": 8, "quality_tokens": 16,
        "reference_ppl": 3.0}


def test_write_table_json_png(tmp_path):
    paths = report.write(ROWS, META, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert paths["md"].endswith("bench.md") and all(c in md for c in report.COLUMNS)
    assert "| int4-kivi | tiercache | 1.00 MiB | 0.250 | 3.00 MiB | 80.0 | 0.80 |" in md  # ratios vs DynamicCache
    assert "| DynamicCache | transformers | 4.00 MiB | 1.000 | 5.00 MiB |" in md
    assert report.PLACES not in md  # one place per setup: no per-place column
    assert "0.80" in md and "+0.1000" in md and "failed: ImportError" in md
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["model"] == "tiny" and [r["name"] for r in data["rows"]] == ["DynamicCache", "int4-kivi", "broken"]
    assert {"decode_tok_s", "prefill_tok_s", "cache_bytes", "ppl_delta", "top1_agreement"} <= set(data["rows"][1])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_human_sizes():
    assert report.human(512) == "512 B" and report.human(3 << 20) == "3.00 MiB" and report.human(None) == "-"


def test_a_setup_in_two_places_gets_the_per_place_column(tmp_path):
    rows = [dict(ROWS[0]), dict(ROWS[1], cache_bytes={"cuda:0": 1 << 19, "cpu": 1 << 19})]
    md = report.markdown(rows, META)
    assert report.PLACES in md and "cpu 512.00 KiB, cuda:0 512.00 KiB" in md
