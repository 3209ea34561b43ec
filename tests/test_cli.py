"""The ``tiercache`` command line: validate exit codes and messages, generate on the built-in model,
bad input refused with a message (not a traceback)."""

import subprocess
import sys

import pytest

from tiercache.cli import main


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
    r = subprocess.run([sys.executable, "-m", "tiercache.cli", "validate", "configs/default.yaml"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


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
