"""Write the benchmark's results: a markdown table, a JSON file and a PNG plot.

Interface
- ``markdown(rows, meta) -> str``: one line per setup (see ``COLUMNS``; "KLD": the mean KL divergence of
  the next-token distribution from full precision's, in nats, beside the perplexity change); ratios are against the
  ``DynamicCache`` row (or the first tiercache row when there is none). "cache" is everything
  held (``nbytes()``, shared buffers such as the dequantization workspace included; the JSON's
  ``shared_total`` says how much of it they are); "peak decoding" adds what a decode step
  allocates, which is where transformers' quantized caches (that dequantize the history afresh
  each step) pay. "per place" appears when a setup holds bytes in more than one place.
- ``write(rows, meta, out_dir) -> dict``: writes ``bench.md``, ``bench.json`` (``{"meta": ...,
  "rows": [...]}``, rows as returned by ``runner.measure``) and ``bench.png`` (left: cache bytes vs
  decode tokens/s, marker area growing with the perplexity increase; right: perplexity delta per
  setup); returns ``{"md": path, "json": path, "png": path}``.
"""

from __future__ import annotations

import json
from pathlib import Path

COLUMNS = ["setup", "kind", "cache", "× bytes", "peak decoding", "decode tok/s", "× decode", "prefill tok/s", "Δppl",
           "KLD", "top-1 agree", "greedy agree", "note"]
PLACES = "per place"  # a column only when some setup holds bytes in more than one place (offload on a GPU)


def human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def _reference(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "decode_tok_s" in r]
    return next((r for r in ok if r["name"] == "DynamicCache"), next((r for r in ok if r["kind"] == "tiercache"), None))


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _note(note: str | None, width: int = 160) -> str:
    """One line, no pipes, at most ``width`` characters (the JSON keeps it whole)."""
    text = " ".join((note or "").split()).replace("|", "/")
    return text if len(text) <= width else text[: width - 1] + "…"


def markdown(rows: list[dict], meta: dict) -> str:
    ref = _reference(rows)
    split = any(len(r.get("cache_bytes") or {}) > 1 for r in rows)
    columns = COLUMNS[:3] + [PLACES] + COLUMNS[3:] if split else COLUMNS
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for r in rows:
        g = r.get
        ratio_b = g("cache_total") / ref["cache_total"] if ref and g("cache_total") is not None and ref["cache_total"] else None
        ratio_d = g("decode_tok_s") / ref["decode_tok_s"] if ref and g("decode_tok_s") else None
        cells = [r["name"], r["kind"], human(g("cache_total")), _fmt(ratio_b, ".3f"), human(g("peak")),
                 _fmt(g("decode_tok_s"), ".1f"), _fmt(ratio_d, ".2f"), _fmt(g("prefill_tok_s"), ".0f"),
                 _fmt(g("ppl_delta"), "+.4f"), _fmt(g("kld"), ".5f"), _fmt(g("top1_agreement"), ".3f"), _fmt(g("greedy_agreement"), ".3f"),
                 _note(g("note"))]
        if split:
            cells.insert(3, ", ".join(f"{k} {human(v)}" for k, v in sorted((g("cache_bytes") or {}).items())) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    head = (f"model {meta.get('model')} on {meta.get('device')} ({meta.get('dtype')}), prompt {meta.get('context')} tokens, "
            f"{meta.get('new_tokens')} decode tokens, timings interleaved over {meta.get('repeats')} rounds; "
            f"perplexity over {meta.get('quality_tokens')} held-out tokens (reference ppl "
            f"{_fmt(meta.get('reference_ppl'), '.4f')}, no cache). cache: bytes held after the run; "
            f"peak decoding: the setup's own peak of tensor memory while decoding (its cache and what a step "
            f"allocates); × against {ref['name'] if ref else '-'}")
    return head + "\n\n" + "\n".join(lines) + "\n"


def _short(name: str) -> str:
    return name.replace("QuantizedCache ", "HF ").replace("DynamicCache", "HF Dynamic")


def plot(rows: list[dict], path: Path, meta: dict | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "decode_tok_s" in r and r.get("ppl") is not None]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    colors = {"tiercache": "tab:blue", "transformers": "tab:orange"}
    worst = max([r["ppl_delta"] for r in ok if r["ppl_delta"] > 0], default=1.0)
    for r in ok:
        size = 60 + 900 * max(0.0, r["ppl_delta"]) / worst  # [60, 960]
        ax.scatter(r["cache_total"] / 2**20, r["decode_tok_s"], s=size, alpha=0.6,
                   color=colors.get(r["kind"], "gray"), edgecolors="black")
        ax.annotate(_short(r["name"]), (r["cache_total"] / 2**20, r["decode_tok_s"]),
                    fontsize=7, xytext=(7, 4), textcoords="offset points")
    ax.set_xscale("log")
    ax.margins(0.2)
    ax.set_xlabel("KV cache size (MiB, log scale)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("memory vs speed (marker area: perplexity increase)")
    ax.grid(alpha=0.3)
    for kind, c in colors.items():
        ax.scatter([], [], color=c, label=kind)
    ax.legend(loc="lower right", fontsize=8)
    names = [_short(r["name"]) for r in ok]
    bx.barh(names, [r["ppl_delta"] for r in ok], color=[colors.get(r["kind"], "gray") for r in ok])
    bx.axvline(0, color="black", lw=0.8)
    bx.invert_yaxis()
    bx.tick_params(axis="y", labelsize=8)
    bx.set_xlabel("perplexity delta vs full precision")
    bx.set_title("quality cost")
    bx.grid(alpha=0.3, axis="x")
    if meta:
        fig.suptitle(f"tiercache bench: {meta.get('model')} on {meta.get('gpu') or meta.get('device')}, "
                     f"prompt {meta.get('context')} tokens, {meta.get('new_tokens')} decode tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(rows: list[dict], meta: dict, out_dir) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / "bench.md", "json": out / "bench.json", "png": out / "bench.png"}
    paths["md"].write_text(markdown(rows, meta))
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    plot(rows, paths["png"], meta)
    return {k: str(v) for k, v in paths.items()}
