"""C++ kernels built ahead of use (``tiercache.quantize.kernel_build``, ``tiercache build-kernels``).

- the build's key changes with the torch install (path, version), the CPU and the source;
- a run that finds no build serves packed attention with the torch reference (equal to
  dequantize-then-SDPA), warns once naming ``tiercache build-kernels``, and never compiles;
- builders of one key compile once, and only a finished build appears under its key
  (a fake compiler here; the slow test compiles for real, with two builders at once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils.cpp_extension as cpp_extension

from tiercache.cache.chain import Shared
from tiercache.cli import main
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import kernel_build, packed_cpu
from tiercache.quantize.packed_kv import PackedKV
from tests.quantize.quantized import quantized

ROOT = Path(__file__).resolve().parents[2]
TOY = kernel_build.Kernel("tiercache_toy", "int twice(int x) { return 2 * x; }", ("twice",), cflags=("-O2",))
CPUINFO = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\nmodel name\t: Xeon\n"
           "flags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nvendor_id\t: GenuineIntel\nflags\t\t: fpu\n")


@pytest.fixture
def empty_root(tmp_path, monkeypatch):
    """Builds looked for (and made) in an empty directory; the packed kernel not loaded yet."""
    monkeypatch.setenv("TIERCACHE_KERNEL_DIR", str(tmp_path / "kernels"))
    for name in ("TIERCACHE_KERNEL_BUILD", "TIERCACHE_PACKED_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(packed_cpu, "_STATE", {})
    monkeypatch.setattr(kernel_build, "_WARNED", set())
    return tmp_path / "kernels"


@pytest.fixture
def no_compiling(monkeypatch):
    """Fails the test if anything starts a build."""
    def fail(*args, **kwargs):
        pytest.fail("a kernel was compiled inside a run")

    monkeypatch.setattr(kernel_build, "build", fail)
    monkeypatch.setattr(cpp_extension, "load_inline", fail)


def fake_compiler(monkeypatch, calls: list, delay: float = 0.0, error: str | None = None) -> None:
    """``load_inline`` replaced by one that writes a library file (or fails with the compiler's ``error``)."""
    def load_inline(name, build_directory, **kwargs):
        calls.append(build_directory)
        (Path(build_directory) / "main.cpp").write_text(kwargs["cpp_sources"])
        time.sleep(delay)
        if error is not None:
            raise RuntimeError(error)
        library = Path(build_directory) / f"{name}.so"
        library.write_bytes(b"\x7fELF")
        return types.SimpleNamespace(__name__=name, __file__=str(library))

    monkeypatch.setattr(cpp_extension, "load_inline", load_inline)
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(kernel_build, "compiler", lambda: "/usr/bin/c++")


def test_key_follows_the_torch_install_the_cpu_and_the_source(tmp_path, monkeypatch):
    kernel = packed_cpu.kernel()
    base = kernel_build.key(kernel)
    assert base == kernel_build.key(packed_cpu.kernel()) and base.startswith(kernel.name + "-torch")
    with monkeypatch.context() as m:  # the same torch version in another venv: other headers, another build
        m.setattr(torch, "__file__", str(tmp_path / "other-venv" / "torch" / "__init__.py"))
        assert kernel_build.key(kernel) != base
    with monkeypatch.context() as m:
        m.setattr(torch, "__version__", "2.99.0")
        assert kernel_build.key(kernel) != base
    with monkeypatch.context() as m:  # another CPU: -march=native means other instructions
        m.setattr(kernel_build, "cpu_signature", lambda: "x86_64\nflags=fpu sse2")
        assert kernel_build.key(kernel) != base
    assert kernel_build.key(dataclasses.replace(kernel, source=kernel.source + "\n")) != base
    assert kernel_build.key(dataclasses.replace(kernel, cflags=kernel.cflags[1:])) != base



def test_the_kernel_source_is_the_shipped_cpp_file_and_keys_its_build(tmp_path, monkeypatch):
    shipped = Path(packed_cpu.__file__).with_name(packed_cpu.SOURCE_FILE)
    kernel = packed_cpu.kernel()
    assert kernel.source == shipped.read_text(encoding="utf-8") and "torch::Tensor attend(" in kernel.source
    edited = tmp_path / packed_cpu.SOURCE_FILE  # the same file, edited: read anew, a new build key
    edited.write_text(kernel.source + "// edited\n", encoding="utf-8")
    monkeypatch.setattr(packed_cpu, "resources", types.SimpleNamespace(files=lambda package: tmp_path))
    assert packed_cpu.kernel().source.endswith("// edited\n")
    assert kernel_build.key(packed_cpu.kernel()) != kernel_build.key(kernel)


def test_wheels_and_sdists_carry_the_cpp_source():
    tomllib = pytest.importorskip("tomllib")
    import fnmatch

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["tiercache"]
    sources = [p.relative_to(ROOT / "tiercache").as_posix() for p in (ROOT / "tiercache").rglob("*.cpp")]
    assert sources and all(any(fnmatch.fnmatch(s, pat) for pat in patterns) for s in sources), (sources, patterns)

def test_cpu_signature_is_the_first_processors_model_and_flags(tmp_path):
    def signature(text):
        path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
        path.write_text(text)
        return kernel_build.cpu_signature(str(path))

    base = signature(CPUINFO)
    assert "GenuineIntel" in base and "avx512f" in base and "Xeon" not in base  # the model's name is not a flag
    assert signature(CPUINFO.replace("sse2 avx2 avx512f", "avx512f sse2 avx2")) == base  # order-free
    assert signature(CPUINFO.replace(" avx512f\n", "\n", 1)) != base
    assert signature(CPUINFO.replace("model\t\t: 85", "model\t\t: 143")) != base
    assert signature(CPUINFO.replace("\nflags\t\t: fpu\n", "\nflags\t\t: fpu avx512f\n")) == base  # only the first
    if os.path.exists("/proc/cpuinfo"):
        assert "flags=" in kernel_build.cpu_signature() or "features=" in kernel_build.cpu_signature()


def tokens(t, seed, b=2, h=2, d=32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)  # [B, H, t, D]


def decode_matches_reference(steps: int = 3) -> None:
    """Packed int4 decode attention equals dequantize-then-SDPA within 1e-5, step after step."""
    q = dict(bits=4, group_size=16, residual_length=16)
    packed = quantized(QuantizePolicy(**q), Shared())
    plain = quantized(QuantizePolicy(**q, packed_attention=False), Shared())
    prompt = tokens(150, 0)
    packed.append(*prompt)
    plain.append(*prompt)
    for step in range(steps):
        new = tokens(1, 100 + step)
        (k, v), (pk, pv) = packed.append(*new), plain.append(*new)
        assert isinstance(k, PackedKV)
        query = torch.randn(2, 4, 1, 32, generator=torch.Generator().manual_seed(step))  # [B, Hq, 1, D]
        got = F.scaled_dot_product_attention(query, k, v, enable_gqa=True)
        want = F.scaled_dot_product_attention(query, pk, pv, enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_without_a_build_the_torch_reference_serves_and_warns_once(empty_root, no_compiling):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode_matches_reference()
        decode_matches_reference()
        assert not packed_cpu.available()
    notes = [w for w in caught if issubclass(w.category, kernel_build.KernelNotBuiltWarning)]
    assert len(notes) == 1, [str(w.message) for w in caught]
    message = str(notes[0].message)
    assert "tiercache build-kernels" in message and str(empty_root) in message and "torch reference" in message
    assert not empty_root.exists()  # nothing written, nothing compiled


def test_the_torch_path_chosen_explicitly_says_nothing(empty_root, no_compiling, monkeypatch):
    monkeypatch.setenv("TIERCACHE_PACKED_KERNEL", "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error", kernel_build.KernelNotBuiltWarning)
        decode_matches_reference(steps=1)
        assert not packed_cpu.available()


def test_a_lazy_build_only_when_asked(empty_root, monkeypatch):
    calls = []

    def refuse(kernel, verbose=False):
        calls.append(kernel.name)
        raise kernel_build.KernelBuildError("no C++ compiler: c++ is not on PATH")

    monkeypatch.setattr(kernel_build, "build", refuse)
    with pytest.warns(kernel_build.KernelNotBuiltWarning, match="tiercache build-kernels"):
        assert kernel_build.load(TOY) is None
    assert calls == []
    monkeypatch.setattr(kernel_build, "_WARNED", set())
    monkeypatch.setenv("TIERCACHE_KERNEL_BUILD", "lazy")
    with pytest.warns(kernel_build.KernelNotBuiltWarning, match="could not be built.*no C.. compiler"):
        assert kernel_build.load(TOY) is None
    assert calls == [TOY.name]
    assert kernel_build.load(TOY, lazy=False) is None and calls == [TOY.name]  # the explicit argument wins


def test_concurrent_builders_compile_once_and_publish_a_whole_build(empty_root, monkeypatch):
    calls: list = []
    fake_compiler(monkeypatch, calls, delay=0.5)
    results: list = [None, None]
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, kernel_build.build(TOY))) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1  # the second builder waited for the lock, then found the build
    assert sorted(r.compiled for r in results) == [False, True]
    path = kernel_build.locate(TOY)
    assert path == results[0].path == results[1].path == empty_root / kernel_build.key(TOY)
    manifest = json.loads((path / "kernel.json").read_text())
    assert manifest["library"] == "tiercache_toy.so" and manifest["module"] == "tiercache_toy"
    assert manifest["torch_path"] == os.path.realpath(os.path.dirname(torch.__file__))
    assert manifest["cpu"] == kernel_build.cpu_signature()
    assert Path(calls[0]).parent == empty_root and not Path(calls[0]).exists()  # built aside, renamed into place
    assert [p.name for p in empty_root.iterdir() if p.is_dir()] == [path.name]
    assert kernel_build.build(TOY).compiled is False and len(calls) == 1


