"""The real-model quality summary: several benchmark runs merged into one table and one plot.

The perplexity and retrieval figures of the README come from many runs (one process per few
setups on a 2-core CPU). This module merges their JSON outputs, checking that they measured the
same thing, and puts every setup on one axis of memory: bits per element of the quantized
history, metadata included, at the model's bf16 (what transformers' caches store).

Interface
- ``bits_per_element(build, model, dtype_bytes=2) -> float``: ``build`` is a setup's build spec
  (``realbench.SETUPS[name][1]`` / ``retrievalbench.SETUPS[name]``: a baseline name, a YAML file
  under ``configs/`` or a ``quantize`` mapping), ``model`` a ``ModelSpec``: the mean over layers of
  the K and V bits per element beyond the residual, over the layers that hold K/V (16 for full
  precision; a quanto baseline's bits plus its scale and zero point per group of 64).
- ``merge_perplexity(runs) -> (meta, {name: row})``: ``runs`` are ``bench_real.py`` outputs
  (``real.json`` dicts) with ``--texts-per-kind``; every run must have the same model, prompt,
  scored tokens and texts, and the same full-precision perplexity per kind (the same windows);
  a setup in two runs is refused (say which run to keep). ``ValueError`` names what differs.
- ``merge_retrieval(runs) -> {name: {(format, seed, samples, context): (found, asked)}}``:
  ``bench_retrieval.py`` outputs (``retrieval.json``); runs of the same samples must agree on full
  precision's count; a setup measured twice on the same samples is refused.
- ``summary_rows(ppl_rows, retrieval, bits) -> list[dict]``: per setup (perplexity setups first,
  then retrieval-only ones): ``bits``, per kind ``mean`` / ``lo`` / ``hi`` (%), and ``found`` /
  ``asked`` / ``delta`` (points vs full precision over the same samples) where measured.
- ``markdown(rows, meta) -> str``; ``plot(rows, meta, path)``: quality vs bits per element
  (each kind's mean with its 90% interval; full precision is the zero line; 4-bit and 2-bit
  setups in panels of their own scale) and retrieval accuracy per setup (the contexts a setup
  was not run at are named).
"""

from __future__ import annotations

from tiercache.bench import setups

REFERENCE = "DynamicCache"
_QUANTO_GROUP = 64  # setups._quantized: q_group_size=64, a scale and a zero point per group in the dtype
SPLIT_BITS = 3.5  # the plot's quality panels: the 4-bit setups apart from the 2-bit ones (each its own scale)


def bits_per_element(build, model, dtype_bytes: int = 2) -> float:
    from tiercache.planner.footprint import row_bytes

    if isinstance(build, str) and build in setups.BASELINES:
        if build.startswith("dynamic"):
            return 8.0 * dtype_bytes
        bits = int(build.rsplit("int", 1)[1])
        return bits + 2 * 8 * dtype_bytes / _QUANTO_GROUP
    total, layers = 0.0, 0
    for lp in setups.policy_of(build).resolve(model):
        if model.kv_sharing(lp.index) == "reuse":  # reads another layer's K/V: holds none
            continue
        layers += 1
        _, key_dim, value_dim = model.kv_shape(lp.index)
        q = lp.quantize
        if q is None:
            total += 8.0 * dtype_bytes
            continue
        row = row_bytes(q, key_dim, "keys", dtype_bytes) + row_bytes(q, value_dim, "values", dtype_bytes)
        total += 8.0 * row / (q.group_size * (key_dim + value_dim))
    return total / layers


def merge_perplexity(runs: list[dict]) -> tuple[dict, dict]:
    if not runs:
        raise ValueError("merge_perplexity: no runs given")
    first = runs[0]["meta"]
    keys = ("model", "prompt", "tokens", "texts_per_kind")
    rows: dict[str, dict] = {}
    ref: dict[str, float] = {}
    texts: list[str] = []
    for i, run in enumerate(runs):
        meta = run["meta"]
        differ = [k for k in keys if meta.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"run {i} differs from run 0 in {', '.join(differ)}: "
                             f"{[meta.get(k) for k in differ]} vs {[first.get(k) for k in differ]}")
        named = {r["name"]: r for r in run["rows"]}
        if REFERENCE not in named:
            raise ValueError(f"run {i} has no {REFERENCE} row: its deltas have no reference to be checked against")
        for kind, value in named[REFERENCE]["ppl"].items():
            if kind in ref and abs(value - ref[kind]) > 1e-6 * ref[kind]:
                raise ValueError(f"run {i}: full-precision {kind} perplexity {value:.6f} != {ref[kind]:.6f} of an "
                                 "earlier run: not the same texts")
            ref.setdefault(kind, value)
            if kind not in texts:
                texts.append(kind)
        for name, row in named.items():
            if name == REFERENCE:
                rows.setdefault(name, row)
                continue
            if name in rows:
                raise ValueError(f"setup {name!r} is in two runs (run {i} and an earlier one): give the one to keep")
            rows[name] = row
    return {**first, "texts": texts, "runs": len(runs)}, rows


