"""The search: per-layer (key bits, value bits), sinks and residual within a byte budget, then
verified end to end and stepped back toward more bits where a measured figure misses its bound.

Interface
    Point                                     one policy on the frontier: name, kind (uniform | tuned),
                                              policy, bytes (the planner's, all tiers), predicted KLD,
                                              figures (measured, ``metrics.Figures``) once verified
    uniform(bits, spec, batch, context, base) -> Point   native KIVI at ``bits``: groups of 64,
                                              residual 128, no sinks (the ladder's rungs, ``configs/int*-kivi.yaml``)
    propose(sens, spec, batch, context, base, budget=None, max_kld=None) -> Point | None
        the least predicted KLD within ``budget`` bytes, or the fewest bytes whose predicted KLD is
        at most ``max_kld``, over the base table and every sinks / residual variant
        (``tiercache.planner.mixed``); None when nothing fits / reaches it
    search(sens, spec, batch, context, base, measure, budget=None, max_kld=None, uniforms=(), steps=3)
        -> (chosen Point, [every Point tried])
        ``measure(policy) -> Figures``. Proposes, measures, and while the measured KLD is over
        ``max_kld`` (or pass-key retrieval finds fewer keys than full precision) asks again with
        the predicted target lowered by the miss (``max_kld`` mode: more bytes; within a budget
        there are no more bytes to give, so the miss is reported). The chosen point is the best
        measured one that meets the request, uniform formats (already measured) included, so a
        tuned policy is never returned where a uniform one of no more bytes measured better.

Budgets are ``tiercache.plan``'s bytes of the cache (``.bytes`` summed over tiers, what
``cache.nbytes()`` reports once ``context`` tokens are held, shared workspace included).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tiercache.planner import mixed
from tiercache.planner.concrete import plan_concrete
from tiercache.policy.schema import Policy

UNIFORM_BITS = (8, 4, 2)


@dataclass
class Point:
    name: str
    kind: str
    policy: Policy
    bytes: int
    predicted: float | None = None
    figures: object | None = None  # metrics.Figures
    choice: dict | None = None  # {layer: mixed.Option}
    base: dict | None = None  # the quantize section the choice shares (sinks, residual)

    def meets(self, max_kld: float | None) -> bool:
        f = self.figures
        if f is None:
            return False
        ok_kld = max_kld is None or f.kld <= max_kld
        ok_key = f.passkey is None or f.passkey[0] >= f.passkey_ref[0]
        return ok_kld and ok_key


def cache_bytes(policy: Policy, spec, batch: int, context: int) -> int:
    return int(sum(plan_concrete(policy, spec, batch, context).bytes.values()))


def uniform(bits: int, spec, batch: int, context: int, base: Policy) -> Point:
    from tiercache.tune.calibrate import DEFAULT_BASE

    data = base.to_dict()
    data.update(name=f"uniform-int{bits}", description=f"int{bits} KIVI, groups of 64, residual 128",
                quantize={**DEFAULT_BASE, "bits": bits}, overrides=[], auto=False, calibration=None)
    p = Policy.from_dict(data)
    return Point(p.name, "uniform", p, cache_bytes(p, spec, batch, context))


def propose(sens: mixed.Sensitivity, spec, batch: int, context: int, base: Policy, budget: int | None = None,
            max_kld: float | None = None, name: str = "tuned") -> Point | None:
    if (budget is None) == (max_kld is None):
        raise ValueError("propose: give exactly one of budget and max_kld")
    best = None
    for table in sens.each():
        costs = mixed.layer_costs(table, spec, batch, context, base)
        front = mixed.frontier(table, costs)
        if budget is not None:
            found = mixed.fit(table, base, spec, batch, context, budget, table=front)
            if found is None:
                continue
            choice, pred, _ = found
        else:
            choice = front.cheapest_under(max_kld)
            if choice is None:
                continue
            pred = mixed.predicted(table, choice)
        policy = mixed.policy_of(base, table, choice, name)
        point = Point(name, "tuned", policy, cache_bytes(policy, spec, batch, context), pred, None, choice, table.base)
        key = (point.predicted, point.bytes) if budget is not None else (point.bytes, point.predicted)
        if best is None or key < ((best.predicted, best.bytes) if budget is not None else (best.bytes, best.predicted)):
            best = point
    return best


def search(sens, spec, batch: int, context: int, base: Policy, measure, budget: int | None = None,
           max_kld: float | None = None, uniforms=(), steps: int = 3, name: str = "tuned"):
    tried = []
    target = max_kld
    point = propose(sens, spec, batch, context, base, budget=budget, max_kld=target, name=name)
    for step in range(steps):
        if point is None:
            break
        point.figures = measure(point.policy)
        tried.append(point)
        if point.meets(max_kld) or budget is not None and max_kld is None:
            break
        if budget is not None:  # the best within the budget misses the bound: nothing more to give
            break
        f = point.figures
        ratio = min(max_kld / f.kld if f.kld > 0 else 1.0, 0.9)
        if f.passkey is not None and f.passkey[0] < f.passkey_ref[0]:
            ratio = min(ratio, 0.5)
        target = (point.predicted or target) * ratio
        point = propose(sens, spec, batch, context, base, max_kld=target, name=f"{name}-step{step + 1}")
    pool = tried + [u for u in uniforms if u.figures is not None and (budget is None or u.bytes <= budget)]
    if budget is not None:
        meeting = [p for p in pool if p.meets(max_kld)] or pool
        chosen = min(meeting, key=lambda p: (p.figures.kld, p.bytes)) if meeting else None
    else:
        meeting = [p for p in pool if p.meets(max_kld)]
        chosen = min(meeting, key=lambda p: (p.bytes, p.figures.kld)) if meeting else (
            min(pool, key=lambda p: p.figures.kld) if pool else None)
    if chosen is not None and chosen.kind == "uniform":
        chosen = replace(chosen)
    return chosen, tried
