"""The ``tiercache`` command line: validate exit codes and messages, generate on the built-in model,
bad input refused with a message (not a traceback)."""

import subprocess
import sysconfig
from pathlib import Path

import pytest

from tiercache.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_validate_ok_and_error(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("name: g\nstorage: full\n")
    assert main(["validate", str(good)]) == 0
    assert capsys.readouterr().out.startswith("OK: ")
    bad = tmp_path / "bad.yaml"
    bad.write_text("storage: full\nquantize:\n  bits: four\n")
    assert main(["validate", str(bad)]) == 1
    assert "policy.quantize.bits: expected an integer, got 'four'" in capsys.readouterr().out


def test_validate_against_a_model(tmp_path, capsys):
    p = tmp_path / "p.yaml"
    p.write_text("overrides:\n  - layers: [40]\n    quantize: null\n")
    assert main(["validate", str(p), "--model", "Llama-3-8B"]) == 1
    assert "index 40 is out of range for a model with 32 layers" in capsys.readouterr().out
    assert main(["validate", str(p), "--model", "Llama-3-70B"]) == 0


def test_generate_prints_text_bytes_and_speed(capsys):
    assert main(["generate", "--model", "tiny-random", "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "8 new tokens" in out and "tokens/s" in out and "cpu:" in out and "MiB" in out


def test_console_script_is_installed():
    """The ``tiercache`` command pip installed (pyproject's ``[project.scripts]``), run as a user runs it."""
    script = Path(sysconfig.get_path("scripts")) / "tiercache"
    assert script.is_file(), f"no tiercache console script in {script.parent}: pip install -e . (make does)"
    r = subprocess.run([str(script), "validate", "configs/default.yaml"], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("OK: "), r.stdout + r.stderr
    bad = subprocess.run([str(script), "validate", "no-such.yaml"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert bad.returncode == 1 and "no-such.yaml" in bad.stdout + bad.stderr


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_generate_refuses_an_empty_prompt(capsys):
    assert main(["generate", "--model", "tiny-random", "--prompt", ""]) == 1
    assert capsys.readouterr().err.startswith("tiercache generate: error: --prompt is empty")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_generate_refuses_max_new_tokens_below_one(capsys, value):
    err = _usage_error(capsys, ["generate", "--model", "tiny-random", "--prompt", "hi", "--max-new-tokens", value])
    assert f"argument --max-new-tokens: must be >= 1, got {value}" in err


def test_generate_refuses_models_it_cannot_run(tmp_path, capsys):
    assert main(["generate", "--model", "Llama-3-8B", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tiercache generate: error: model 'Llama-3-8B' is a preset shape for planning")
    assert "'tiny'" in err and "'tiny-random'" in err and "local model directory" in err and "hub id" in err
    assert main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi"]) == 1
    assert "no such file or directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "hi"]) == 1
    assert "could not be loaded" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "tiny-random"])
def test_plan_and_validate_take_the_built_in_models_offline(tmp_path, capsys, name):
    assert main(["plan", "configs/int4-kivi.yaml", "--model", name, "--context", "100"]) == 0
    assert f"model {name}: 4 layers, 2 kv heads x 64" in capsys.readouterr().out
    assert main(["validate", "configs/int4-kivi.yaml", "--model", name]) == 0
    p = tmp_path / "p.yaml"
    p.write_text("overrides:\n  - layers: [40]\n    quantize: null\n")
    assert main(["validate", str(p), "--model", name]) == 1
    assert "index 40 is out of range for a model with 4 layers" in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--context", "--batch"])
def test_plan_refuses_counts_below_one(capsys, flag):
    argv = ["plan", "configs/default.yaml", "--model", "tiny", "--context", "10", flag, "0"]
    assert f"argument {flag}: must be >= 1, got 0" in _usage_error(capsys, argv)


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon"])
def test_serve_refuses_a_timeout_that_is_not_a_positive_number(capsys, value):
    """A zero or negative limit would time out every request, NaN would never compare: refused before
    the model is loaded (the usage error names the flag and what is allowed)."""
    err = _usage_error(capsys, ["serve", "--model", "tiny", "--timeout", value])
    assert "argument --timeout:" in err and "seconds" in err and "> 0" in err


def test_the_worker_refuses_a_bad_timeout_too():
    from tiercache.models.load import load_model
    from tiercache.serve.worker import Worker

    model, tok = load_model("tiny-random")
    for bad in (0, -1.0, float("nan"), float("inf"), "600"):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            Worker(model, tok, None, model_name="tiny-random", timeout=bad)


def test_plan_without_device_says_which_it_chose(capsys, monkeypatch):
    """No --device: the plan is for cuda when a card is stated or CUDA is here, else for the CPU,
    and the first line says which and why (the runtime line follows the choice)."""
    import torch

    argv = ["plan", "configs/int4-kivi.yaml", "--model", "Llama-3-8B", "--context", "4096"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("planning a cpu run: torch sees no CUDA device here; --device cuda plans")
    assert "whole footprint on cpu" in out and "Python, torch, transformers resident set" in out
    assert main([*argv, "--device", "cuda"]) == 0  # asked for: planned as asked, nothing to say
    out = capsys.readouterr().out
    assert "whole footprint on cuda" in out and "planning a" not in out
    assert main([*argv, "--gpu-memory", "80GB"]) == 0  # a card is a GPU's memory
    out = capsys.readouterr().out
    assert out.startswith("planning a cuda run: a card is stated") and "whole footprint on cuda" in out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("planning a cuda run: torch sees a CUDA device here") and "whole footprint on cuda" in out
