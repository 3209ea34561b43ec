"""The checks of ``bench/gpu_quick.sh`` that have no benchmark of their own, one subcommand each.

    python3 bench/gpu_quick.py env                # versions, device, memory bandwidth
    python3 bench/gpu_quick.py profile            # 20 int4 decode steps of one 8B-shaped layer at 32k
    python3 bench/gpu_quick.py persist            # save, load(device="cuda"), update, compare
    python3 bench/gpu_quick.py offload            # offloaded decode at batch 2 across 256-token boundaries
    python3 bench/gpu_quick.py <cmd> --dry-run    # tiny shapes on the CPU: the script runs (tests use it)

Every subcommand prints a short markdown report (the shell script tees it into ``$OUT``) and exits
0 when it measured what it says, 1 when a check failed. Only torch, transformers and tiercache's
own dependencies are imported: the device image has no serving, quanto, hqq or redis packages.

- ``env``: python, torch, CUDA, transformers, triton versions; the device's name, memory, SM count
  and its peak memory bandwidth (from the memory clock and bus width torch reports, when it does),
  which ``bench_packed_triton.py --bandwidth`` divides by.
- ``profile``: one attention layer shaped like Llama-3-8B's (8 K/V heads of 128, 32 query heads,
  bf16) quantized to int4 (native, KIVI, group 64, residual 128), filled to ``--context`` tokens,
  then ``--steps`` decode steps (``update`` + SDPA on the returned packed K/V) under the torch
  profiler: kernel launches per step (``cudaLaunchKernel`` and friends, Triton's included), CPU ms
  per step (wall clock, synchronized once at the end) and the GPU ms the kernels took, and the
  ten ops that launched most. On the CPU, ops per step stand in for launches.
  Then the same 32k context through a few layers of a whole 8B-shaped model, decoded with
  ``DynamicCache`` and with the shipped ``default``, ``int4-kivi`` and ``offload-cpu`` policies:
  wall ms, launches and GPU ms per step, and the kernels and CPU ops that took most.
- ``persist``: a small full-precision and an int4 cache filled on the device, saved, loaded back
  with ``device="cuda"`` (no index), then updated: the loaded cache must accept the update and
  give the same K/V as the original given the same update.
- ``offload``: a random 8B-shaped (few layers) model, cache offloaded to pinned host memory with
  prefetch, batch 2, decoding from just before a 256-token boundary across several: per-step times
  (histogram: median, p90, max; the steps that cross a boundary marked), the offload counters
  (``host_waits``, bytes each way per token), ``memory_allocated`` / ``memory_reserved`` at the
  end and their peaks (the model's float32 blocks emptied first: its weights are made in float32,
  then cast), and the caching allocator's counters during the run (``num_alloc_retries``: a
  request that had to free cached blocks first, and ``cudaMalloc`` / ``cudaFree`` calls). A
  regrowth that copies or fragments shows as slow boundary steps and a reserved / allocated ratio
  far above 1. Each step over 3x the median is listed with the CPU time this thread spent in it
  and the garbage collections' share: a stall with little CPU waits on something (the device, a
  lock, the host), one with CPU is Python or host work.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE_8B = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                intermediate_size=14336, vocab_size=128256)
SHAPE_TINY = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                  intermediate_size=128, vocab_size=256)
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaMemcpyAsync",
            "cudaMemsetAsync")


def device_of(args):
    import torch

    if args.dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit("gpu_quick.py: no CUDA GPU visible to torch (use --dry-run on a CPU)")
    return torch.device("cuda")


def random_llama(shape: dict, layers: int, positions: int, dtype, device):
    """A seeded random Llama of ``shape`` (``SHAPE_8B`` / ``SHAPE_TINY``) with SDPA attention, made
    on ``device`` and cast to ``dtype``: (config, model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=positions, dtype=dtype, **shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return config, model


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- env -----------------------------------------------------------------------------------------
def cmd_env(args) -> int:
    import torch
    import transformers

    try:
        import triton

        tri = triton.__version__
    except ImportError:
        tri = "not installed"
    print(f"- python {platform.python_version()} ({sys.executable})")
    print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}); transformers {transformers.__version__}; triton {tri}")
    import tiercache

    print(f"- tiercache from {Path(tiercache.__file__).parent}")
    if args.dry_run or not torch.cuda.is_available():
        print("- device: cpu (dry run)" if args.dry_run else "- device: no CUDA GPU visible to torch")
        return 0 if args.dry_run else 1
    props = torch.cuda.get_device_properties(0)
    from bench_packed_triton import peak_gbs  # bench/ is on sys.path when run as a script

    bw = peak_gbs(torch.device("cuda", 0))
    print(f"- device: {props.name}, {props.total_memory / 2**30:.1f} GiB, {props.multi_processor_count} SMs, "
          f"compute {props.major}.{props.minor}; peak bandwidth {'unknown' if bw is None else f'{bw:.0f} GB/s'}")
    return 0