def merge_retrieval(runs: list[dict]) -> dict:
    counts: dict[str, dict] = {}
    for i, run in enumerate(runs):
        meta = run["meta"]
        seed = meta["seed"]
        for row in run["rows"]:
            for context, (found, asked) in row["by_length"].items():
                at = (meta.get("format", "passkey"), seed, meta.get("samples"), int(context))  # the same samples
                held = counts.setdefault(row["name"], {})
                if at in held:
                    if row["name"] == REFERENCE and held[at] == (found, asked):
                        continue
                    what = "disagrees with" if row["name"] == REFERENCE else "repeats"
                    raise ValueError(f"run {i}: {row['name']} at seed {seed}, context {context} {what} an earlier "
                                     f"run ({found}/{asked} vs {held[at][0]}/{held[at][1]})")
                held[at] = (int(found), int(asked))
    return counts


def summary_rows(ppl_rows: dict, retrieval: dict, bits: dict) -> list[dict]:
    names = list(ppl_rows) + [n for n in retrieval if n not in ppl_rows]
    ref = retrieval.get(REFERENCE, {})
    out = []
    for name in names:
        row: dict = {"name": name, "bits": bits.get(name)}
        spread = (ppl_rows.get(name) or {}).get("ppl_spread") or {}
        for kind, s in spread.items():
            row[kind] = {k: 100 * s[k] for k in ("mean", "lo", "hi")}
        samples = retrieval.get(name, {})
        if samples:
            shared = [at for at in samples if at in ref]
            row["found"] = sum(samples[at][0] for at in samples)
            row["asked"] = sum(samples[at][1] for at in samples)
            row["contexts"] = sorted({at[-1] for at in samples})
            if shared:
                mine = sum(samples[at][0] for at in shared) / sum(samples[at][1] for at in shared)
                theirs = sum(ref[at][0] for at in shared) / sum(ref[at][1] for at in shared)
                row["delta"] = 100 * (mine - theirs)
        out.append(row)
    return out


def _interval(cell: dict | None) -> str:
    if not cell:
        return "–"
    return f"{cell['mean']:+.2f}% [{cell['lo']:+.2f}, {cell['hi']:+.2f}]"


def markdown(rows: list[dict], meta: dict) -> str:
    kinds = meta.get("texts", [])
    head = ["setup", "bits / element"] + [f"{k}: Δ mean [90%]" for k in kinds] + ["pass keys found", "Δ vs full precision"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        bits = "–" if r["bits"] is None else f"{r['bits']:.2f}"
        found = f"{r['found']}/{r['asked']}" if "found" in r else "–"
        delta = f"{r['delta']:+.1f}" if "delta" in r else "–"
        lines.append("| " + " | ".join([r["name"], bits] + [_interval(r.get(k)) for k in kinds] + [found, delta]) + " |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], meta: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = meta.get("texts", [])
    pts = [r for r in rows if r["name"] != REFERENCE and r["bits"] is not None and any(r.get(k) for k in kinds)]
    panels = [p for p in ([r for r in pts if r["bits"] >= SPLIT_BITS], [r for r in pts if r["bits"] < SPLIT_BITS]) if p]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(6 * len(panels) + 6, 5.5))
    for a, group in zip(axes, panels):
        for c, r in enumerate(group):
            for i, kind in enumerate(k for k in kinds if r.get(k)):
                cell = r[kind]
                x = r["bits"] + (i - (len(kinds) - 1) / 2) * 0.012 + (c - (len(group) - 1) / 2) * 0.006
                a.errorbar([x], [cell["mean"]], yerr=[[cell["mean"] - cell["lo"]], [cell["hi"] - cell["mean"]]],
                           fmt="o^sv"[i % 4], color=f"C{c % 10}", ms=5, capsize=2, lw=0.8,
                           label=f"{r['name']} ({r['bits']:.2f} b)" if i == 0 else None)
        a.axhline(0, color="grey", lw=0.6)
        a.set_xlabel("bits per element beyond the residual (codes + scales and offsets, bf16)")
        a.set_ylabel(f"perplexity increase vs full precision, % ({meta.get('tokens')} tokens per text)")
        a.legend(fontsize=7, loc="best")
        a.set_title(f"{' / '.join(f'{m} {k}' for m, k in zip('o^sv', kinds))}: mean over texts, 90% interval",
                    fontsize=9)
    fig.suptitle(f"{meta.get('model', '')}: {meta.get('texts_per_kind')} held-out texts per kind, "
                 f"{meta.get('prompt')}-token prompt; full precision = 0 (16 bits)", fontsize=10)
    b = axes[-1]
    ret = [r for r in rows if "found" in r]
    every = sorted({c for r in ret for c in r["contexts"]})
    labels = [r["name"] + ("" if r["bits"] is None else f" ({r['bits']:.2f} b)")
              + ("" if r["contexts"] == every else f", {min(r['contexts'])}-{max(r['contexts'])} only") for r in ret]
    b.barh(labels, [100 * r["found"] / r["asked"] for r in ret], color=["grey" if r["name"] == REFERENCE else "C0" for r in ret])
    for y, r in enumerate(ret):
        b.annotate(f"{r['found']}/{r['asked']}", (100 * r["found"] / r["asked"], y), fontsize=7, xytext=(3, -3),
                   textcoords="offset points")
    b.invert_yaxis()
    b.set_xlim(0, 110)
    b.set_xlabel(f"pass keys found, % (contexts {', '.join(map(str, every))} tokens)")
    b.tick_params(axis="y", labelsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
