"""bench/gpu_quick.sh --dry-run in a venv shaped like the GPU machine's image.

The device image has python3 with torch, transformers 5.17, triton and pytest, and none of the
serving, quanto, hqq or redis packages. ``make device-venv`` builds such a venv (``.venv-device``;
``make test`` builds it first); here the quick GPU suite runs there on tiny CPU shapes, so a
missing import, a wrong path or an argument a benchmark does not take fails on the CPU, before a
lent GPU's minutes are spent on it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEVICE_PY = ROOT / os.environ.get("DEVICE_VENV", ".venv-device") / "bin" / "python"
STEPS = ("env", "tests", "triton", "profile", "persist", "offload", "longctx")


def device_python() -> Path:
    if DEVICE_PY.exists():
        return DEVICE_PY
    if os.environ.get("CI"):
        pytest.fail(f"{DEVICE_PY} is missing: `make test` builds it (make device-venv)")
    pytest.skip(f"{DEVICE_PY} is missing: run `make device-venv`")


def run(py: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(py), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_device_venv_is_shaped_like_the_image():
    py = device_python()
    probe = ("import importlib.util as u, transformers; "
             "print(transformers.__version__, *[n for n in ('fastapi', 'uvicorn', 'openai', 'optimum.quanto', 'hqq',"
             " 'redis') if u.find_spec(n.split('.')[0]) and (n != 'optimum.quanto' or u.find_spec(n))])")
    out = run(py, "-c", probe)
    assert out.returncode == 0, out.stderr
    version, *extras = out.stdout.split()
    assert version.startswith("5.17."), version
    assert extras == [], f"the device venv has packages the GPU image lacks: {extras}"


def test_package_and_cli_import_with_torch_and_transformers_only():
    py = device_python()
    code = ("import sys; sys.path.insert(0, '.'); import tiercache, tiercache.cli, tiercache.quantize.packed_triton, "
            "tiercache.runtime; from tiercache import TieredCache; print('ok')")
    out = run(py, "-c", code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.slow(seconds=100)
def test_gpu_quick_dry_run_passes_in_the_device_venv(tmp_path):
    py = device_python()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PYTHON=str(py), OUT=str(tmp_path / "out"))
    proc = subprocess.run(["bash", "bench/gpu_quick.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert proc.returncode == 0, summary + "\n" + proc.stdout[-4000:] + proc.stderr[-2000:]
    for name in STEPS:
        line = next((ln for ln in summary.splitlines() if ln.startswith(f"| {name} |")), None)
        assert line is not None, f"step {name} missing from the summary:\n{summary}"
        assert "| ok |" in line or "skipped" in line, line
    files = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in (tmp_path / "out").iterdir()), files  # what $OUT brings back
    assert "passed" in (tmp_path / "out" / "cuda-tests.txt").read_text() or \
        "skipped" in (tmp_path / "out" / "cuda-tests.txt").read_text()
