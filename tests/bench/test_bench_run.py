"""A mini benchmark run on tiny-random: two policies and DynamicCache, plus rows that cannot run;
bad flags refused with a message naming the flag and what is allowed."""

import json

import pytest
import torch

from tiercache.bench import main, runner, setups

FAST = ["--model", "tiny-random", "--baselines", "none", "--context", "48", "--new-tokens", "4",
        "--quality-tokens", "8", "--repeats", "1", "--no-progress"]


def test_mini_bench_runs(tmp_path, capsys):
    fp = tmp_path / "fp.yaml"
    fp.write_text("name: fp\n")
    q = tmp_path / "q4.yaml"
    q.write_text("name: q4\nquantize: {backend: native, bits: 4, group_size: 32, residual_length: 16}\n")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nquantize: {bits: 3}\n")
    out = tmp_path / "out"
    rc = main(["--model", "tiny-random", "--policies", str(fp), str(q), str(bad), "--baselines", "dynamic",
               "--context", "48", "--new-tokens", "4", "--quality-tokens", "8", "--out", str(out), "--no-progress"])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads((out / "bench.json").read_text())["rows"]}
    assert set(rows) == {"fp", "q4", "bad", "DynamicCache"}
    for name in ("fp", "q4", "DynamicCache"):
        assert rows[name]["decode_tok_s"] > 0 and rows[name]["cache_total"] > 0, rows[name]
        assert rows[name]["peak"] >= rows[name]["held_before_decode"] > 0, rows[name]
    assert abs(rows["fp"]["ppl_delta"]) < 1e-3 and rows["fp"]["top1_agreement"] == 1.0
    assert rows["DynamicCache"]["greedy_agreement"] == 1.0
    assert "policy error" in rows["bad"]["note"] and not runner.completed(rows["bad"])
    assert all(runner.completed(rows[name]) for name in ("fp", "q4", "DynamicCache"))
    printed = capsys.readouterr().out
    assert "| q4 | tiercache |" in printed and str(out / "bench.png") in printed


def test_transformers_cache_bytes_counts_every_tensor():
    from transformers import DynamicCache

    from tiercache.models.tiny import tiny_random

    config = tiny_random().config
    cache = DynamicCache(config=config)
    for i in range(config.num_hidden_layers):
        cache.update(torch.zeros(1, 2, 10, 64), torch.zeros(1, 2, 10, 64), i)  # [B, H, T, D]
    assert setups.cache_nbytes(cache) == {"cpu": config.num_hidden_layers * 2 * 2 * 10 * 64 * 4}


def test_unknown_baseline_names_stay_a_note_in_the_api():
    from tiercache.models.tiny import tiny_random

    (row,) = setups.baseline_setups(["bogus"], tiny_random().config, "cpu")
    assert row.make is None and "unknown baseline; allowed: dynamic" in row.note


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--new-tokens", "-1"), ("--new-tokens", "0"), ("--context", "0"),
                                         ("--context", "-1"), ("--quality-tokens", "0"), ("--quality-tokens", "-1"),
                                         ("--repeats", "0"), ("--repeats", "-1"), ("--new-tokens", "2.5")])
def test_bench_refuses_numbers_below_one(tmp_path, capsys, flag, value):
    err = _usage_error(capsys, [*FAST, "--out", str(tmp_path / "out"), flag, value])
    assert f"argument {flag}:" in err and ">= 1" in err and value in err
    assert not (tmp_path / "out").exists()


def test_bench_refuses_negative_threads(tmp_path, capsys):
    err = _usage_error(capsys, [*FAST, "--out", str(tmp_path), "--threads", "-1"])
    assert "argument --threads: must be >= 0, got -1" in err


def test_bench_refuses_unknown_baselines_listing_the_allowed(tmp_path, capsys):
    err = _usage_error(capsys, [*FAST, "--out", str(tmp_path), "--baselines", "dynamic,foo"])
    assert "unknown baseline 'foo'" in err and "allowed: dynamic, dynamic-offload, quanto-int4" in err


def test_bench_refuses_unknown_devices(tmp_path, capsys):
    err = _usage_error(capsys, [*FAST, "--out", str(tmp_path), "--device", "tpu"])
    assert "argument --device: 'tpu'" in err and "allowed: cpu, cuda, cuda:N" in err


