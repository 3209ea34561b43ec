"""Tables and plot of the real-model benchmark (``realbench``): markdown, JSON, PNG.

Interface
- ``markdown(rows, meta) -> str``: the main table, then retrieval per context length. With several
  texts per kind, each perplexity cell reads ``ppl (mean Δ [90% interval])``.
- ``write(rows, meta, out_dir) -> {"md", "json", "png"}``: writes ``real.md``, ``real.json`` and
  ``real.png`` (perplexity increase vs KV bytes; retrieval accuracy per setup).
"""

from __future__ import annotations

import json
from pathlib import Path


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:+.2f}%"


def _mib(n) -> str:
    return "" if n is None else f"{n / 2**20:.2f}"


def _ppl(row: dict, kind: str) -> str:
    """``ppl (Δ)``; with several texts, ``Δ`` is their mean and its 90% bootstrap interval follows."""
    if kind not in row["ppl"]:
        return ""
    sp = row.get("ppl_spread", {}).get(kind)
    interval = f" [{_pct(sp['lo'])}, {_pct(sp['hi'])}]" if sp and len(sp["per_text"]) > 1 else ""
    return f"{row['ppl'][kind]:.3f} ({_pct(row['ppl_delta'][kind])}{interval})"


def markdown(rows: list[dict], meta: dict) -> str:
    kinds = meta["texts"]
    ref = rows[0]
    head = ["setup", "KV MiB", "vs fp", "decode tok/s"]
    head += [f"ppl {k} (Δ)" for k in kinds] + ["top-1 agree", "greedy agree", "retrieval"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], _mib(r.get("bytes")), f"{r['bytes'] / ref['bytes']:.3f}" if r.get("bytes") else "",
                 f"{r['tok_s']:.1f}" if r.get("tok_s") else ""]
        cells += [_ppl(r, k) for k in kinds]
        top1 = [r["top1"][k] for k in kinds if k in r["top1"]]
        cells.append(f"{sum(top1) / len(top1):.3f}" if top1 else "")
        cells.append(f"{r['greedy']:.3f}" if "greedy" in r else "")
        got = sum(g for g, _ in r["retrieval"].values())
        asked = sum(a for _, a in r["retrieval"].values())
        cells.append(f"{got}/{asked} ({100 * got / asked:.0f}%)" if asked else "not run")
        lines.append("| " + " | ".join(cells) + " |")
    out = "\n".join(lines)
    lengths = sorted({int(n) for r in rows for n in r["retrieval"]})
    if lengths:
        head = ["setup"] + [f"~{n} tokens" for n in lengths]
        sub = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in rows:
            by = {int(k): v for k, v in r["retrieval"].items()}
            sub.append("| " + " | ".join([r["name"]] + [f"{by[n][0]}/{by[n][1]}" if n in by else "" for n in lengths]) + " |")
        out += "\n\nPass-key retrieval, found / asked, per context length (depths " + \
               ", ".join(f"{d:g}" for d in meta["depths"]) + "):\n\n" + "\n".join(sub)
    return out


def write(rows: list[dict], meta: dict, out_dir) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "real.md", "json": out / "real.json", "png": out / "real.png"}
    paths["md"].write_text(markdown(rows, meta) + "\n")
    plain = [{**r, "retrieval": {str(k): list(v) for k, v in r["retrieval"].items()}} for r in rows]
    paths["json"].write_text(json.dumps({"meta": meta, "rows": plain}, indent=2))
    _plot(rows, meta, paths["png"])
    return {k: str(v) for k, v in paths.items()}


def _plot(rows, meta, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5))
    for r in rows:
        if not r.get("bytes") or not r["ppl_delta"]:
            continue
        delta = 100 * sum(r["ppl_delta"].values()) / len(r["ppl_delta"])
        marker = "s" if "Cache" in r["name"] else "o"
        a.scatter(r["bytes"] / 2**20, delta, marker=marker)
        a.annotate(r["name"], (r["bytes"] / 2**20, delta), fontsize=7, xytext=(3, 3), textcoords="offset points")
    a.set_xlabel(f"KV cache MiB after {meta['prompt'] + meta['tokens']} tokens")
    a.set_ylabel("perplexity increase vs full precision, % (mean of " + ", ".join(meta["texts"]) + ")")
    a.set_yscale("symlog", linthresh=1)
    a.axhline(0, color="grey", lw=0.5)
    a.set_title(f"{meta.get('model', '')}: memory vs quality (squares: transformers)")
    names = [r["name"] for r in rows if r.get("retrieval_acc") is not None]
    accs = [100 * r["retrieval_acc"] for r in rows if r.get("retrieval_acc") is not None]
    b.barh(names, accs)
    b.invert_yaxis()
    b.set_xlim(0, 100)
    b.set_xlabel("pass-key retrieval accuracy, %")
    b.set_title(f"contexts {', '.join(map(str, meta['contexts']))} tokens")
    b.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
