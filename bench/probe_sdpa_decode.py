"""Where a full-precision decode step's SDPA time goes on a GPU: an exact-length K/V (DynamicCache's
``torch.cat``) vs a view of a longer buffer (tiercache's full-precision layer), per SDPA backend,
then the whole model (4 8B-shaped layers) with each cache, cuDNN attention on and off: wall ms per
step, whether a step synchronizes, and the profiler's CPU ops.

    python3 bench/probe_sdpa_decode.py            # on a CUDA machine
    python3 bench/probe_sdpa_decode.py --dry-run  # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gpu_quick import SHAPE_8B, SHAPE_TINY, random_llama, sync  # noqa: E402


def layer_steps(device, dtype, context, steps, layout, heads=32, kv_heads=8, dim=128):
    """Per-step wall and CPU-side ms of ``steps`` decode steps of one layer (append + SDPA)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    k = torch.randn(1, kv_heads, context, dim, device=device, dtype=dtype)  # [B, H_kv, T, D]
    v = torch.randn_like(k)
    if layout == "view":
        cap = context + steps + 256
        kb = torch.zeros(1, kv_heads, cap, dim, device=device, dtype=dtype)
        vb = torch.zeros_like(kb)
        kb[:, :, :context] = k
        vb[:, :, :context] = v
        del k, v
    walls, cpus = [], []
    length = context
    for _ in range(steps):
        q = torch.randn(1, heads, 1, dim, device=device, dtype=dtype)  # [B, H, 1, D]
        nk = torch.randn(1, kv_heads, 1, dim, device=device, dtype=dtype)
        sync(device)
        t0 = time.perf_counter()
        if layout == "cat":
            k = torch.cat([k, nk], dim=-2)
            v = torch.cat([v, nk], dim=-2)
            kk, vv = k, v
        else:
            kb[:, :, length] = nk[:, :, 0]
            vb[:, :, length] = nk[:, :, 0]
            kk, vv = kb[:, :, : length + 1], vb[:, :, : length + 1]
        out, _ = sdpa_attention_forward(module, q, kk, vv, None)
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        length += 1
        cpus.append((t1 - t0) * 1e3)
        walls.append((t2 - t0) * 1e3)
    half = steps // 3
    return statistics.median(walls[half:]), statistics.median(cpus[half:])


def whole_model(device, dtype, context, layers, steps, dry):
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    import tiercache
    from tiercache.cache.compat import cache_arg
    from tiercache.cache.prefill import prefill

    shape = SHAPE_TINY if dry else SHAPE_8B
    config, model = random_llama(shape, layers, context + 64, dtype, device)
    ids = torch.randint(3, shape["vocab_size"], (1, context), device=device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for cudnn in (True, False):
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for name in ("DynamicCache", "default"):
            cache = (DynamicCache(config=config) if name == "DynamicCache"
                     else tiercache.TieredCache.from_policy(ROOT / "configs" / "default.yaml", config))
            prefill(model, ids, cache, 2048)
            nxt = ids[:, -1:]
            for _ in range(3):
                nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
            sync(device)
            if device.type == "cuda":  # a decode step must not wait for the GPU
                torch.cuda.set_sync_debug_mode("error")
            try:
                nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
                synced = "no"
            except RuntimeError as exc:
                synced = f"YES ({str(exc).splitlines()[0][:80]})"
            finally:
                if device.type == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
            t0 = time.perf_counter()
            for _ in range(steps):
                nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
            sync(device)
            plain = (time.perf_counter() - t0) * 1e3 / steps
            with profile(activities=acts, record_shapes=True) as prof:
                for _ in range(steps):
                    nxt = model(nxt, **cache_arg(cache), use_cache=True).logits[:, -1:].argmax(-1)
                sync(device)
            print(f"\n#### {name}, cudnn {'on' if cudnn else 'off'}: {plain:.2f} ms / step unprofiled; "
                  f"a step synchronizes: {synced}\n")
            print("```")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
            print("```")
            del cache
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=30, help="decode steps of the one-layer comparison")
    ap.add_argument("--model-context", type=int, default=8192, help="context of the whole-model comparison")
    args = ap.parse_args(argv)
    import torch

    torch.set_grad_enabled(False)
    dry = args.dry_run or not torch.cuda.is_available()
    device = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    context = 256 if dry else args.context
    print(f"device {torch.cuda.get_device_name() if not dry else 'cpu'}; torch {torch.__version__}\n")
    print("| backends | layout | wall ms / step | CPU-side ms / step |")
    print("|---|---|---|---|")
    for label, cudnn in (("as torch picks", True), ("cuDNN off", False)):
        if not dry:
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for layout in ("cat", "view", "cat", "view"):
            wall, cpu = layer_steps(device, dtype, context, args.steps, layout)
            print(f"| {label} | {layout} | {wall:.3f} | {cpu:.3f} |")
    if not dry:
        torch.backends.cuda.enable_cudnn_sdp(True)
    whole_model(device, dtype, 256 if dry else args.model_context, 2 if dry else 4, 30, dry)
    return 0


if __name__ == "__main__":
    sys.exit(main())
