"""The README's real-model summary: merge bench_real.py and bench_retrieval.py runs into one table
and one plot (perplexity vs bits per element, pass keys found per setup).

    python bench/plot_real.py --ppl out/a/real.json out/b/real.json \\
        --retrieval out/r1/retrieval.json out/r2/retrieval.json --out docs/real-quality.png

Runs must have measured the same texts (the same full-precision perplexity) and the same
retrieval samples; a setup measured in two runs is refused (pass the one to keep).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from research import realbench, retrievalbench, summary  # noqa: E402
from tiercache.bench import setups
from tiercache.planner.api import resolve_model  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ppl", nargs="+", required=True, help="bench_real.py real.json files (--texts-per-kind runs)")
    p.add_argument("--retrieval", nargs="*", default=[], help="bench_retrieval.py retrieval.json files")
    p.add_argument("--model", default=None, help="the model whose layers count the bits (default: the runs' model)")
    p.add_argument("--setups", default=None, help="comma-separated: show only these (in this order; default: all)")
    p.add_argument("--out", default="out/summary/real-quality.png", help="the plot; the table goes beside it (.md)")
    args = p.parse_args(argv)
    try:  # PolicyError (an unknown model) is a ValueError
        meta, ppl_rows = summary.merge_perplexity([json.loads(Path(f).read_text()) for f in args.ppl])
        retrieval = summary.merge_retrieval([json.loads(Path(f).read_text()) for f in args.retrieval])
        model = resolve_model(args.model or meta["model"])
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_real: {e}", file=sys.stderr)
        return 2
    builds = {**retrievalbench.SETUPS, **{n: s[1] for n, s in realbench.SETUPS.items()}}
    bits = {n: summary.bits_per_element(setups.spec_of(n, builds), model)
            for n in {*ppl_rows, *retrieval} if n in builds or setups.is_policy_file(n)}
    rows = summary.summary_rows(ppl_rows, retrieval, bits)
    if args.setups:
        order = [n.strip() for n in args.setups.split(",") if n.strip()]
        missing = [n for n in order if n not in {r["name"] for r in rows}]
        if missing:
            print(f"plot_real: --setups {missing} are in none of the runs", file=sys.stderr)
            return 2
        rows = sorted((r for r in rows if r["name"] in order), key=lambda r: order.index(r["name"]))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = summary.markdown(rows, meta)
    out.with_suffix(".md").write_text(table)
    summary.plot(rows, meta, out)
    print(table)
    print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
