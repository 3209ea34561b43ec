"""What tune writes: the policy YAML with its header, the frontier table (markdown, JSON) and plot (PNG).

Interface
    policy_yaml(policy, header_lines) -> str   YAML that ``tiercache.load_policy`` reads back to an
                                               equal policy; ``header_lines`` become ``#`` comments
    header(model, source, context, batch, request, point, seconds) -> [str]
        the model, the text, the context and batch, the request (budget or KLD bound) and the
        measured figures of the chosen point (on text the calibration did not see)
    table(points, reference=None) -> str       markdown: one row per point, bytes x against ``reference``
    plot(points, path, title)                  bytes vs measured KLD (log), uniform and tuned apart
    write_frontier(points, out_stem, meta) -> {"md", "json", "png"}   (png None without matplotlib)
"""

from __future__ import annotations

import json
from pathlib import Path

from tiercache.planner.units import human
from tiercache.policy.schema import Policy


def _section(q: dict | None, top: dict | None = None) -> dict | None:
    if q is None:
        return None
    if top is None:  # the top-level section: every field but the unset optional ones
        return {k: v for k, v in q.items() if v is not None}
    return {k: v for k, v in q.items() if top.get(k) != v}  # an override: what differs (merged over the top)


def policy_yaml(policy: Policy, header_lines: list[str]) -> str:
    import yaml

    data = policy.to_dict()
    top = data.get("quantize")
    out = {k: v for k, v in data.items() if v is not None and v != [] and v != () and k not in ("auto",)}
    out.pop("overrides", None)
    if top is not None:
        out["quantize"] = _section(top)
    overrides = []
    for o in data.get("overrides") or []:
        o = dict(o)
        entry = {k: v for k, v in o.items() if k in ("layers", "layer_type") and v is not None}
        if "quantize" in o:
            entry["quantize"] = _section(o["quantize"], top) if o["quantize"] is not None else None
        overrides.append(entry)
    if overrides:
        out["overrides"] = overrides
    body = yaml.safe_dump(out, sort_keys=False, default_flow_style=None, width=110)
    head = "".join(f"# {line}\n" for line in header_lines)
    return head + body


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def figures_text(f) -> str:
    return (f"KLD {f.kld:.5f} (p99 {f.kld_p99:.4f}), perplexity {f.ppl:.4f} vs {f.ppl_ref:.4f} ({_pct(f.ppl_change)}), "
            f"top-1 {f.top1:.3f}, pass key {f.passkey_text()}")


def header(model: str, source: str, context: int, batch: int, request: str, point, seconds: float | None) -> list[str]:
    lines = [f"written by tiercache tune for model {model}, context {context}, batch {batch}, {request}",
             f"text: {source}",
             f"cache bytes (tiercache plan, all tiers): {point.bytes} ({human(point.bytes)}); kind: {point.kind}"]
    if point.figures is not None:
        lines.append("measured on text the calibration did not see: " + figures_text(point.figures))
    if point.predicted is not None:
        lines.append(f"predicted KLD (sum of per-layer sensitivities): {point.predicted:.5f}")
    if seconds is not None:
        lines.append(f"tune took {seconds:.0f} s")
    lines.append("check it again: tiercache check THIS_FILE --model " + model)
    return lines


def table(points, reference=None) -> str:
    ref = reference.bytes if reference is not None else None
    lines = ["| policy | kind | cache bytes | x bytes | predicted KLD | KLD | KLD p99 | ppl change | top-1 | pass key |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        f = p.figures
        cells = [p.name, p.kind, human(p.bytes), f"{p.bytes / ref:.3f}" if ref else "-",
                 "-" if p.predicted is None else f"{p.predicted:.5f}",
                 "-" if f is None else f"{f.kld:.5f}", "-" if f is None else f"{f.kld_p99:.4f}",
                 "-" if f is None else _pct(f.ppl_change), "-" if f is None else f"{f.top1:.3f}",
                 "-" if f is None else f.passkey_text()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(points, path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    colors = {"uniform": "tab:orange", "tuned": "tab:blue"}
    for kind, color in colors.items():
        pts = sorted((p for p in points if p.kind == kind and p.figures is not None), key=lambda p: p.bytes)
        if not pts:
            continue
        xs = [p.bytes / 2**20 for p in pts]
        ys = [max(p.figures.kld, 1e-7) for p in pts]
        ax.plot(xs, ys, "o-" if kind == "tuned" else "s--", color=color, label=kind, alpha=0.85)
        for p, x, y in zip(pts, xs, ys):
            ax.annotate(p.name, (x, y), fontsize=7, xytext=(5, 4), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("cache bytes (MiB, tiercache plan)")
    ax.set_ylabel("KLD vs full precision (nats, log)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_frontier(points, out_stem, meta: dict, reference=None) -> dict:
    stem = Path(out_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    paths = {ext: Path(f"{stem}.{ext}") for ext in ("md", "json", "png")}
    paths["md"].write_text(table(points, reference))
    rows = [{"name": p.name, "kind": p.kind, "bytes": p.bytes, "predicted": p.predicted,
             **(p.figures.row() if p.figures is not None else {})} for p in points]
    paths["json"].write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    try:
        plot(points, paths["png"], meta.get("title", "tiercache tune: bytes vs KLD"))
    except ImportError:  # matplotlib is the bench extra's: the table and JSON are written without it
        paths["png"] = None
    return {k: (str(v) if v is not None else None) for k, v in paths.items()}