def test_bench_says_when_cuda_is_not_available(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([*FAST, "--out", str(tmp_path / "out"), "--device", "cuda"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tiercache bench: error: --device cuda: CUDA is not available here") and "--device cpu" in err
    assert not (tmp_path / "out").exists()


def test_bench_refuses_an_out_that_is_a_file(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("")
    assert main([*FAST, "--out", str(f)]) == 1
    assert "--out " + str(f) + ": exists and is not a directory" in capsys.readouterr().err
    assert main([*FAST, "--out", str(f / "sub")]) == 1
    assert "is a file" in capsys.readouterr().err


def test_bench_refuses_models_it_cannot_load(tmp_path, capsys):
    assert main([*FAST, "--out", str(tmp_path), "--model", "Llama-3-8B"]) == 1
    err = capsys.readouterr().err
    assert "preset shape for planning" in err and "'tiny'" in err and "local model directory" in err
    assert main([*FAST, "--out", str(tmp_path), "--model", str(tmp_path / "missing")]) == 1
    assert "no such file or directory" in capsys.readouterr().err


def test_bench_context_beyond_the_heldout_text_says_the_limit(tmp_path, capsys):
    assert main([*FAST, "--out", str(tmp_path), "--context", "10000000"]) == 1
    err = capsys.readouterr().err
    assert "--context 10000000 + --quality-tokens 8 = 10000008 tokens" in err
    assert "keep --context + --quality-tokens <= " in err and "Traceback" not in err


def test_bench_fails_when_no_setup_completes(tmp_path, capsys):
    # static storage of 64 tokens: the timed decode (48 + 4) fits, the quality pass (48 + 32) does not
    small = tmp_path / "small.yaml"
    small.write_text("name: small\nstorage: static\nmax_length: 64\n")
    out = tmp_path / "out"
    argv = [*FAST, "--policies", str(small), "--quality-tokens", "32", "--out", str(out)]
    assert main(argv) == 1
    assert "no setup ran to completion" in capsys.readouterr().err
    (row,) = json.loads((out / "bench.json").read_text())["rows"]
    assert "peak" in row and "ppl" not in row  # the memory pass ran; the quality pass failed, so nothing was timed
    assert row["note"].startswith("failed:") and not runner.completed(row)


def test_measure_refuses_bad_counts():
    from tiercache.models.tiny import tiny_random

    setup = setups.Setup("x", "transformers", "-", None)
    ids, model = torch.arange(16), tiny_random()  # ids: [16]
    for kwargs in ({"repeats": 0}, {"repeats": -1}, {"new_tokens": 0}, {"context": 0}, {"context": 16}):
        args = {"context": 8, "new_tokens": 2, "repeats": 1, **kwargs}
        with pytest.raises(ValueError, match="measure: "):
            runner.measure(setup, model, ids, args["context"], args["new_tokens"], None, args["repeats"])


def test_timings_are_interleaved_across_setups(monkeypatch):
    """Each round runs every setup once, in turn: a slow moment of the machine weighs on all alike."""
    from tiercache.models.tiny import tiny_random

    model, order = tiny_random(), []
    real = runner.greedy

    def spy(model, cache, prompt, steps, tick=None):
        order.append(cache.name)
        return real(model, cache.inner, prompt, steps, tick)

    class Named:  # a DynamicCache that says which setup made it
        def __init__(self, name):
            from transformers import DynamicCache

            self.name, self.inner = name, DynamicCache(config=model.config)

    monkeypatch.setattr(runner, "greedy", spy)
    monkeypatch.setattr(runner, "_footprint", lambda s, m, p, n: {"held_before_decode": 1, "peak": 1})
    monkeypatch.setattr(runner.quality, "decode_logp", lambda *a, **k: torch.zeros(4, model.config.vocab_size))
    monkeypatch.setattr(runner.quality, "nll_top1", lambda *a, **k: (torch.zeros(4), torch.zeros(4, dtype=torch.long)))
    monkeypatch.setattr(runner, "cache_nbytes", lambda cache: {"cpu": 1})
    made = [setups.Setup(n, "transformers", "-", lambda n=n: Named(n)) for n in ("a", "b", "c")]
    rows = runner.measure_all(made, model, torch.arange(20), 8, 2, None, repeats=3)
    timed = order[3:]  # after one warm-up each
    assert timed == ["a", "b", "c"] * 3
    assert all(r["decode_tok_s"] > 0 for r in rows)


def test_the_memory_pass_sees_what_a_step_allocates():
    """peak decoding counts the cache and the temporaries of each step: a quantized transformers cache that
    dequantizes its history per step peaks above its own bytes, by at least one layer's full-precision K/V."""
    from tiercache.models.tiny import tiny_random

    model = tiny_random()
    (quanto,) = setups.baseline_setups(["quanto-int4"], model.config, "cpu")
    if quanto.make is None:
        pytest.skip(quanto.note)
    out = runner._footprint(quanto, model, torch.arange(200) % 250, 2)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    one_layer_fp = 2 * model.config.num_key_value_heads * 200 * head_dim * 4
    assert out["peak"] - out["held_before_decode"] >= one_layer_fp


def test_the_demo_set_shows_the_trade_off_at_the_default_context():
    """At the demo's default prompt on the tiny model, int4 holds fewer bytes than full precision and
    int2 fewer than int4 (at 1k the residual window and the workspace hid the difference)."""
    import tiercache
    from tiercache.bench.command import parser
    from tiercache.models.registry import config

    context = parser().parse_args([]).context
    assert context >= 8192
    held = {}
    for source in setups.demo_policies():
        policy = tiercache.load_policy(source)
        held[policy.name] = sum(tiercache.plan(policy, config("tiny"), 1, context).bytes.values())
    assert held["int2-all"] < held["int4-kivi"] < 0.5 * held["default"], held
