"""Long-context generation table: chunked prefill, then decode, per cache, on an 8B-shaped model.

    python bench/bench_longctx.py --device cuda                  # 8B shape, 32k and 128k tokens
    python bench/bench_longctx.py --dry-run                      # a tiny shape on the CPU (tests)

The model is a random-weight Llama with the shape of Llama-3-8B (32 layers, 32 heads, 8 KV heads
of 128, hidden 4096, MLP 14336, vocab 128256) in bf16: the memory and speed of a cache do not
depend on the weights' values. Per context and cache: the prompt (context - new tokens) is
prefilled in chunks (``tiercache.cache.prefill.prefill``, the same for every cache), then
``model.generate`` decodes ``--new`` tokens greedily. Reported: prefill seconds, decode tokens/s,
peak device memory (``torch.cuda.max_memory_allocated``) in prefill and in decode, whether both
stayed under ``--cap-gb``, and for our policies the plan's allocated total
(``tiercache.plan(..., device="cuda")``, runtime line excluded) and measured / planned.
A cache that runs out of memory is reported as OOM, one whose backend is not installed (quanto)
as skipped, one that fails as its error, and the table goes on. Each cache first runs once at
``--warmup`` tokens (Triton kernels compile, allocator pools fill) outside the timed run.
Caches: DynamicCache, DynamicCache(offloading=True), QuantizedCache(quanto int4), and our
``default``, ``int4-kivi``, ``offload-cpu``, ``tiered-int4-offload`` configs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from tiercache.cache.compat import cache_arg

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                intermediate_size=14336, vocab_size=128256)
SHAPE_TINY = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=64,
                  intermediate_size=128, vocab_size=256)
OURS = ["default", "int4-kivi", "offload-cpu", "tiered-int4-offload"]
THEIRS = ["DynamicCache", "DynamicCache(offloading)", "QuantizedCache quanto int4"]


def build_model(shape: dict, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, max_position_embeddings=262144, rope_theta=500000.0, dtype=dtype,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def make_cache(name: str, config):
    from transformers import DynamicCache, QuantizedCache

    import tiercache

    if name == "DynamicCache":
        return DynamicCache(config=config)
    if name == "DynamicCache(offloading)":
        return DynamicCache(config=config, offloading=True)
    if name == "QuantizedCache quanto int4":
        return QuantizedCache("quanto", config, nbits=4, axis_key=0, axis_value=0, q_group_size=64, residual_length=128)
    return tiercache.TieredCache.from_policy(ROOT / "configs" / f"{name}.yaml", config)


def missing_backend(name: str) -> str | None:
    """Why ``name`` cannot be built here (its optional package is absent), or None."""
    if "quanto" in name:
        try:
            import optimum.quanto  # noqa: F401
        except ImportError:
            return "skipped: optimum-quanto is not installed"
    return None


def run_one(model, name: str, context: int, new: int, chunk: int, device: str) -> dict:
    import torch

    from tiercache.cache.prefill import prefill

    cuda = device == "cuda"
    ids = torch.randint(3, model.config.vocab_size, (1, context - new), device=device)  # [1, T]
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cache = make_cache(name, model.config)
    start = time.perf_counter()
    prefill(model, ids[:, :-1], cache, chunk)
    if cuda:
        torch.cuda.synchronize()
    prefill_s = time.perf_counter() - start
    peak_prefill = torch.cuda.max_memory_allocated() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **cache_arg(cache), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
    if cuda:
        torch.cuda.synchronize()
    decode_s = time.perf_counter() - start
    peak_decode = torch.cuda.max_memory_allocated() if cuda else None
    made = out.shape[1] - ids.shape[1]
    row = {"cache": name, "context": context, "prefill_s": prefill_s, "decode_tok_s": made / decode_s,
           "peak_prefill": peak_prefill, "peak_decode": peak_decode}
    del cache, out
    return row


def planned(name: str, model, context: int, chunk: int, device: str) -> int | None:
    if name not in OURS:
        return None
    import tiercache

    p = tiercache.plan(ROOT / "configs" / f"{name}.yaml", model, 1, context, device=device, prefill_chunk=chunk)
    return p.whole.allocated("device")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dry-run", action="store_true", help="a tiny shape on the CPU, two short contexts")
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--cap-gb", type=float, default=24.0)
    ap.add_argument("--caches", default=",".join(THEIRS + OURS))
    ap.add_argument("--out", default="out")
    ap.add_argument("--warmup", type=int, default=1024, help="tokens of an untimed first run per cache (0: none)")
    args = ap.parse_args(argv)

    import torch

    if args.dry_run:
        args.device, shape, dtype = "cpu", SHAPE_TINY, torch.float32
        args.contexts, args.new, args.chunk, args.warmup = "96,160", 4, 32, min(args.warmup, 48)
    else:
        shape, dtype = SHAPE_8B, torch.bfloat16
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_longctx: error: --device cuda but no CUDA GPU is visible (use --dry-run on a CPU)", file=sys.stderr)
        return 1
    model = build_model(shape, args.device, dtype)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}; torch {torch.__version__}; model: random Llama {shape} {dtype}; "
          f"chunked prefill {args.chunk} tokens, {args.new} new tokens; cap {args.cap_gb} GB")
    cap = args.cap_gb * 1e9
    rows, warm = [], set()
    for context in (int(c) for c in args.contexts.split(",")):
        for cache in args.caches.split(","):
            if cache == "DynamicCache(offloading)" and args.device != "cuda":
                rows.append({"cache": cache, "context": context, "note": "skipped: offloading=True needs CUDA"})
                continue
            why = missing_backend(cache)
            if why:
                rows.append({"cache": cache, "context": context, "note": why})
                print(f"  {cache} @ {context}: {why}", flush=True)
                continue
            try:
                if args.warmup and cache not in warm:
                    run_one(model, cache, args.warmup, min(args.new, 4), args.chunk, args.device)
                    warm.add(cache)
                row = run_one(model, cache, context, args.new, args.chunk, args.device)
            except torch.OutOfMemoryError as e:
                row = {"cache": cache, "context": context, "note": f"OOM: {str(e).splitlines()[0][:80]}"}
            except Exception as e:  # one cache's failure is a row of the table, not the end of it
                row = {"cache": cache, "context": context, "note": f"FAILED: {type(e).__name__}: {str(e)[:120]}"}
            if args.device == "cuda":
                torch.cuda.empty_cache()
            row["planned"] = planned(cache, model, context, args.chunk, args.device) if "prefill_s" in row else None
            rows.append(row)
            print(f"  {cache} @ {context}: " + " | ".join(_cells(row, cap)), flush=True)
    print()
    print("| cache | context | prefill s | decode tok/s | peak prefill | peak decode | under cap | planned | measured / planned |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['cache']} | {row['context']} | " + " | ".join(_cells(row, cap)) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "longctx.json").write_text(json.dumps({"device": name, "args": vars(args), "rows": rows}, indent=2))
    print(f"\nwrote {out / 'longctx.json'}")
    return 1 if any(str(r.get("note", "")).startswith("FAILED") for r in rows) else 0


def _cells(row: dict, cap: float) -> list[str]:
    if "note" in row and "prefill_s" not in row:
        return [row["note"]] + [""] * 7
    from tiercache.planner.api import human

    gib = lambda n: "-" if n is None else human(n)  # noqa: E731
    peaks = [p for p in (row["peak_prefill"], row["peak_decode"]) if p is not None]
    under = ("yes" if max(peaks) <= cap else "NO") if peaks else "-"
    ratio = f"{max(peaks) / row['planned']:.3f}" if peaks and row.get("planned") else "-"
    return [f"{row['prefill_s']:.2f}", f"{row['decode_tok_s']:.1f}", gib(row["peak_prefill"]), gib(row["peak_decode"]),
            under, gib(row.get("planned")), ratio]


if __name__ == "__main__":
    sys.exit(main())
