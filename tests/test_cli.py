"""The ``tiercache`` command line: validate exit codes and messages, generate on the built-in model."""

import subprocess
import sys

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
