"""Long-context retrieval per cache setup against full precision (SmolLM2-135M-Instruct by default).

    python bench/bench_retrieval.py                                     # 10 samples at ~1k, 2k, 4k, 7k tokens
    python bench/bench_retrieval.py --contexts 7168 --out out/r7k       # one length per process ...
    python bench/bench_retrieval.py --merge out/r1k/retrieval.json out/r7k/retrieval.json --out out/r   # ... merged

A pass key (``--format passkey``) or a named key-value pair (``--format kv``) hidden at depths
0.1-0.9 of filler text (``--samples`` per context length, one key each, the same samples in every
run with the same ``--seed``); each sample's context is prefilled once and fed to every setup's
cache with the model's own ``update`` calls, then the question is read through that cache in its
own update and 8 tokens are decoded greedily; found = the first number of the answer is the key.
Writes ``retrieval.md`` and ``retrieval.json`` under ``--out`` after every sample (a run cut
short keeps what it measured; ``--resume`` goes on from it). Depths are asked spread out
(0.1, 0.9, 0.5, ...), so a run cut short still covers the whole range; a second process on the
same length with ``--reverse`` (another ``--out``) starts from the other end, and ``--merge``
counts a sample both asked once. Setups: ``research.retrievalbench.SETUPS``.

``--needle-attention`` asks no setup: it measures, at full precision on the same samples, each
layer's and head's attention on the needle from the question's last token (``research.needle``),
and writes ``needle_attention.md`` / ``.json``: where the model reads the key, the layers a
per-layer ``key_gain`` is for (README, "A gain where the retrieval heads read").

    python bench/bench_retrieval.py --needle-attention --contexts 1024,2048 --samples 5 --seed 0 --out out/needle
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
from research import retrieval, retrievalbench


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _write(records, names, meta, out: Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    text = retrievalbench.markdown(records, names, meta)
    (out / "retrieval.md").write_text(text + "\n")
    rows = retrievalbench.table(records, retrievalbench._names(names, exist=False))
    plain = [{**r, "by_length": {str(k): list(v) for k, v in r["by_length"].items()}} for r in rows]
    (out / "retrieval.json").write_text(json.dumps({"meta": meta, "names": names, "rows": plain, "records": records},
                                                   indent=1))
    return text


def _merge(paths, out: Path) -> int:
    records, names, meta = [], [], {}
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
            data["records"], data["names"], data["meta"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"bench_retrieval: error: --merge {p}: not a retrieval.json of this benchmark ({e})", file=sys.stderr)
            return 2
        records = retrievalbench.unique(records + data["records"])  # a sample two runs both asked counts once
        names += [n for n in data["names"] if n not in names]
        meta = meta or data["meta"]
    meta = {**meta, "merged": [str(p) for p in paths]}
    print(_write(records, names, meta, out))
    return 0


def _needle_attention(model, tok, args, meta, out: Path, start: float) -> int:
    from research import needle

    samples = retrieval.samples(tok, args.contexts, retrieval.spread(args.samples), seed=args.seed, fmt=args.format,
                                chat=args.chat)
    att = needle.mean_attention(model, samples)  # [L, Hq]
    meta["seconds"] = round(time.perf_counter() - start, 1)
    text = (f"Attention on the needle from the question's last token, full precision, mean over {len(samples)} samples "
            f"(contexts {', '.join(map(str, args.contexts))}, seed {args.seed}, format {args.format!r}):\n\n"
            + needle.table(att, args.threshold))
    out.mkdir(parents=True, exist_ok=True)
    (out / "needle_attention.md").write_text(text + "\n")
    (out / "needle_attention.json").write_text(json.dumps({"meta": meta, "attention": att.tolist()}, indent=1))
    print(text)
    print(f"\n{args.model}, {meta['seconds']} s; table {out / 'needle_attention.md'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help=f"a built-in name ({', '.join(builtin.NAMES)}) or a path")
    p.add_argument("--setups", default=",".join(retrievalbench.DEFAULT), help="comma-separated names from SETUPS, or policy YAML paths")
    p.add_argument("--contexts", type=_ints, default=[1024, 2048, 4096, 7168], help="context lengths, tokens")
    p.add_argument("--samples", type=int, default=10, help="samples per context length (depths 0.1-0.9)")
    p.add_argument("--format", default="passkey", choices=sorted(retrieval.FORMATS))
    p.add_argument("--chat", action="store_true", help="wrap the task in the model's chat template")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="out/retrieval")
    p.add_argument("--resume", action="store_true", help="keep the samples already in --out's retrieval.json")
    p.add_argument("--reverse", action="store_true", help="ask the depths in the reverse order (a second process)")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge the retrieval.json of earlier runs, run nothing")
    p.add_argument("--needle-attention", action="store_true", help="no setups: each layer's and head's attention on "
                   "the needle at full precision, averaged over the samples")
    p.add_argument("--threshold", type=float, default=0.4, help="--needle-attention: mark the layers whose strongest "
                   "head puts at least this share of its attention on the needle")
    args = p.parse_args(argv)
    if args.merge:
        return _merge(args.merge, Path(args.out))
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.setups.split(",") if n.strip()]
    try:
        names = retrievalbench._names(names)
        retrieval.spread(args.samples)
    except ValueError as e:
        print(f"bench_retrieval: error: {e}", file=sys.stderr)
        return 2
    from tiercache.models.load import ModelLoadError, load_model

    try:
        model, tok = load_model(args.model)
    except ModelLoadError as e:
        print(f"bench_retrieval: error: {e}", file=sys.stderr)
        return 1
    meta = {"model": args.model, "format": args.format, "chat": args.chat, "samples": args.samples,
            "contexts": args.contexts, "seed": args.seed, "threads": args.threads, "dtype": "float32",
            "torch": torch.__version__, "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    out = Path(args.out)
    done = []
    if args.resume and (out / "retrieval.json").is_file():
        earlier = json.loads((out / "retrieval.json").read_text())
        same = all(earlier["meta"].get(k) == meta[k] for k in ("model", "format", "chat", "seed"))
        done = earlier["records"] if same else []
        print(f"resuming: {len(done)} samples from {out / 'retrieval.json'}" if same else
              f"not resuming: {out / 'retrieval.json'} was another model, format or seed", flush=True)
    start = time.perf_counter()
    if args.needle_attention:
        return _needle_attention(model, tok, args, meta, out, start)
    records = retrievalbench.run(model, tok, names, args.contexts, args.samples, args.format, args.chat, args.seed,
                                 log=lambda m: print(m, flush=True),
                                 on_sample=lambda recs: _write(recs, names, meta, out), done=done,
                                 reverse=args.reverse)
    meta["seconds"] = round(time.perf_counter() - start, 1)
    text = _write(records, names, meta, out)
    print()
    print(text)
    print(f"\n{args.model}, {args.threads} threads, {meta['seconds']} s; table {out / 'retrieval.md'}, "
          f"json {out / 'retrieval.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
