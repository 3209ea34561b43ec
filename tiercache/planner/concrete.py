"""The plan of one concrete (not ``auto``) policy: one ``LayerRow`` per layer, totals per tier.

Interface
    plan_concrete(policy, spec, batch, context, encoder_length=None, run=None, states=None) -> Plan
        ``states``: the model's conv / recurrent states (``tiercache.planner.states.StatePlan``):
        their bytes join the device total (``Plan.state_bytes``) and the table's states line
    Plan, LayerRow          (``Plan``'s fields: see ``tiercache.planner.api``)
    CardVerdict             ``Plan.card_verdict()``: the whole footprint against a stated GPU's memory
    check_sizes(batch, context, name)   ``PolicyError`` unless both are ints >= 1
    tier_bytes(nbytes, device) -> {"device", "host", "disk"}   a cache's places mapped to tiers
    budget_text(budget), bytes_text(plan)   the words the planner's errors use
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.errors import PolicyError
from tiercache.layers.tiers import place_of
from tiercache.models.spec import ModelSpec
from tiercache.planner.footprint import TIERS, Footprint, layer_footprint, mirror_bytes, workspace_bytes
from tiercache.planner.units import human
from tiercache.policy.schema import Budget, Policy


@dataclass(frozen=True)
class LayerRow:
    index: int
    layer_type: str
    form: str  # e.g. "bf16 full", "int4 native g64 r128 (K channel, V token)"
    place: str  # device | host | disk: where the history lives
    tokens: int  # tokens held
    bytes: dict  # tier -> bytes
    mirror: int = 0  # bytes of its device mirror while fetched (offloaded layers)


@dataclass(frozen=True)
class CardVerdict:
    """The whole run's device footprint against a GPU's memory (``Plan.card_verdict``)."""

    used: int  # bytes: the whole footprint's device total (weights, cache, growth, activations, runtime, margin)
    card: int  # bytes of the card
    fits: bool
    note: str = ""  # why it cannot fit whatever the bytes (unknown weights), else ""


@dataclass
class Plan:
    policy: Policy
    model: ModelSpec
    batch_size: int
    context_length: int
    layers: list[LayerRow]
    mirrors: int  # offload prefetcher's device slots (part of bytes["device"]; an upper bound
    #              when offloaded layers differ in size, see tiercache.planner.footprint.mirror_bytes)
    bytes: dict
    workspace: int  # part of bytes["device"], like mirrors
    problems: list[str] = field(default_factory=list)
    rungs: list | None = None  # tiercache.planner.ladder.Rung rows, for auto policies
    requested: Policy | None = None  # the auto policy, when ``policy`` was chosen by the ladder
    whole: object | None = None  # tiercache.planner.whole.Whole: every line of the run's footprint
    prefill_chunk: int | None = None
    cross_layers: list[LayerRow] = field(default_factory=list)  # encoder-decoder, with encoder_length
    encoder_length: int | None = None
    states: object | None = None  # tiercache.planner.states.StatePlan (hybrid models), else None
    state_bytes: int = 0  # part of bytes["device"], like workspace: conv / recurrent states (0 when not predicted)
    gpu_memory: int | None = None  # the card the caller stated (``plan(..., gpu_memory=)``); see ``card``

    @property
    def budget(self) -> Budget | None:
        return (self.requested or self.policy).budget

    @property
    def scope(self) -> str:
        return getattr(self.budget, "scope", "cache") if self.budget is not None else "cache"

    def verdicts(self) -> dict[str, tuple[int, int, bool]]:
        """tier -> (bytes counted, budget, fits), for each tier the budget names."""
        out = {}
        for tier in TIERS:
            limit = getattr(self.budget, tier, None) if self.budget is not None else None
            if limit is not None:
                used = self.whole.total[tier] if self.scope == "total" and self.whole is not None else self.bytes[tier]
                out[tier] = (used, int(limit), used <= limit)
        return out

    @property
    def card(self) -> int | None:
        """The GPU's memory the whole run must fit: the caller's ``gpu_memory``, else the policy's
        ``budget.gpu_memory``; None when neither states one."""
        if self.gpu_memory is not None:
            return self.gpu_memory
        return getattr(self.budget, "gpu_memory", None) if self.budget is not None else None

    def card_verdict(self) -> CardVerdict | None:
        """The whole footprint's device total against ``card``; None when no card is stated, when
        there is no whole footprint (a plan built without a run) or when the run is on the CPU (a
        policy's card says nothing of host memory). Unknown weights (a hub id whose config is not
        at hand) fail it: a total without them is no answer."""
        card = self.card
        if card is None or self.whole is None or self.whole.device != "cuda":
            return None
        used = self.whole.total["device"]
        unknown = any(x.name == "weights" and x.note.startswith("unknown") for x in self.whole.lines)
        return CardVerdict(used, int(card), used <= card and not unknown,
                           "the weights are unknown for this model (no config at hand): the total leaves them out"
                           if unknown else "")

    @property
    def fits(self) -> bool:
        card = self.card_verdict()
        return (not self.problems and all(ok for _, _, ok in self.verdicts().values())
                and (card is None or card.fits))

    def table(self) -> str:
        from tiercache.planner.table import render

        return render(self)


def check_sizes(batch_size, context_length, context_name: str = "context_length") -> None:
    """``PolicyError`` unless both are ints >= 1."""
    for name, v in (("batch_size", batch_size), (context_name, context_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PolicyError(f"plan: {name} must be an integer >= 1, got {v!r}")


def plan_concrete(policy: Policy, spec: ModelSpec, batch: int, context: int, encoder_length: int | None = None,
                  run=None, states=None) -> Plan:
    rows, mirrors, workspace, totals = _half(policy.resolve(spec), spec, batch, context, states)
    cross_rows = []
    if encoder_length is not None:  # the cross_attention_cache half: its own layers, mirrors and workspace
        from tiercache.planner.cross_attention import cross_layer_policies

        cross_rows, more_mirrors, more_workspace, more = _half(cross_layer_policies(policy, spec), spec, batch,
                                                                 encoder_length)
        mirrors, workspace = mirrors + more_mirrors, workspace + more_workspace
        totals = {tier: totals[tier] + more[tier] for tier in TIERS}
    problems = []
    if policy.storage == "static" and policy.max_length is not None and context > policy.max_length:
        problems.append(f"context {context} exceeds static max_length {policy.max_length}")
    state_bytes = 0 if states is None else states.bytes(batch)  # exact, on the device, any context
    totals["device"] += state_bytes
    p = Plan(policy, spec, batch, context, rows, mirrors, totals, workspace, problems,
             cross_layers=cross_rows, encoder_length=encoder_length, states=states, state_bytes=state_bytes)
    if run is not None:
        run.attach(p)
    return p


def _half(layer_policies, spec: ModelSpec, batch: int, tokens: int, states=None):
    """Rows, device mirrors, workspace and totals per tier of one TieredCache's layers (their K/V:
    the conv / recurrent ``states`` are counted apart, on the plan's states line)."""
    prints: list[Footprint] = [layer_footprint(lp, spec, batch, tokens) for lp in layer_policies]
    prefetch = max((lp.offload.prefetch for lp in layer_policies if lp.offload is not None), default=0)
    mirrors = mirror_bytes(prints, prefetch)
    workspace = workspace_bytes(prints, spec, batch)
    totals = {tier: sum(f.held.get(tier, 0) for f in prints) for tier in TIERS}
    totals["device"] += mirrors + workspace
    rows = [LayerRow(lp.index, lp.layer_type, _form(lp, spec, states), _place(lp), f.tokens,
                     {t: f.held.get(t, 0) for t in TIERS}, f.mirrored) for lp, f in zip(layer_policies, prints)]
    return rows, mirrors, workspace, totals


