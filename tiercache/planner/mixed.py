"""Per-layer key / value formats chosen by measured sensitivity within a byte budget.

Interface
    Sensitivity                     what ``tiercache tune`` measured (``tiercache.tune.calibrate``):
        .layers                     the calibrated layer indices
        .bits                       candidate bits, e.g. (8, 4, 2)
        .keys / .values             ``{layer: {bits: KLD added}}``: the KLD of the next-token
                                    distribution against full precision when only that layer's keys
                                    (values) are quantized at those bits
        .base                       the quantize section the formats share (group size, residual, sinks, axes)
        .variants                   policy-wide choices measured beside the base: ``[{"sink_tokens",
                                    "residual_length", ["meta_bits", "group_size",] "scale": {bits: factor}}]``,
                                    each part's KLD at those bits times ``factor`` (a uniform forward's
                                    ratio to the base's); the fields other than ``scale`` (``VARIANT_FIELDS``)
                                    replace the base's
        .each() -> [Sensitivity]    the base and every variant as a table of its own
        .meta                       where it came from (model, text, context, stretch, seconds)
        .to_json() / Sensitivity.load(path) / .save(path)
    Option(key_bits, value_bits)    one layer's format; ``Option(None, None)`` is full precision
    options(sens) -> [Option]       full precision and every (key bits, value bits) pair
    layer_costs(sens, spec, batch, context, base_policy) -> {Option: [bytes per layer]}
        the planner's bytes of each layer under each option (uniform plans, rows read back)
    frontier(sens, costs, resolution) -> Frontier
        a multiple-choice knapsack over layers (dynamic programming on bytes rounded up to
        ``resolution`` bins): for every byte level the least predicted KLD and the choices
    Frontier.best_within(bytes) / .cheapest_under(kld) -> {layer: Option} | None
    predicted(sens, choice) -> float   the sum of the chosen parts' KLDs (the additive model)
    policy_of(base_policy, sens, choice, name, description) -> Policy   overrides per group of layers
    choose(auto_policy, spec, batch, context) -> Policy | None
        ``auto: true`` with ``calibration:``: the least predicted KLD whose plan fits the device
        budget (None when even the smallest choice does not)

Why additive: a small perturbation of one part adds a KLD that is, to second order, a quadratic
form in that part's error; errors of different layers are independent, so their cross terms
average out and the KLDs add. ``tiercache tune`` measures the chosen policy end to end afterwards
and steps back where the sum was optimistic.

Torch-free (numpy only): the planner's ``auto`` reads a saved sensitivity without a model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from tiercache.errors import PolicyError
from tiercache.policy.schema import Policy

FORMAT_VERSION = 1
VARIANT_FIELDS = ("sink_tokens", "residual_length", "meta_bits", "group_size")  # what a variant may set


class Option(NamedTuple):
    key_bits: int | None
    value_bits: int | None

    @property
    def exact(self) -> bool:
        return self.key_bits is None

    def label(self) -> str:
        return "fp" if self.exact else f"K{self.key_bits}V{self.value_bits}"


FP = Option(None, None)


@dataclass
class Sensitivity:
    layers: tuple[int, ...]
    bits: tuple[int, ...]
    keys: dict[int, dict[int, float]]
    values: dict[int, dict[int, float]]
    base: dict  # a quantize section (QuantizePolicy fields): group_size, residual_length, sink_tokens, axes
    meta: dict = field(default_factory=dict)
    variants: list = field(default_factory=list)  # [{VARIANT_FIELDS..., "scale": {bits: factor}}]

    def each(self) -> list["Sensitivity"]:
        """The base table and one scaled table per variant (its ``base`` the variant's sinks and residual)."""
        out = [Sensitivity(self.layers, self.bits, self.keys, self.values, self.base, self.meta)]
        for v in self.variants:
            f = {int(b): float(x) for b, x in v["scale"].items()}
            scaled = {w: {l: {b: k * f[b] for b, k in d.items()} for l, d in t.items()}
                      for w, t in (("keys", self.keys), ("values", self.values))}
            base = {**self.base, **{k: v[k] for k in VARIANT_FIELDS if k in v}}
            if base != self.base:
                out.append(Sensitivity(self.layers, self.bits, scaled["keys"], scaled["values"], base, self.meta))
        return out

    def to_json(self) -> dict:
        return {"version": FORMAT_VERSION, "layers": list(self.layers), "bits": list(self.bits),
                "keys": {str(l): {str(b): v for b, v in d.items()} for l, d in self.keys.items()},
                "values": {str(l): {str(b): v for b, v in d.items()} for l, d in self.values.items()},
                "base": self.base, "meta": self.meta, "variants": self.variants}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data, where: str = "calibration") -> "Sensitivity":
        try:
            if data.get("version") != FORMAT_VERSION:
                raise PolicyError(f"{where}: version {data.get('version')!r}; this tiercache reads version "
                                  f"{FORMAT_VERSION} (run tiercache tune again to recalibrate)")
            bits = tuple(int(b) for b in data["bits"])
            layers = tuple(int(l) for l in data["layers"])
            parts = {which: {int(l): {int(b): float(v) for b, v in d.items()} for l, d in data[which].items()}
                     for which in ("keys", "values")}
            for which, table in parts.items():
                for l in layers:
                    if set(table.get(l, {})) != set(bits):
                        raise PolicyError(f"{where}: {which} of layer {l} has bits {sorted(table.get(l, {}))}, "
                                          f"expected {sorted(bits)}")
            variants = []
            for v in data.get("variants", []):
                unknown = set(v) - set(VARIANT_FIELDS) - {"scale"}
                if unknown:
                    raise PolicyError(f"{where}: a variant sets {sorted(unknown)}; allowed: {list(VARIANT_FIELDS)}")
                variants.append({**{k: (None if v[k] is None else int(v[k])) for k in VARIANT_FIELDS if k in v},
                                 "scale": {int(b): float(x) for b, x in v["scale"].items()}})
            for v in variants:
                if set(v["scale"]) != set(bits):
                    raise PolicyError(f"{where}: a variant scales bits {sorted(v['scale'])}, expected {sorted(bits)}")
            return cls(layers, bits, parts["keys"], parts["values"], dict(data["base"]), dict(data.get("meta", {})),
                       variants)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"{where}: not a sensitivity file written by tiercache tune ({type(e).__name__}: {e})") from None

    @classmethod
    def load(cls, path) -> "Sensitivity":
        p = Path(path)
        if not p.is_file():
            raise PolicyError(f"calibration file {str(p)!r} does not exist (tiercache tune --calibration FILE writes one)")
        try:
            data = json.loads(p.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PolicyError(f"calibration file {str(p)!r} is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise PolicyError(f"calibration file {str(p)!r}: expected a JSON object")
        return cls.from_json(data, f"calibration file {str(p)!r}")

    def part(self, layer: int, option: Option) -> float:
        if option.exact or layer not in self.keys:
            return 0.0
        return self.keys[layer][option.key_bits] + self.values[layer][option.value_bits]


def options(sens: Sensitivity) -> list[Option]:
    return [FP] + [Option(k, v) for k in sens.bits for v in sens.bits]


def predicted(sens: Sensitivity, choice: dict[int, Option]) -> float:
    return sum(sens.part(l, o) for l, o in choice.items())


def _quantize_section(sens: Sensitivity, option: Option) -> dict | None:
    if option.exact:
        return None
    from tiercache.policy.fields import EXPERIMENTAL, experimental_fields
    from tiercache.policy.schema import QuantizePolicy

    section = {**sens.base, "bits": option.key_bits, "key_bits": option.key_bits, "value_bits": option.value_bits}
    extra = {k: section.pop(k) for k in experimental_fields(QuantizePolicy) if k in section}
    if extra:  # a base written with an experimental field at the top level (older files): its own mapping
        section[EXPERIMENTAL] = {**extra, **section.get(EXPERIMENTAL, {})}
    return section


def policy_of(base: Policy, sens: Sensitivity, choice: dict[int, Option], name: str | None = None,
              description: str | None = None) -> Policy:
    """``base`` (storage, offload, budget kept) with the top-level quantize the most common option
    and one override per other option, naming its layers."""
    data = base.to_dict()
    data.update(auto=False, calibration=None, overrides=[])
    if name is not None:
        data["name"] = name
    if description is not None:
        data["description"] = description
    counts: dict[Option, list[int]] = {}
    for l in sorted(choice):
        counts.setdefault(choice[l], []).append(l)
    top = max(counts, key=lambda o: (len(counts[o]), not o.exact)) if counts else FP
    data["quantize"] = _quantize_section(sens, top)
    data["overrides"] = [{"layers": layers, "quantize": _quantize_section(sens, o)}
                         for o, layers in sorted(counts.items(), key=lambda kv: kv[1][0]) if o != top]
    return Policy.from_dict(data)


def layer_costs(sens: Sensitivity, spec, batch: int, context: int, base: Policy) -> dict[Option, list[int]]:
    """Bytes of each calibrated layer (in ``sens.layers`` order) under each option: one uniform plan
    per option, the layer rows read back (all tiers summed)."""
    from tiercache.planner.concrete import plan_concrete

    out = {}
    for o in options(sens):
        p = plan_concrete(policy_of(base, sens, {l: o for l in sens.layers}), spec, batch, context)
        rows = {r.index: sum(r.bytes.values()) for r in p.layers}
        out[o] = [rows[l] for l in sens.layers]
    return out


@dataclass
class Frontier:
    """The knapsack's table: ``kld[b]`` the least predicted KLD within ``b`` bins of ``unit`` bytes."""

    layers: tuple[int, ...]
    opts: list[Option]
    unit: float
    kld: list[float]  # [bins + 1]
    picks: list[list[int]]  # [layers][bins + 1] option index chosen for that layer at that remaining budget
    costs: list[list[int]]  # [layers][options] bins

    def _walk(self, b: int) -> dict[int, Option]:
        choice = {}
        for i in reversed(range(len(self.layers))):
            o = self.picks[i][b]
            choice[self.layers[i]] = self.opts[o]
            b -= self.costs[i][o]
        return choice

    def best_within(self, nbytes: float) -> dict[int, Option] | None:
        b = min(int(nbytes // self.unit), len(self.kld) - 1)
        if b < 0 or math.isinf(self.kld[b]):
            return None
        return self._walk(b)

    def cheapest_under(self, kld: float) -> dict[int, Option] | None:
        for b, k in enumerate(self.kld):
            if k <= kld:
                return self._walk(b)
        return None


def frontier(sens: Sensitivity, costs: dict[Option, list[int]], resolution: int = 4000,
             allowed: list[Option] | None = None) -> Frontier:
    import numpy as np

    opts = [o for o in (allowed or options(sens)) if o in costs]
    top = sum(max(costs[o][i] for o in opts) for i in range(len(sens.layers)))
    unit = max(top / resolution, 1.0)
    bins = int(math.ceil(top / unit)) + 1
    cost_bins = [[int(math.ceil(costs[o][i] / unit)) for o in opts] for i in range(len(sens.layers))]
    dp = np.zeros(bins + 1)  # least KLD within b bins, no layer placed yet
    picks = []
    for i, l in enumerate(sens.layers):
        best = np.full(bins + 1, np.inf)
        pick = np.zeros(bins + 1, dtype=np.int64)
        for j, o in enumerate(opts):
            c = cost_bins[i][j]
            cand = np.full(bins + 1, np.inf)
            if c <= bins:
                cand[c:] = dp[: bins + 1 - c] + sens.part(l, o)
            better = cand < best
            best[better], pick[better] = cand[better], j
        dp = best
        picks.append(pick.tolist())
    return Frontier(tuple(sens.layers), opts, unit, dp.tolist(), picks, cost_bins)


def choose(auto: Policy, spec, batch: int, context: int) -> Policy | None:
    """The calibrated rung of ``auto``'s ladder: per-layer formats of least predicted KLD whose plan
    fits ``auto.budget.device`` (the cache's bytes on the device, resident); None when none does."""
    from tiercache.planner.concrete import plan_concrete

    sens = Sensitivity.load(auto.calibration)
    n = spec.num_layers
    if any(not 0 <= l < n for l in sens.layers):
        raise PolicyError(f"policy.calibration: {auto.calibration!r} names layers {list(sens.layers)}, but "
                          f"{spec.name} has {n} layers; calibrate on this model (tiercache tune)")
    base = replace(auto, offload=None, auto=False, calibration=None, budget=None)
    best = None
    for table in sens.each():
        found = fit(table, base, spec, batch, context, auto.budget.device, "device")
        if found is not None and (best is None or found[1] < best[1]):
            best = found
    if best is None:
        return None
    p = policy_of(base, best[2], best[0], f"{auto.name}/calibrated",
                  f"per-layer formats by measured sensitivity ({auto.calibration})")
    return replace(p, budget=auto.budget)


def fit(sens: Sensitivity, base: Policy, spec, batch: int, context: int, limit: int, tier: str | None = None,
        table: Frontier | None = None):
    """``(choice, predicted KLD, sens)`` of least predicted KLD whose plan holds at most ``limit``
    bytes (on ``tier``, or all tiers summed when None); None when even the smallest does not."""
    from tiercache.planner.concrete import plan_concrete

    table = table or frontier(sens, layer_costs(sens, spec, batch, context, base))

    def used(choice) -> int:
        p = plan_concrete(policy_of(base, sens, choice), spec, batch, context)
        return p.bytes[tier] if tier else sum(p.bytes.values())

    room = limit - _fixed(base, sens, spec, batch, context)
    for _ in range(8):  # the layers' sum misses the shared workspace and rounding: shrink by what the plan is over
        choice = table.best_within(room)
        if choice is None:
            break
        over = used(choice) - limit
        if over <= 0:
            return choice, predicted(sens, choice), sens
        room -= over
    # the table rounds each layer's bytes up to a bin: a budget of exactly the smallest choice falls
    # between bins, so that choice is checked by the planner itself
    smallest = {l: Option(min(sens.bits), min(sens.bits)) for l in sens.layers}
    if used(smallest) <= limit:
        return smallest, predicted(sens, smallest), sens
    return None


def _fixed(base: Policy, sens: Sensitivity, spec, batch: int, context: int) -> int:
    """Bytes outside the calibrated layers' rows: the shared workspace, uncalibrated layers (at the
    smallest option, a lower bound)."""
    from tiercache.planner.concrete import plan_concrete

    small = Option(min(sens.bits), min(sens.bits))
    p = plan_concrete(policy_of(base, sens, {l: small for l in sens.layers}), spec, batch, context)
    rows = sum(sum(r.bytes.values()) for r in p.layers if r.index in sens.layers)
    return sum(p.bytes.values()) - rows
