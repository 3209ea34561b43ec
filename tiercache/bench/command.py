"""``tiercache bench``: parse flags, build the setups, measure each, write the report.

Interface: ``main(argv) -> int`` (flags documented in ``tiercache.bench.main``; 0 when at least
one setup ran to completion, 1 when none did or on a ``BenchError``, 2 for malformed flags);
``run(args) -> (rows, meta, paths)`` for callers that want the results (``BenchError``, a
``ValueError``, when the arguments cannot run here: no CUDA, an unloadable model, ``--out`` not a
directory, more tokens than the held-out text has).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from tiercache.bench import report, runner, setups
from tiercache.models import load, tiny
from tiercache.argtypes import non_negative_int, positive_int

DEVICES = "cpu, cuda, cuda:N"


class BenchError(ValueError):
    """Arguments that cannot run here; the message names the flag, the value and what is allowed."""


def baseline_names(text: str) -> list[str]:
    """argparse type for ``--baselines``: comma-separated names from ``setups.BASELINES``, or ``none``."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in setups.BASELINES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown baseline {', '.join(map(repr, unknown))}; "
                                         f"allowed: {', '.join(setups.BASELINES)} (comma-separated), or 'none'")
    return names


def device_name(text: str) -> str:
    """argparse type for ``--device``: ``cpu``, ``cuda`` or ``cuda:N`` (availability is checked in ``run``)."""
    try:
        kind = torch.device(text).type
    except RuntimeError:  # torch's "Expected one of cpu, cuda, ..." / "Invalid device string"
        kind = None
    if kind not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device the benchmark runs on; allowed: {DEVICES}")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tiercache bench", description="KV cache trade-offs: speed, memory, quality.")
    p.add_argument("--model", default="tiny", help="tiny | tiny-random | smollm2-135m | local path | hub id")
    p.add_argument("--policies", nargs="*", default=None, help="policy YAML paths (default: the demo set)")
    p.add_argument("--baselines", type=baseline_names, default=",".join(setups.DEFAULT_BASELINES),
                   help=f"comma-separated, or 'none'; from: {', '.join(setups.BASELINES)}")
    p.add_argument("--context", type=positive_int, default=8192, help="prompt tokens (>= 1; default 8192, where the cache dominates)")
    p.add_argument("--new-tokens", type=positive_int, default=64, help="timed greedy decode steps (>= 1)")
    p.add_argument("--quality-tokens", type=positive_int, default=256,
                   help="held-out tokens scored by teacher forcing (>= 1)")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs per setup, fastest kept (>= 1)")
    p.add_argument("--device", type=device_name, default=None, help=f"{DEVICES} (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=non_negative_int, default=1,
                   help="torch CPU threads (default 1: stable timings on a shared machine; 0 = torch's default)")
    p.add_argument("--out", default="out/bench", help="output directory (created when missing)")
    p.add_argument("--no-progress", action="store_true")
    return p


def _parsed(flag: str, value, kind):
    """``kind(value)`` for a value not yet parsed (``run`` called with strings), as a ``BenchError``."""
    try:
        return kind(value)
    except argparse.ArgumentTypeError as e:
        raise BenchError(f"{flag}: {e}") from None


def _check_args(args) -> None:
    """What argparse checks, again for callers of ``run`` that build ``args`` themselves."""
    for flag in ("context", "new_tokens", "quality_tokens", "repeats"):
        _parsed(f"--{flag.replace('_', '-')}", str(getattr(args, flag)), positive_int)
    _parsed("--threads", str(args.threads), non_negative_int)


def _device(text: str | None) -> torch.device:
    """The device to run on; ``BenchError`` when it is not one or CUDA is asked for and not there."""
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(_parsed("--device", text, device_name))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise BenchError(f"--device {text}: CUDA is not available here ({why}); use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise BenchError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return device


def _check_out(out) -> None:
    """``BenchError`` unless ``out`` is a directory or can be created as one (checked before the run)."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise BenchError(f"--out {out}: exists and is not a directory; give a directory (created when missing)")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise BenchError(f"--out {out}: {parent} is a file, so the directory cannot be created there")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise BenchError(f"--out {out}: {parent} is not writable")


def run(args) -> tuple[list[dict], dict, dict]:
    from tqdm.auto import tqdm

    _check_args(args)
    device = _device(args.device)
    _check_out(args.out)
    names = _parsed("--baselines", args.baselines, baseline_names) if isinstance(args.baselines, str) else args.baselines
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    torch.manual_seed(0)
    try:
        model, tok = load.load_model(args.model, device=str(device), dtype=dtype)
    except load.ModelLoadError as e:
        raise BenchError(str(e)) from None
    try:
        ids = tiny.eval_ids(tok, args.context + args.quality_tokens)  # [context + quality_tokens]
    except tiny.HeldoutTooShort as e:
        raise BenchError(
            f"--context {args.context} + --quality-tokens {args.quality_tokens} = {e.asked} tokens, but the built-in "
            f"held-out text gives only {e.available} tokens with {args.model}'s tokenizer; "
            f"keep --context + --quality-tokens <= {e.available}"
        ) from None

    rows_setups = setups.policy_setups(args.policies if args.policies else setups.demo_policies(), model.config)
    rows_setups += setups.baseline_setups(names, model.config, str(device))

    per_setup = args.repeats * args.new_tokens + args.quality_tokens - 1
    bar = tqdm(total=len(rows_setups) * per_setup + args.new_tokens, desc="bench", unit="step", mininterval=0.5,
               disable=args.no_progress, dynamic_ncols=True)
    bar.set_postfix_str("full-precision reference")
    t0 = time.perf_counter()
    ref = runner.Reference.compute(model, ids, args.context, args.new_tokens)
    bar.update(args.new_tokens)
    rows = runner.measure_all(rows_setups, model, ids, args.context, args.new_tokens, ref, args.repeats, bar.update,
                              bar.set_postfix_str)
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
    try:
        rows, meta, paths = run(args)
    except BenchError as e:
        print(f"tiercache bench: error: {e}", file=sys.stderr)
        return 1
    print()
    print(report.markdown(rows, meta))
    print(f"ran {len(rows)} setups in {meta['seconds']} s on {meta['device']} ({meta['threads']} threads)")
    print(f"table: {paths['md']}\njson:  {paths['json']}\nplot:  {paths['png']}")
    if not any(runner.completed(r) for r in rows):
        print("tiercache bench: error: no setup ran to completion; the note column says why each failed or was "
              "skipped", file=sys.stderr)
        return 1
    return 0
