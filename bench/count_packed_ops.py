"""Ops per packed decode step of one quantized layer, counted by the torch profiler (CPU).

    python bench/count_packed_ops.py [--context 4096] [--bits 4] [--dtype bfloat16] [--path cpu|torch|triton|all]

One ``Quantize`` layer (8B-shaped: 8 K/V heads of 128, 32 query heads, group 64, residual 128,
``packed_attention: true``) is prefilled with ``--context`` tokens; then decode steps run until
the residual is mid-way (no flush inside the measured step), and one step is profiled: the
layer's ``update`` of one token plus ``scaled_dot_product_attention`` over the ``PackedKV`` it
returns (what transformers' sdpa attention does). Printed per path:

- ``aten ops``: every ``aten::`` event the profiler recorded (nested ones included: an op that
  calls others counts each);
- ``top-level``: ``aten::`` events not inside another ``aten::`` event: the ops Python issued,
  the closest CPU-side stand-in for kernel launches on a GPU;
- the ten most frequent top-level ops;
- Triton: its kernel launches (each recorded as one ``triton::launch`` range; the ops the
  interpreter runs inside a launch are the kernel's body on the host, not counted).

Paths: ``cpu`` the C++ kernel (``packed_cpu``, built on first use), ``torch`` the pure-torch
reference (``TIERCACHE_PACKED_KERNEL=torch`` semantics: ``handles`` declined), ``triton`` the
Triton kernel on CPU tensors under ``TRITON_INTERPRET=1`` (a fresh process sets it; at
``--triton-context`` tokens, the interpreter being slow: the count does not depend on it). ``all``
runs each available one.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

B, HKV, HQ, D, G, R = 1, 8, 32, 128, 64, 128
LAUNCH = "triton::launch"


def _layer(bits: int):
    from tiercache.cache.chain import Shared, build
    from tiercache.planner.chainspec import spec_for
    from tiercache.policy.schema import LayerPolicy, QuantizePolicy

    q = QuantizePolicy(bits=bits, group_size=G, residual_length=R, packed_attention=True)
    return build(spec_for(LayerPolicy(0, "full_attention", "full", None, None, q, None)), Shared())


def _tokens(t: int, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, HKV, t, D, generator=g).to(dtype), torch.randn(B, HKV, t, D, generator=g).to(dtype))


def _inputs(seed: int, dtype):
    """One decode step's new key / value ``[B, HKV, 1, D]`` and query ``[B, HQ, 1, D]`` (made outside the profile)."""
    query = torch.randn(B, HQ, 1, D, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return (*_tokens(1, seed, dtype), query)


def _step(layer, k, v, query):
    """What a model's layer does with the cache on a decode step: update, then SDPA over what came back."""
    k, v = layer.update(k, v)
    return F.scaled_dot_product_attention(query, k, v, enable_gqa=True)


def count(context: int, bits: int, dtype, path: str, verbose: bool = False) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from tiercache.quantize import packed_cpu, packed_kv

    if path == "torch":
        packed_cpu.handles = lambda *a: False
    elif path == "cpu" and not packed_cpu.available():
        return {"path": path, "skipped": "the C++ kernel could not be built"}
    layer = _layer(bits)
    layer.update(*_tokens(context, 0, dtype))
    seed = 1
    while len(layer.residual) != R // 2:  # mid-residual: the profiled step neither flushes nor is the first
        layer.update(*_tokens(1, seed, dtype))
        seed += 1
    ran = {}
    real = packed_kv.attend

    def spy(*a, **kw):
        ran["packed"] = True
        return real(*a, **kw)

    packed_kv.attend = spy
    _step(layer, *_inputs(seed, dtype))  # warm (lazy imports, caches)
    step = _inputs(seed + 1, dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = _step(layer, *step)
    packed_kv.attend = real
    assert ran.get("packed") and torch.isfinite(out).all()
    def inside(e, names) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if parent.name in names:
                return True
            parent = parent.cpu_parent
        return False

    launches = [e for e in prof.events() if e.name == LAUNCH]
    # the interpreter runs a Triton kernel's body on the host: its own tensor ops are not the step's
    events = [e for e in prof.events() if e.name.startswith("aten::") and not inside(e, {LAUNCH})]
    aten = {e.name for e in events}
    top = [e.name for e in events if not inside(e, aten)]
    return {"path": path, "context": context, "bits": bits, "dtype": str(dtype).replace("torch.", ""),
            "aten_ops": len(events), "top_level": len(top), "triton_launches": len(launches),
            "most": collections.Counter(top).most_common(10 if not verbose else None)}


def _triton(args) -> dict:
    """The Triton path in a fresh process (the interpreter must be set before triton imports)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {"path": "triton", "skipped": "triton is not installed"}
    env = dict(os.environ, TRITON_INTERPRET="1")
    cmd = [sys.executable, __file__, "--context", str(args.triton_context), "--bits", str(args.bits),
           "--dtype", args.dtype, "--path", "triton-child", "--json", *(["--verbose"] if args.verbose else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode:
        return {"path": "triton", "skipped": f"failed: {done.stderr[-500:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


class _Counted:
    """A Triton kernel whose launches the profiler records as one ``LAUNCH`` range each."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        from torch.profiler import record_function

        def launch(*args, **kwargs):
            with record_function(LAUNCH):
                return self.kernel[grid](*args, **kwargs)

        return launch


def _triton_child(args) -> dict:
    from tiercache.quantize import packed_attention, packed_triton

    assert packed_triton._interpreting()
    packed_attention._fast = lambda device=None: packed_triton  # CPU tensors take the Triton kernel
    for name in [n for n in vars(packed_triton) if n.endswith("_kernel")]:  # the launched ones (not helpers)
        setattr(packed_triton, name, _Counted(getattr(packed_triton, name)))
    out = count(args.context, args.bits, getattr(torch, args.dtype), "triton", args.verbose)
    out["path"] = "triton"
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--bits", type=int, default=4, choices=(2, 4, 8))
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--path", default="all", choices=("cpu", "torch", "triton", "all", "triton-child"))
    ap.add_argument("--triton-context", type=int, default=1024,
                    help="context of the Triton path (the interpreter is slow; the torch-side ops do not depend on it)")
    ap.add_argument("--verbose", action="store_true", help="every top-level op, not the ten most frequent")
    ap.add_argument("--json", action="store_true", help="one JSON line per path")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.path == "triton-child":
        print(json.dumps(_triton_child(args)))
        return
    rows = []
    for path in (("cpu", "torch", "triton") if args.path == "all" else (args.path,)):
        if path == "triton":
            rows.append(_triton(args))
        elif path == "torch" and args.path == "all":  # patched module state: run it in its own process
            cmd = [sys.executable, __file__, "--context", str(args.context), "--bits", str(args.bits),
                   "--dtype", args.dtype, "--path", "torch", "--json", *(["--verbose"] if args.verbose else [])]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]) if not done.returncode
                        else {"path": "torch", "skipped": done.stderr[-500:]})
        else:
            rows.append(count(args.context, args.bits, getattr(torch, args.dtype), path, args.verbose))
    for row in rows:
        if args.json:
            print(json.dumps(row))
        elif "skipped" in row:
            print(f"{row['path']:>7}: skipped ({row['skipped']})")
        else:
            launches = f", {row['triton_launches']} Triton launches" if row["path"] == "triton" else ""
            print(f"{row['path']:>7}: int{row['bits']} {row['dtype']} at {row['context']} tokens: "
                  f"{row['aten_ops']} aten ops, {row['top_level']} top-level{launches} per decode step of one layer")
            print(f"         most frequent: {', '.join(f'{n} x{c}' for n, c in row['most'])}")


if __name__ == "__main__":
    main()