# -- profile -------------------------------------------------------------------------------------
def int4_layer(group: int, residual: int):
    from tiercache.cache.chain import Shared, build
    from tiercache.planner.chainspec import spec_for
    from tiercache.policy.schema import LayerPolicy, QuantizePolicy

    q = QuantizePolicy(bits=4, group_size=group, residual_length=residual)
    return build(spec_for(LayerPolicy(0, "full_attention", "full", None, None, q, None)), Shared())


def cmd_profile(args) -> int:
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    device = device_of(args)
    shape = SHAPE_TINY if args.dry_run else SHAPE_8B
    context = 256 if args.dry_run else args.context
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    b, h, hkv, d = 1, shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*s):
        return torch.randn(*s, generator=g, device=device, dtype=torch.float32).to(dtype)

    group, residual = (16, 16) if args.dry_run else (64, 128)
    layer = int4_layer(group, residual)
    layer.append(rand(b, hkv, context, d), rand(b, hkv, context, d))  # [B, Hkv, T, D]
    q = rand(b, h, 1, d)
    steps = [(rand(b, hkv, 1, d), rand(b, hkv, 1, d)) for _ in range(args.steps + 5)]

    def step(k1, v1):
        k, v = layer.append(k1, v1)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    for k1, v1 in steps[:5]:  # warm-up: Triton compiles on first launch
        step(k1, v1)
    sync(device)
    start = time.perf_counter()
    for k1, v1 in steps[5:]:
        step(k1, v1)
    sync(device)
    cpu_ms = (time.perf_counter() - start) * 1e3 / args.steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    more = [(rand(b, hkv, 1, d), rand(b, hkv, 1, d)) for _ in range(args.steps)]
    with profile(activities=acts) as prof:
        for k1, v1 in more:
            step(k1, v1)
        sync(device)
    events = prof.key_averages()
    n = args.steps
    launches = sum(e.count for e in events if e.key in LAUNCHES) / n
    aten = sum(e.count for e in events if e.key.startswith("aten::")) / n
    gpu_ms = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events) / 1e3 / n
    print(f"- layer: {hkv} K/V heads x {d}, {h} query heads, {dtype}, int4 g{group} r{residual}, context {context}, {n} steps")
    print(f"- CPU wall ms per step (update + attention): {cpu_ms:.3f}")
    print(f"- kernel launches per step: {launches:.1f}" if device.type == "cuda" else "- kernel launches: (CPU run)")
    print(f"- aten ops per step: {aten:.1f}")
    if device.type == "cuda":
        print(f"- GPU kernel ms per step: {gpu_ms:.3f}")
    print("\n| op | calls per step | CPU ms per step |\n|---|---|---|")
    top = sorted((e for e in events if e.key.startswith(("aten::", "cuda", "cu"))), key=lambda e: -e.count)[:12]
    for e in top:
        print(f"| {e.key} | {e.count / n:.1f} | {e.cpu_time_total / 1e3 / n:.3f} |")
    del layer
    return profile_model(args, device)


MODEL_CACHES = ("DynamicCache", "default", "int4-kivi", "offload-cpu")


