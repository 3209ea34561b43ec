"""Render a Plan as text: layers grouped by identical rows, totals per tier, budget verdicts.

Interface: ``render(plan) -> str`` (``Plan.table()`` calls it). Consecutive layers with the same
form, place and bytes share one row (``0-31``), so an 80-layer model stays readable; an
encoder-decoder plan lists its cross-attention layers after the self-attention ones; a hybrid
model's conv / recurrent states have their own line (device, exact, context-independent), or a
note saying why they are not predicted. A stated card (``Plan.card``) gets its own line after
the budget's: the whole footprint's device total against it. For an auto
policy the candidate ladder comes first: every rung with its bytes and why it was chosen or not.
"""

from __future__ import annotations

from tiercache.planner.footprint import TIERS


def render(plan) -> str:
    from tiercache.planner.units import human

    p, spec = plan, plan.model
    head = p.requested or p.policy
    lines = [f"policy {head.name}" + (f": {head.description}" if head.description else "")]
    lines.append(
        f"model {spec.name}: {spec.num_layers} layers, {spec.describe()}, {spec.dtype}"
        f" | batch {p.batch_size} | context {p.context_length} tokens"
        + (f" | encoder {p.encoder_length} tokens" if p.encoder_length is not None else "")
    )
    if p.rungs is not None:
        lines += ["", "auto ladder (least lossy first; the first rung that fits is chosen):"]
        lines += _grid(["#", "rung", "device", "host", "disk", "workspace", "verdict"],
                       [[str(i + 1), r.name, *_rung_bytes(r, human), r.verdict] for i, r in enumerate(p.rungs)])
        lines += ["", f"chosen: {p.policy.name}"]
    lines.append("")
    rows = [[_indices([r.index for r in g]), str(len(g)), g[0].layer_type, g[0].form, g[0].place, str(g[0].tokens),
             *(human(sum(r.bytes[t] for r in g)) for t in TIERS)] for g in _groups(p.layers + p.cross_layers)]
    if p.mirrors:
        rows.append(["", "", "offload mirrors", "device copies of prefetch+1 layers", "device", "",
                     human(p.mirrors), "", ""])
    if p.workspace:
        rows.append(["", "", "workspace", "shared: one decode step dequantized", "device", "", human(p.workspace), "", ""])
    states = getattr(p, "states", None)
    if states is not None:
        rows.append(_states_row(p, states, human))
    total = [human(p.bytes[t]) for t in TIERS]
    if states is not None and states.unknown is not None:
        total[0] += " + states (not predicted)"
    side = _side_state_layers(spec)
    if side:
        total[0] += " + side states (not planned)"
    rows.append(["", str(len(p.layers) + len(p.cross_layers)), "total held", "", "", "", *total])
    lines += _grid(["layers", "n", "type", "form", "history", "tokens", "device", "host", "disk"], rows)
    lines.append("")
    if states is not None and states.unknown is not None:
        lines.append(f"note: the conv / recurrent states are not predicted ({states.unknown}); the device total "
                     "and the budget verdicts leave them out")
    if side:
        lines.append(f"note: layers {_indices(side)} keep a side state beside their K/V (indexer keys of sparse "
                     "attention, DeepSeek-V4's compressor state: exact, on the device); the plan does not count it, "
                     "a built cache's nbytes() does")
    if spec.cross_attention and p.encoder_length is None:
        lines.append("note: an encoder-decoder model; its cross-attention K/V are not counted: give --encoder-length "
                     "(plan(..., encoder_length=N))")
    if p.whole is not None:
        lines += _whole(p, human) + [""]
    verdicts = p.verdicts()
    for tier, (used, limit, ok) in verdicts.items():
        if p.scope == "total":
            extra = " (whole run: every line above)"
        else:
            extra = f" (workspace {human(p.workspace)} included)" if tier == "device" and p.workspace else ""
            extra += " (the cache alone: budget.scope is cache)" if p.whole is not None else ""
        lines.append(f"budget {tier}: {human(used)}{extra} of {human(limit)}: {'fits' if ok else 'DOES NOT FIT'}")
    card = p.card_verdict()
    if card is not None:
        from tiercache.planner.units import card_text

        lines.append(f"card: whole footprint device {human(card.used)} on a card of {card_text(card.card)}: "
                     + ("fits" if card.fits else "DOES NOT FIT") + (f" ({card.note})" if card.note else
                     f" ({human(card.card - card.used)} to spare)" if card.fits else ""))
    elif p.card is not None:
        lines.append(f"card: not checked (a {p.whole.device if p.whole is not None else 'cache-only'} plan; "
                     "a GPU's memory applies to a cuda run)")
    lines += [f"problem: {msg}" for msg in p.problems]
    if not verdicts and not p.problems and card is None:
        lines.append("no budget given: nothing to check")
    lines.append(f"verdict: {'fits' if p.fits else 'does not fit'}")
    return "\n".join(lines)


def _whole(p, human) -> list[str]:
    w = p.whole
    out = [f"whole footprint on {w.device} (prefill in chunks of {p.prefill_chunk} tokens):"]
    rows = [[x.name, x.tier, human(x.bytes), x.note] for x in w.lines]
    total = w.total
    rows.append(["total", "", ", ".join(f"{t} {human(total[t])}" for t in TIERS if total[t]), ""])
    return out + _grid(["line", "tier", "bytes", "note"], rows)


def _side_state_layers(spec) -> list[int]:
    """Layers whose side state (``tiercache.cache.side_state``) the plan does not count."""
    from tiercache.models.spec import SIDE_STATE_TYPES

    return [i for i, t in enumerate(spec.layer_types) if t in SIDE_STATE_TYPES]


def _states_row(p, states, human) -> list[str]:
    """The conv / recurrent states line: device bytes, exact, the same at any context."""
    n = str(sum(1 for i in range(p.model.num_layers) if p.model.states(i)))
    if states.unknown is not None:
        return ["", n, "conv / recurrent states", "exact, fixed size: NOT PREDICTED (see note)", "device", "",
                "not predicted", "", ""]
    if states.elsewhere is not None:
        return ["", n, "conv / recurrent states", "kept by the model, not the cache", "device", "", human(0), "", ""]
    return ["", n, "conv / recurrent states", "exact, fixed size (any context)", "device", "", human(p.state_bytes),
            "", ""]


def _rung_bytes(rung, human) -> list[str]:
    if rung.plan is None:
        return ["-"] * (len(TIERS) + 1)
    return [*(human(rung.plan.bytes[t]) for t in TIERS), human(rung.plan.workspace)]


def _groups(rows):
    """Layers with identical type, form, place, tokens and bytes, in order of first appearance."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.layer_type, r.form, r.place, r.tokens, tuple(sorted(r.bytes.items()))), []).append(r)
    return list(groups.values())


def _indices(idx: list[int]) -> str:
    """``0-31``, ``0-40/2`` (every second), or a comma list."""
    if len(idx) <= 2:
        return ",".join(map(str, idx))
    step = idx[1] - idx[0]
    if all(b - a == step for a, b in zip(idx, idx[1:])):
        return f"{idx[0]}-{idx[-1]}" + (f"/{step}" if step > 1 else "")
    return ",".join(map(str, idx))


def _grid(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    right = {"device", "host", "disk", "tokens", "workspace", "n", "bytes"}
    fmt = lambda cells: "  ".join(  # noqa: E731
        (c.rjust(w) if h in right else c.ljust(w)) for c, w, h in zip(cells, widths, header)).rstrip()
    return [fmt(header), *(fmt(r) for r in rows)]
