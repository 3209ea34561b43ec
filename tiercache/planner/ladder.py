"""The auto candidate ladder: ``auto: true`` + ``budget`` -> the least lossy policy that fits.

Interface
    RUNGS                       the ladder, least lossy (and fastest) first
    candidates(policy) -> [(name, Policy | PolicyError)]
    walk(policy, spec, batch, context, encoder_length=None, run=None, states=None) -> Plan
        the chosen rung's Plan, with ``.rungs`` (``states``: the model's conv / recurrent states)

The ladder (each rung costs more quality or more speed than the one before):

    1 fp-resident        full precision on the device                  lossless, fastest
    2 fp-host            full precision, offloaded to host memory      lossless, bus bound
    3 int8-resident      8-bit, K per channel / V per token (KIVI)
    4 int8-host          8-bit, offloaded
    5 int4-kivi-resident 4-bit KIVI
    6 int4-kivi-host     4-bit KIVI, offloaded (compressed blocks cross the bus)
    7 int2-kivi-resident 2-bit KIVI
    8 int2-kivi-host     2-bit KIVI, offloaded
    9 int4-kivi-disk     4-bit KIVI, memory-mapped files on disk
   10 int2-kivi-disk     2-bit KIVI on disk: the smallest footprint

With ``calibration: FILE`` (the sensitivity ``tiercache tune`` saved), a rung
``calibrated-resident`` follows the two lossless ones: the per-layer key / value formats of least
predicted KLD whose plan fits ``budget.device`` (``tiercache.planner.mixed.choose``). Every uniform
resident rung is one of its choices, so where it fits it is never predicted worse than them.

Each rung starts from the auto policy: its storage, max_length, overrides and budget are kept;
its ``quantize`` section (if any) is the template for group_size, residual_length and backend,
its ``offload`` section for prefetch, pin_memory and path. A rung the backend cannot do (e.g.
quanto at 8 bits) is rejected with the backend's reason. The walk stops at the first rung
whose plan fits every budgeted tier (with ``budget.scope: total``, the whole footprint at the
largest prefill chunk that fits, ``tiercache.planner.run``) and, on a CUDA run, the card
(``budget.gpu_memory`` or ``plan(..., gpu_memory=)``: the whole footprint's device total); if none fits, the Plan is the rung with the smallest
device bytes (then smallest total), with ``fits`` False.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiercache.errors import PolicyError
from tiercache.policy.fields import to_plain
from tiercache.policy.schema import OffloadPolicy, Policy, QuantizePolicy

# name, bits (None: full precision), offload device (None: resident)
RUNGS: tuple[tuple[str, int | None, str | None], ...] = (
    ("fp-resident", None, None),
    ("fp-host", None, "cpu"),
    ("int8-resident", 8, None),
    ("int8-host", 8, "cpu"),
    ("int4-kivi-resident", 4, None),
    ("int4-kivi-host", 4, "cpu"),
    ("int2-kivi-resident", 2, None),
    ("int2-kivi-host", 2, "cpu"),
    ("int4-kivi-disk", 4, "disk"),
    ("int2-kivi-disk", 2, "disk"),
)
CALIBRATED = "calibrated-resident"  # with ``calibration:``: per-layer formats by measured sensitivity (planner.mixed)


@dataclass
class Rung:
    name: str
    policy: Policy | None
    plan: object | None  # tiercache.planner.api.Plan
    verdict: str


def _rung_policy(auto: Policy, name: str, bits: int | None, where: str | None) -> Policy:
    data = auto.to_dict()
    data.update(name=f"{auto.name}/{name}", auto=False, calibration=None)
    if bits is None:
        data["quantize"] = None
    else:
        base = auto.quantize or QuantizePolicy()
        data["quantize"] = {**to_plain(base), "bits": bits, "format": "int", "key_bits": None, "value_bits": None,
                            "key_axis": "channel", "value_axis": "token"}
    if where is None:
        data["offload"] = None
    else:
        base_o = auto.offload or OffloadPolicy()
        data["offload"] = {**base_o.__dict__, "device": where,
                           "path": base_o.path if where == "disk" else None}
    return Policy.from_dict(data)


def candidates(auto: Policy, spec=None, batch: int = 1, context: int = 4096) -> list[tuple[str, "Policy | PolicyError | None"]]:
    """The rungs' policies (a PolicyError for a rung the backend cannot do). With ``calibration``
    (and ``spec``), the ``CALIBRATED`` rung follows the lossless ones: None there when no per-layer
    choice fits the device budget."""
    out = []
    for name, bits, where in RUNGS:
        try:
            out.append((name, _rung_policy(auto, name, bits, where)))
        except PolicyError as e:
            out.append((name, e))
        if name == "fp-host" and auto.calibration is not None and spec is not None:
            from tiercache.planner.mixed import choose

            out.append((CALIBRATED, choose(auto, spec, batch, context)))
    return out


def walk(auto: Policy, spec, batch: int, context: int, encoder_length: int | None = None, run=None, states=None):
    from tiercache.planner.concrete import plan_concrete
    from tiercache.planner.units import human

    rungs: list[Rung] = []
    chosen = None
    for name, cand in candidates(auto, spec, batch, context):
        if cand is None:
            rungs.append(Rung(name, None, None, "rejected: no per-layer choice of the calibration fits the device budget"))
            continue
        if isinstance(cand, PolicyError):
            rungs.append(Rung(name, None, None, f"rejected: {cand}"))
            continue
        p = plan_concrete(cand, spec, batch, context, encoder_length, states=states)
        p.requested = auto
        if run is not None:  # the budget is known now: choose the prefill chunk against it
            run.attach(p)
        if chosen is not None:
            verdict = "not needed (a less lossy rung fits)"
        elif p.fits:
            chosen, verdict = p, "CHOSEN: least lossy that fits"
        else:
            over = [f"{t} {human(u)} > {human(lim)}" for t, (u, lim, ok) in p.verdicts().items() if not ok]
            card = p.card_verdict()
            if card is not None and not card.fits:
                over.append(card.note or f"whole run {human(card.used)} > card {human(card.card)}")
            verdict = "rejected: " + ", ".join(over + p.problems)
        rungs.append(Rung(name, cand, p, verdict))
    planned = [r for r in rungs if r.plan is not None]
    if not planned:
        raise PolicyError(f"policy: no rung of the auto ladder is valid: {rungs[0].verdict}")
    if chosen is None:
        best = min(planned, key=lambda r: (r.plan.bytes["device"], sum(r.plan.bytes.values())))
        best.verdict += " | smallest reachable footprint"
        chosen = best.plan
    result = replace(chosen, rungs=rungs, requested=auto)
    return result