def tier_bytes(nbytes: dict, device) -> dict[str, int]:
    """Map a cache's ``nbytes()`` places to tiers, given the compute device."""
    compute = place_of(device)
    out = dict.fromkeys(TIERS, 0)
    for place, n in nbytes.items():
        tier = "device" if place == compute else "disk" if place == "disk" else "host"
        out[tier] += n
    return out


def _dtype_name(spec: ModelSpec) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}[spec.dtype]


def _form(lp, spec: ModelSpec, states=None) -> str:
    if not lp.attends:  # hybrid models: a conv / recurrent state (fixed size, exact: the states line) or nothing
        if not lp.states:
            return "nothing cached"
        return states.describe(lp.index) if states is not None else "state, exact"
    storage = f"{lp.storage}" + (f" w{lp.window}" if lp.storage == "sliding" else "") + (
        f" max{lp.max_length}" if lp.storage == "static" else "")
    q = lp.quantize
    if q is None:
        return f"{_dtype_name(spec)} {storage}"
    kb, vb = q.bits_of("keys"), q.bits_of("values")
    kind = "fp8" if q.format == "fp8" else (f"int{kb}" if kb == vb else f"K{kb}V{vb}")
    extra = (f" sinks{q.sink_tokens}" if q.sink_tokens else "") + (f" clip:{q.clip}" if q.clip != "minmax" else "") + (
        f" meta{q.meta_bits}" if q.meta_bits else "") + (f" gain{q.key_gain:g}" if q.key_gain != 1.0 else "")
    return f"{kind} {q.backend} g{q.group_size} r{q.residual_length} K:{q.key_axis} V:{q.value_axis}{extra}, {storage}"


def _place(lp) -> str:
    if lp.offload is None:
        return "device"
    return "host" if lp.offload.device == "cpu" else "disk"


def budget_text(budget: Budget | None, card: int | None = None) -> str:
    from tiercache.planner.units import card_text

    parts = [] if budget is None else [f"{t} {human(getattr(budget, t))}" for t in TIERS if getattr(budget, t) is not None]
    if card is not None:
        parts.append(f"a card of {card_text(card)} (the whole run)")
    return ", ".join(parts) or "no budget"


def bytes_text(p: Plan) -> str:
    return ", ".join(f"{t} {human(p.bytes[t])}" for t in TIERS) + f" (workspace {human(p.workspace)} included)"