def profile_model(args, device) -> int:
    """Whole-model decode steps per cache: where a step's time goes (launches, CPU, GPU, top kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    import tiercache
    from tiercache.cache.compat import cache_arg
    from tiercache.cache.prefill import prefill

    shape = SHAPE_TINY if args.dry_run else SHAPE_8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    context = 256 if args.dry_run else args.context
    layers = 2 if args.dry_run else args.model_layers
    config, model = random_llama(shape, layers, context + 64, dtype, device)
    ids = torch.randint(3, shape["vocab_size"], (1, context), device=device)  # [1, T]
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    print(f"\n### Whole-model decode: random Llama, {layers} layers of the 8B shape, {dtype}, context {context}, "
          f"{args.model_steps} steps profiled per cache\n")
    print("| cache | wall ms / step | launches / step | GPU ms / step | top GPU kernels (ms / step) | top CPU ops (self ms / step) |")
    print("|---|---|---|---|---|---|")
    for name in MODEL_CACHES:
        if name == "DynamicCache":
            cache = DynamicCache(config=config)
        else:
            cache = tiercache.TieredCache.from_policy(ROOT / "configs" / f"{name}.yaml", config)
        prefill(model, ids, cache, 2048)
        nxt = ids[:, -1:]
        for _ in range(3):  # warm-up
            nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
        sync(device)
        with profile(activities=acts) as prof:
            start = time.perf_counter()
            for _ in range(args.model_steps):
                nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
            sync(device)
            wall = (time.perf_counter() - start) * 1e3 / args.model_steps
        ev, n = prof.key_averages(), args.model_steps
        launches = sum(e.count for e in ev if e.key in LAUNCHES) / n
        gpu = [(getattr(e, "self_device_time_total", 0) or 0, e.key) for e in ev]
        top_gpu = ", ".join(f"{k[:40]} {t / 1e3 / n:.2f}" for t, k in sorted(gpu, reverse=True)[:3] if t)
        top_cpu = ", ".join(f"{e.key[:32]} {e.self_cpu_time_total / 1e3 / n:.2f}"
                            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:3])
        print(f"| {name} | {wall:.2f} | {launches:.0f} | {sum(t for t, _ in gpu) / 1e3 / n:.2f} | {top_gpu or '-'} | {top_cpu} |")
        del cache
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


# -- persist -------------------------------------------------------------------------------------
def cmd_persist(args) -> int:
    import tempfile

    import torch
    from transformers import LlamaConfig

    import tiercache

    device = device_of(args)
    config = LlamaConfig(num_hidden_layers=2, **SHAPE_TINY)
    where = "cpu" if device.type == "cpu" else "cuda"  # no index: the case that must work
    policies = {"full precision": {"name": "fp"},
                "int4": {"name": "int4", "quantize": {"bits": 4, "group_size": 16, "residual_length": 16}}}
    g = torch.Generator(device=device).manual_seed(0)
    failed = 0
    for label, pol in policies.items():
        cache = tiercache.TieredCache.from_policy(pol, config)
        for layer in range(2):
            cache.update(torch.randn(1, 2, 100, 16, generator=g, device=device),
                         torch.randn(1, 2, 100, 16, generator=g, device=device), layer)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "cache"
            cache.save(path)
            try:
                loaded = tiercache.TieredCache.load(path, config, device=where)
                k1 = torch.randn(1, 2, 1, 16, generator=g, device=device)
                v1 = torch.randn(1, 2, 1, 16, generator=g, device=device)
                got = loaded.update(k1, v1, 0)
                want = cache.update(k1, v1, 0)
                same = all(torch.equal(_plain(a), _plain(b)) for a, b in zip(got, want))
                print(f"- {label}: save, load(device={where!r}), update: {'same K/V' if same else 'K/V DIFFER'}")
                failed += not same
            except Exception as e:  # reported, not raised: the next check still runs
                print(f"- {label}: FAILED: {type(e).__name__}: {e}")
                failed += 1
    return 1 if failed else 0


def _plain(t):
    return t.plain() if hasattr(t, "plain") else t


# -- offload -------------------------------------------------------------------------------------
def cmd_offload(args) -> int:
    import torch

    import tiercache
    from tiercache.cache.compat import cache_arg

    device = device_of(args)
    shape = SHAPE_TINY if args.dry_run else SHAPE_8B
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    layers = 2 if args.dry_run else args.layers
    config, model = random_llama(shape, layers, 8192, dtype, device)
    policy = {"name": "offload", "offload": {"device": "cpu", "prefetch": 1, "pin_memory": device.type == "cuda"}}
    start_len = 250  # just before the first 256-token boundary
    new = 40 if args.dry_run else args.new
    ids = torch.randint(3, shape["vocab_size"], (2, start_len), device=device)  # [B=2, T]
    cache = tiercache.TieredCache.from_policy(policy, config)
    times, lengths = [], []
    if device.type == "cuda":
        # the weights are made in float32, then cast: the caching allocator keeps the float32 blocks
        # reserved unless emptied, which is the model's memory, not the run's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        weights = torch.cuda.memory_allocated()
        before = torch.cuda.memory_stats()
    gc_ms, gc_start = [0.0], [0.0]  # the interpreter's garbage collections, timed (do they stall a step?)

    def gc_timer(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_ms[0] += (time.perf_counter() - gc_start[0]) * 1e3

    gc.callbacks.append(gc_timer)
    cpu, gcs, waits = [], [], []
    with torch.no_grad():
        out = model(ids, **cache_arg(cache), use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        sync(device)
        for _ in range(new):
            w0 = cache.offload_stats()["host_waits"]  # (read outside the step's time)
            t0, c0, g0 = time.perf_counter(), time.thread_time(), gc_ms[0]
            out = model(nxt, **cache_arg(cache), use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
            cpu.append((time.thread_time() - c0) * 1e3)
            gcs.append(gc_ms[0] - g0)
            waits.append(cache.offload_stats()["host_waits"] - w0)
            lengths.append(cache.get_seq_length())
    gc.callbacks.remove(gc_timer)
    stats = cache.offload_stats()
    cross = [t for t, n in zip(times, lengths) if n % 256 == 0]
    steady = [t for t, n in zip(times, lengths) if n % 256 != 0][2:]
    q = sorted(steady)
    print(f"- model: random Llama, {layers} layers, {shape['num_key_value_heads']} K/V heads x {shape['head_dim']}, "
          f"{dtype}, batch 2; offload cpu prefetch 1; {start_len} -> {start_len + new} tokens")
    print(f"- step ms: median {statistics.median(q):.2f}, p90 {q[int(0.9 * (len(q) - 1))]:.2f}, max {max(times):.2f}; "
          f"steps at a 256-token boundary: {', '.join(f'{t:.2f}' for t in cross) or 'none'}")
    hist = _histogram(times)
    print("- histogram (ms: steps): " + "; ".join(f"{lo:.2f}-{hi:.2f}: {c}" for lo, hi, c in hist))
    slow = [i for i, t in enumerate(times) if t > 3 * statistics.median(q)]
    print("- steps over 3x the median (wall / this thread's CPU / garbage collection ms, host waits, tokens): "
          + ("; ".join(f"{times[i]:.0f} / {cpu[i]:.0f} / {gcs[i]:.0f}, {waits[i]}, {lengths[i]}" for i in slow)
             or "none") + f"; a median step's CPU {statistics.median(cpu):.1f} ms")
    per_tok = max(1, new)
    print(f"- host_waits {stats['host_waits']}; bytes to the device per token {stats['bytes_h2d'] / per_tok:,.0f}; "
          f"to the host {stats['bytes_d2h'] / per_tok:,.0f}; fetches {stats['fetches']}")
    if device.type == "cuda":
        after = torch.cuda.memory_stats()
        print(f"- memory_allocated {torch.cuda.memory_allocated() / 2**20:.1f} MiB (of it the model's weights "
              f"{weights / 2**20:.1f} MiB), memory_reserved {torch.cuda.memory_reserved() / 2**20:.1f} MiB; peaks "
              f"{torch.cuda.max_memory_allocated() / 2**20:.1f} / {torch.cuda.max_memory_reserved() / 2**20:.1f} MiB "
              f"(reserved / allocated at the peak {torch.cuda.max_memory_reserved() / torch.cuda.max_memory_allocated():.2f})")
        print("- the caching allocator during the run: "
              + ", ".join(f"{k} {after.get(k, 0) - before.get(k, 0)}" for k in
                          ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")))
    print(f"- cache bytes per place: {cache.nbytes()}")
    return 0


def _histogram(values, bins: int = 6):
    lo, hi = min(values), max(values)
    width = (hi - lo) / bins or 1.0
    counts = [0] * bins
    for x in values:
        counts[min(bins - 1, int((x - lo) / width))] += 1
    return [(lo + i * width, lo + (i + 1) * width, c) for i, c in enumerate(counts) if c]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("env", "profile", "persist", "offload"))
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--context", type=int, default=32768, help="profile: tokens in the layer")
    ap.add_argument("--steps", type=int, default=20, help="profile: decode steps profiled")
    ap.add_argument("--layers", type=int, default=8, help="offload: model layers")
    ap.add_argument("--model-layers", type=int, default=4, help="profile: layers of the whole-model comparison")
    ap.add_argument("--model-steps", type=int, default=5, help="profile: decode steps profiled per cache")
    ap.add_argument("--new", type=int, default=300, help="offload: decode steps")
    args = ap.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    return {"env": cmd_env, "profile": cmd_profile, "persist": cmd_persist, "offload": cmd_offload}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