def test_a_failed_build_leaves_nothing_and_says_why(empty_root, monkeypatch):
    calls: list = []
    fake_compiler(monkeypatch, calls, error="Error building extension 'tiercache_toy': main.cpp:1: error: expected ';'")
    with pytest.raises(kernel_build.KernelBuildError, match="compiling tiercache_toy with /usr/bin/c.. failed.*expected"):
        kernel_build.build(TOY)
    assert kernel_build.locate(TOY) is None
    assert [p for p in empty_root.iterdir() if p.is_dir()] == []
    with pytest.warns(kernel_build.KernelNotBuiltWarning):
        assert kernel_build.load(TOY) is None


def test_build_kernels_without_a_compiler_exits_1_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    monkeypatch.setenv("TIERCACHE_KERNEL_DIR", str(tmp_path / "unused"))  # the command sets it from --dir
    assert main(["build-kernels", "--dir", str(tmp_path / "kernels")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tiercache build-kernels: error: no C++ compiler") and "no-such-c++" in err
    assert main(["build-kernels", "--check", "--dir", str(tmp_path / "kernels")]) == 1
    assert "not built" in capsys.readouterr().out


@pytest.mark.slow(seconds=120)
def test_build_kernels_compiles_once_then_a_run_uses_the_kernel(tmp_path):
    """The real compiler, two ``tiercache build-kernels`` at once into an empty directory: one
    compiles, the other waits and finds it; then a fresh process loads it, warns nothing, and its
    packed decode (the C++ kernel) equals dequantize-then-SDPA."""
    root = tmp_path / "kernels"
    env = {k: v for k, v in os.environ.items() if k not in ("TIERCACHE_PACKED_KERNEL", "TIERCACHE_KERNEL_BUILD")}
    env.update(PYTHONPATH=str(ROOT), TIERCACHE_KERNEL_DIR=str(root))
    cli = [sys.executable, "-m", "tiercache.cli", "build-kernels"]
    procs = [subprocess.Popen(cli, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted("already built in" in o for o in outs) == [False, True], outs
    assert any("built in" in o and f"into {root}" in o for o in outs), outs
    check = subprocess.run(cli + ["--check"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert check.returncode == 0 and f"built in {root}" in check.stdout, check.stdout + check.stderr
    script = (
        "import warnings\n"
        "from tiercache.quantize import kernel_build, packed_cpu\n"
        "warnings.simplefilter('error', kernel_build.KernelNotBuiltWarning)\n"
        "from tests.quantize.test_kernel_build import decode_matches_reference\n"
        "assert packed_cpu.available()\n"
        "module, calls = packed_cpu._STATE['module'], []\n"
        "class Counted:\n"
        "    def __getattr__(self, name):\n"
        "        calls.append(name)\n"
        "        return getattr(module, name)\n"
        "packed_cpu._STATE['module'] = Counted()\n"
        "decode_matches_reference()\n"
        "assert calls, 'the C++ kernel was not called'\n"
        "print(module.__file__)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().startswith(str(root / kernel_build.key(packed_cpu.kernel())))


def test_serve_loads_the_kernel_before_requests(empty_root, no_compiling, caplog):
    """``tiercache serve`` (``serve.server.build`` on the CPU) looks the kernel up at start-up: here
    none is built, so it says so in its log (and the warning), and compiles nothing."""
    from tiercache.serve import server

    with caplog.at_level("INFO", logger="tiercache.serve"), pytest.warns(kernel_build.KernelNotBuiltWarning):
        server._load_cpu_kernel()
    assert "kernel not built" in caplog.text and "tiercache build-kernels" in caplog.text
    assert packed_cpu._STATE == {"module": None}  # looked up once, before any request


def test_serve_start_logs_the_loaded_kernel(packed_kernel, caplog):
    from tiercache.serve import server

    with caplog.at_level("INFO", logger="tiercache.serve"):
        server._load_cpu_kernel()
    assert "packed-attention CPU kernel loaded" in caplog.text and str(kernel_build.root()) in caplog.text
