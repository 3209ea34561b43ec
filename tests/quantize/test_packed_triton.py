"""The Triton packed-attention kernel (``tiercache.quantize.packed_triton``) and its selection.

The kernel's exactness runs on the CPU under the Triton interpreter: ``interpreted_triton.py``
in a fresh process with ``TRITON_INTERPRET=1`` (set before triton is imported there, so this
process and the rest of the suite never see it): 11 integer layouts x full / static / sliding x
split counts (one, boundaries inside blocks, a short last split, more splits than blocks, the
default), GQA, sinks, ``key_gain``, masks, several queries, odd head dims, bf16; within 1e-5 of
dequantize-then-SDPA. Here: the layouts on full and static storage in that process, the selection,
and the import without triton; ``test_packed_triton_cases.py`` runs every other case in a second
process (two files, so that pytest-xdist's two workers share the interpreter's minutes).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize import packed_attention, packed_cpu, packed_triton

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


# The interpreted cases in two processes: ``-k`` with an expression and with its negation, so that
# together they run every case of interpreted_triton.py exactly once (42 when written).
LAYOUTS_FULL_STATIC = "test_layouts_match_dequantize_then_sdpa and not sliding"
INTERPRETED = {"layouts": (LAYOUTS_FULL_STATIC, 22), "cases": (f"not ({LAYOUTS_FULL_STATIC})", 20)}


def run_interpreted(part: str) -> None:
    """Runs one ``INTERPRETED`` part of ``interpreted_triton.py`` in a fresh process under the
    interpreter; fails unless all its cases pass, at least as many as written, none skipped."""
    select, least = INTERPRETED[part]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k", select,
                          "tests/quantize/interpreted_triton.py"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= least and "skipped" not in out, out[-3000:]


@pytest.mark.slow(seconds=90)
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `triton` extra)")
def test_layouts_under_the_interpreter():
    run_interpreted("layouts")


def test_selection_by_device(monkeypatch):
    """CUDA with triton importable: the Triton kernel; otherwise the C++ CPU one (whose ``handles``
    declines CUDA tensors, so the torch reference runs there)."""
    assert packed_attention._fast(torch.device("cpu")) is packed_cpu
    assert packed_attention._fast() is packed_cpu
    monkeypatch.setattr(packed_triton, "available", lambda: True)
    assert packed_attention._fast(torch.device("cuda")) is packed_triton
    monkeypatch.setattr(packed_triton, "available", lambda: False)
    assert packed_attention._fast(torch.device("cuda")) is packed_cpu


def test_turned_off_by_the_kernel_variable(monkeypatch):
    monkeypatch.setenv("TIERCACHE_PACKED_KERNEL", "torch")
    assert not packed_triton.available()


def test_layouts_it_declines(monkeypatch):
    """fp8 codes (no offset) go to the torch reference; CPU tensors outside the interpreter too."""
    from tests.quantize.quantized import quantized
    from tiercache.cache.chain import Shared

    monkeypatch.setattr(packed_triton, "available", lambda: True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for form, taken in ((dict(bits=8, format="fp8"), False), (dict(bits=4), True), (dict(bits=2, key_axis="token"), True)):
        lay = quantized(QuantizePolicy(group_size=16, residual_length=16, **form), Shared())
        lay.append(torch.randn(1, 2, 60, 32), torch.randn(1, 2, 60, 32))
        k, _ = lay.append(torch.randn(1, 2, 1, 32), torch.randn(1, 2, 1, 32))
        (kc, vc), rows = k.pair.packed.codecs, k.pair.packed.blocks
        assert not packed_triton.handles(kc, rows[0], "keys")  # CPU tensors, no interpreter
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert packed_triton.handles(kc, rows[0], "keys") is taken
        assert packed_triton.handles(vc, rows[1], "values") is taken
        monkeypatch.delenv("TRITON_INTERPRET")


def test_imports_without_triton():
    """An install without the extra: the module imports, declines every layout, and attention works."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "from tiercache.quantize import packed_triton, packed_attention\n"
            "assert packed_triton.triton is None and not packed_triton.available()\n"
            "import torch\n"
            "assert packed_attention._fast(torch.device('cuda')).__name__.endswith('packed_cpu')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `triton` extra)")
@pytest.mark.parametrize("arch", [80, 90])
def test_compiles_for_a_gpu_within_its_shared_memory(arch):
    """What the interpreter cannot check: the kernels (the split kernel, the merge) compile for
    sm_80 / sm_90 (ptxas included, no GPU needed), every branch (keys and values each per channel
    or per token, 2/4/8 bits, a mask or none) at an 8B model's shape with a bf16 model's pointers,
    with the launch options ``attend`` uses, and their shared memory fits the smallest of those
    GPUs' per-block limits (99 KB: sm_86) with room to spare."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = packed_triton._split_kernel
    if not hasattr(kernel, "arg_names"):
        pytest.skip("TRITON_INTERPRET is set in this process: nothing to compile")
    # codes are bytes; the query, scales, offsets and exact K/V bf16 (read in the model's dtype); partials fp32
    pointers = {"kc_ptr": "*u8", "vc_ptr": "*u8", "part_out": "*fp32", "part_ptr": "*fp32", "mask_ptr": "*fp32",
                "sm_scale": "fp32"}
    cases = [(kernel, dict(G=64, DK=128, DV=128, K_BITS=kbits, V_BITS=vbits, K_NG=1 if kch else 2,
                           V_NG=1 if vch else 2, K_CHANNEL=kch, V_CHANNEL=vch, HAS_MASK=mask, BLOCK_M=16, BLOCK_T=64,
                           BLOCK_DK=128, BLOCK_DV=128))
             for kch, vch, kbits, vbits, mask in ((True, False, 4, 4, True), (False, True, 2, 8, False))]
    cases += [(packed_triton._merge_kernel, dict(DK=128, DV=128, HAS_MASK=mask, BLOCK_M=16, BLOCK_E=64, BLOCK_DK=128,
                                                 BLOCK_DV=128)) for mask in (True, False)]
    for kernel, const in cases:
        sig = {n: "constexpr" if n in const else pointers.get(n, "*bf16" if n.endswith("_ptr") else "i32")
               for n in kernel.arg_names}
        try:
            src = triton.compiler.ASTSource(fn=kernel, signature=sig,
                                            constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
        except TypeError as e:  # another triton's ahead-of-time API
            pytest.skip(f"this triton's ASTSource differs: {e}")
        out = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(packed_triton.LAUNCH))
        assert "cubin" in out.asm and out.metadata.shared <= 64 * 1024, out.metadata.shared


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (the `triton` extra)")
def test_on_cuda_matches_dequantize_then_sdpa():
    """The compiled kernel on a GPU, selected by ``attend`` itself, for a few layouts and a longer context."""
    from tests.quantize.quantized import quantized
    from tiercache.cache.chain import Shared

    for form in (dict(bits=4), dict(bits=2, key_axis="token"), dict(bits=8, meta_bits=8, sink_tokens=4)):
        lay = quantized(QuantizePolicy(group_size=64, residual_length=64, **form), Shared())
        lay.append(torch.randn(1, 4, 3000, 64, device="cuda"), torch.randn(1, 4, 3000, 64, device="cuda"))
        k, v = lay.append(torch.randn(1, 4, 1, 64, device="cuda"), torch.randn(1, 4, 1, 64, device="cuda"))
        q = torch.randn(1, 16, 1, 64, device="cuda")
        assert packed_attention._fast(q.device) is packed_triton
        got = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        want = F.scaled_dot_product_attention(q, k.plain(), v.plain(), enable_gqa=True)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
