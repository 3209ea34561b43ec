"""``tiercache bench``: parse flags, build the setups, measure each, write the report.

Interface: ``main(argv) -> int`` (flags documented in ``tiercache.bench.main``);
``run(args) -> (rows, meta, paths)`` for callers that want the results.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from tiercache.bench import report, runner, setups, tiny


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache bench", description="KV cache trade-offs: speed, memory, quality.")
    p.add_argument("--model", default="tiny", help="tiny | tiny-random | local path | hub id")
    p.add_argument("--policies", nargs="*", default=None, help="policy YAML paths (default: the demo set)")
    p.add_argument("--baselines", default=",".join(setups.DEFAULT_BASELINES),
                   help=f"comma-separated, or 'none'; from: {', '.join(setups.BASELINES)}")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="timed greedy decode steps")
    p.add_argument("--quality-tokens", type=int, default=512, help="held-out tokens scored by teacher forcing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per setup (fastest kept)")
    p.add_argument("--device", default=None, help="cpu | cuda | cuda:N")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: stable timings on a shared machine; 0 = torch's default)")
    p.add_argument("--out", default="out/bench", help="output directory")
    p.add_argument("--no-progress", action="store_true")
    return p


def run(args) -> tuple[list[dict], dict, dict]:
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    model, tok = tiny.load_model(args.model, device=str(device), dtype=dtype)
    ids = tiny.eval_ids(tok, args.context + args.quality_tokens)  # [context + quality_tokens]

    rows_setups = setups.policy_setups(args.policies if args.policies else setups.demo_policies(), model.config)
    names = [] if args.baselines.strip() in ("", "none") else [n.strip() for n in args.baselines.split(",")]
    rows_setups += setups.baseline_setups(names, model.config, str(device))

    per_setup = args.repeats * args.new_tokens + args.quality_tokens - 1
    bar = tqdm(total=len(rows_setups) * per_setup + args.new_tokens, desc="bench", unit="step", mininterval=0.5,
               disable=args.no_progress, dynamic_ncols=True)
    bar.set_postfix_str("full-precision reference")
    t0 = time.perf_counter()
    ref = runner.Reference.compute(model, ids, args.context, args.new_tokens)
    bar.update(args.new_tokens)
    rows = []
    for i, s in enumerate(rows_setups):
        bar.set_postfix_str(s.name)
        rows.append(runner.measure(s, model, ids, args.context, args.new_tokens, ref, args.repeats, bar.update))
        bar.update(args.new_tokens + (i + 1) * per_setup - bar.n)  # skipped or failed rows
    bar.close()
    meta = {
        "model": args.model, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
        "context": args.context, "new_tokens": args.new_tokens, "quality_tokens": args.quality_tokens,
        "repeats": args.repeats, "reference_ppl": ref.ppl, "reference": "no-cache forward (ppl, top-1); DynamicCache (greedy)",
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": _version("transformers"),
        "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "seconds": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return rows, meta, report.write(rows, meta, args.out)


def _version(pkg: str) -> str:
    from importlib.metadata import version

    return version(pkg)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows, meta, paths = run(args)
    print()
    print(report.markdown(rows, meta))
    print(f"ran {len(rows)} setups in {meta['seconds']} s on {meta['device']} ({meta['threads']} threads)")
    print(f"table: {paths['md']}\njson:  {paths['json']}\nplot:  {paths['png']}")
    return 0 if any("decode_tok_s" in r for r in rows) else 1
