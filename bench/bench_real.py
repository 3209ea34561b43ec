"""The trade-off benchmark on a real model (SmolLM2-135M-Instruct by default), tiercache's
policies and transformers' caches in the same run.

    python bench/bench_real.py                          # the demo size (make demo-real): ~10 min on 2 cores
    python bench/bench_real.py --tokens 256 --contexts 1024,2048,4096,7168 --depths 0.1,0.3,0.5,0.7,0.9
    python bench/bench_real.py --texts-per-kind 8 --tokens 256 --greedy-tokens 0 --contexts ""   # perplexity, 16 texts

Which layers' keys and values get more bits is ``tiercache tune``'s work (docs/tuning.md):
``--sensitivity`` and ``--upgrade-search`` say so and exit.

Per setup (``research.realbench``): KV bytes, decode tokens/s (teacher-forced steps),
perplexity on held-out stdlib code and prose after a ``--prompt``-token prefill (``--tokens``
scored per text, one token per step, so every prediction reads the cache as kept), top-1 and
greedy agreement with full precision, and pass-key retrieval at several context lengths and
depths. ``--texts-per-kind N``: N held-out texts of each kind, each setup's perplexity increase
given as the mean over texts with a 90% bootstrap interval (one text is far too noisy to judge a
fraction of a percent). Group 64, residual 128, keys per channel, values per token for every quantized setup.
Writes ``real.md``, ``real.json``, ``real.png`` under ``--out``. Timings share the CPU with
whatever else runs: compare tokens/s within one run only.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tiercache

from tiercache.models import registry as builtin  # noqa: E402
from research import real_report, realbench


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help=f"a built-in name ({', '.join(builtin.NAMES)}) or a path")
    p.add_argument("--setups", default=",".join(realbench.DEFAULT), help="comma-separated names from realbench.SETUPS, or policy YAML paths")
    p.add_argument("--prompt", type=int, default=1024, help="prefill tokens before the scored text")
    p.add_argument("--tokens", type=int, default=128, help="teacher-forced tokens scored per text")
    p.add_argument("--texts", default="code,prose")
    p.add_argument("--texts-per-kind", type=int, default=1,
                   help="held-out texts of each kind, decoded as one batch: mean delta and 90%% bootstrap interval over them")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the model, every cache and the texts)")
    p.add_argument("--greedy-tokens", type=int, default=16)
    p.add_argument("--contexts", type=_ints, default=[1024, 4096, 6144], help="retrieval context lengths ('' for none)")
    p.add_argument("--depths", type=_floats, default=[0.3, 0.7])
    p.add_argument("--retrieval-setups", default=None, help="comma-separated: retrieval for these only (default: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="out/real")
    p.add_argument("--sensitivity", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--upgrade-search", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.sensitivity or args.upgrade_search:
        p.error("--sensitivity / --upgrade-search are replaced by tiercache tune: tiercache tune --model MODEL "
                "--context N --budget int2 (docs/tuning.md)")
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    try:
        realbench.setup_names(names)  # before the model loads: a typo costs no conversion
    except ValueError as e:
        print(f"bench_real: error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    from tiercache.models.load import ModelLoadError, load_model

    try:
        model, tok = load_model(args.model, device=args.device)
    except ModelLoadError as e:
        print(f"bench_real: error: {e}", file=sys.stderr)
        return 1
    rows, meta = realbench.run(model, tok, names, args.prompt, args.tokens, [k for k in args.texts.split(",") if k],
                               args.greedy_tokens, args.contexts, args.depths, retrieval_names=None if
                               args.retrieval_setups is None else args.retrieval_setups.split(","),
                               texts_per_kind=args.texts_per_kind)
    meta.update(model=args.model, device=str(model.device), dtype="float32", torch=torch.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    paths = real_report.write(rows, meta, args.out)
    print()
    print(real_report.markdown(rows, meta))
    print(f"\n{args.model}, {meta['threads']} threads, {meta['seconds']} s; table {paths['md']}, json {paths['json']}, "
          f"plot {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
