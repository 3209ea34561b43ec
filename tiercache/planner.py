"""Planner: the bytes a policy's cache will hold on each tier, and whether that fits its budget.

Interface
    plan(policy, model, batch_size=1, context_length=4096, encoder_length=None) -> Plan
        ``policy``: a Policy, YAML path or dict; ``model``: a ModelSpec, a transformers config,
        a preset name or a local path (``resolve_model``). An ``auto: true`` policy is first
        resolved by the candidate ladder (``tiercache.ladder``); the Plan then carries every rung.
        Encoder-decoder models: ``context_length`` is the decoder's tokens (self-attention);
        ``encoder_length`` the encoder output's, whose cross-attention K/V every decoder layer
        holds (``policy.cross_attention``, ``TieredCache.for_encoder_decoder``). Without it the
        cross-attention is not counted (the table says so).
    choose(policy, model, batch, context) -> Policy
        the concrete policy an ``auto`` policy stands for (``TieredCache.from_policy`` calls it).
    resolve_model(name_or_path) -> ModelSpec
    local_config(name_or_path) -> config | None
        a built-in model's or a local config.json's config (what ``resolve_model`` and the whole
        footprint's shapes both read); None for a preset or a hub id
    main_plan(policy_path, model, context, batch, out, err, encoder_length, **run) -> exit code (the
        ``tiercache plan`` CLI; ``run``: ``weights``, ``device``, ``prefill_chunk``, ``runtime`` as
        ``plan`` takes them)

Plan
    .bytes       {"device", "host", "disk"}: bytes *held* once ``context_length`` tokens are in
                 the cache: what ``TieredCache.nbytes()`` reports (allocated, chunk-rounded),
                 the shared buffers (offload mirrors, dequantization workspace) included.
    .workspace   the part of ``.bytes["device"]`` that is the quantized layers' shared
                 dequantization workspace: the full-precision K/V one decode step returns for
                 the largest layer (``tiercache.footprint.workspace_bytes``).
    .whole       the whole footprint of a run (``tiercache.whole``): weights, cache, growth,
                 activations of one prefill chunk, runtime, margin, line by line per tier;
                 ``.prefill_chunk`` the chunk size it was planned with.
    .fits        every tier named in ``policy.budget`` holds what the budget counts: with
                 ``budget.scope: cache`` (the default) the cache's bytes (``.bytes``, workspace
                 and mirrors included); with ``scope: total`` the whole footprint's total.
                 True when there is no budget.
    .layers      one LayerRow per layer; ``.rungs`` (auto only) one Rung per ladder candidate.
    .cross_layers  encoder-decoder with ``encoder_length``: one LayerRow per cross-attention
                 layer (the ``cross_attention_cache`` half); their bytes, device mirrors and
                 workspace (that half has its own) are in ``.bytes``, ``.mirrors``, ``.workspace``.
    .table()     the human-readable report.

Comparing with a real cache: ``tier_bytes(cache.nbytes(), device)`` maps places to tiers (the
compute device's place -> device, ``cpu`` -> host, ``disk`` -> disk). On a CPU-only run the
device *is* ``cpu``, so device and host bytes share one place there; compare their sum, or
report host-tier allocations under their own name (the tests patch ``HostTier.place``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tiercache.errors import PolicyError
from tiercache.footprint import TIERS, Footprint, layer_footprint, mirror_bytes, workspace_bytes
from tiercache.model_spec import PRESETS, ModelSpec
from tiercache.policy import Budget, Policy, load_policy
from tiercache.tiers import place_of

__all__ = ["Plan", "LayerRow", "plan", "choose", "resolve_model", "main_plan", "tier_bytes", "human"]


@dataclass(frozen=True)
class LayerRow:
    index: int
    layer_type: str
    form: str  # e.g. "bf16 full", "int4 native g64 r128 (K channel, V token)"
    place: str  # device | host | disk: where the history lives
    tokens: int  # tokens held
    bytes: dict  # tier -> bytes
    mirror: int = 0  # bytes of its device mirror while fetched (offloaded layers)


@dataclass
class Plan:
    policy: Policy
    model: ModelSpec
    batch_size: int
    context_length: int
    layers: list[LayerRow]
    mirrors: int  # offload prefetcher's device slots (part of bytes["device"]; an upper bound
    #              when offloaded layers differ in size, see tiercache.footprint.mirror_bytes)
    bytes: dict
    workspace: int  # part of bytes["device"], like mirrors
    problems: list[str] = field(default_factory=list)
    rungs: list | None = None  # tiercache.ladder.Rung rows, for auto policies
    requested: Policy | None = None  # the auto policy, when ``policy`` was chosen by the ladder
    whole: object | None = None  # tiercache.whole.Whole: every line of the run's footprint
    prefill_chunk: int | None = None
    cross_layers: list[LayerRow] = field(default_factory=list)  # encoder-decoder, with encoder_length
    encoder_length: int | None = None

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
    def fits(self) -> bool:
        return not self.problems and all(ok for _, _, ok in self.verdicts().values())

    def table(self) -> str:
        from tiercache.plan_table import render

        return render(self)


def plan(policy, model, batch_size: int = 1, context_length: int = 4096, encoder_length: int | None = None, *,
         weights: str | None = None, device: str = "cuda", prefill_chunk: int | None = None,
         runtime: int | None = None) -> Plan:
    """``model`` may also be a loaded ``torch.nn.Module`` (its parameters are counted exactly).
    ``encoder_length``: an encoder-decoder model's encoder tokens (its cross-attention K/V are
    counted, in ``.cross_layers``, ``.bytes`` and the whole footprint's cache line).
    ``weights``: the weights' format (``tiercache.weights.FORMATS``; default the model's dtype);
    ``device``: ``cuda`` or ``cpu`` (the attention kernel and the runtime line); ``prefill_chunk``:
    default the largest of ``activations.CHUNKS`` that fits a ``scope: total`` budget, else 2048;
    ``runtime``: the runtime baseline in bytes (default ``whole.RUNTIME``)."""
    from tiercache.run import RunSpec

    policy = load_policy(policy)
    run = RunSpec.of(model, weights, device, prefill_chunk, runtime)
    spec = model if isinstance(model, ModelSpec) else (
        resolve_model(model) if isinstance(model, (str, Path)) else ModelSpec.from_config(
            model.config if hasattr(model, "parameters") and hasattr(model, "config") else model))
    check_sizes(batch_size, context_length)
    if encoder_length is not None:
        check_sizes(batch_size, encoder_length, "encoder_length")
        if not spec.cross_attention:
            raise PolicyError(f"plan: encoder_length is for encoder-decoder models; {spec.name} is decoder-only "
                              "(no cross-attention to count)")
    if policy.auto:
        from tiercache.ladder import walk

        return walk(policy, spec, batch_size, context_length, encoder_length, run)
    return plan_concrete(policy, spec, batch_size, context_length, encoder_length, run)


def check_sizes(batch_size, context_length, context_name: str = "context_length") -> None:
    """``PolicyError`` unless both are ints >= 1."""
    for name, v in (("batch_size", batch_size), (context_name, context_length)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PolicyError(f"plan: {name} must be an integer >= 1, got {v!r}")


def choose(policy, model, batch: int = 1, context: int = 4096) -> Policy:
    """The concrete policy an auto policy resolves to; PolicyError when no rung fits."""
    p = plan(policy, model, batch, context)
    if not p.fits:
        raise PolicyError(
            f"policy.budget: no candidate of the auto ladder fits {_budget_text(p.budget)} for "
            f"{p.model.name} at batch {batch}, context {context}; the smallest reachable is "
            f"{p.policy.name} with {_bytes_text(p)}"
        )
    return p.policy


def plan_concrete(policy: Policy, spec: ModelSpec, batch: int, context: int, encoder_length: int | None = None,
                  run=None) -> Plan:
    rows, mirrors, workspace, totals = _half(policy.resolve(spec), spec, batch, context)
    cross_rows = []
    if encoder_length is not None:  # the cross_attention_cache half: its own layers, mirrors and workspace
        from tiercache.cross_attention import cross_layer_policies

        cross_rows, more_mirrors, more_workspace, more = _half(cross_layer_policies(policy, spec), spec, batch,
                                                                 encoder_length)
        mirrors, workspace = mirrors + more_mirrors, workspace + more_workspace
        totals = {tier: totals[tier] + more[tier] for tier in TIERS}
    problems = []
    if policy.storage == "static" and policy.max_length is not None and context > policy.max_length:
        problems.append(f"context {context} exceeds static max_length {policy.max_length}")
    p = Plan(policy, spec, batch, context, rows, mirrors, totals, workspace, problems,
             cross_layers=cross_rows, encoder_length=encoder_length)
    if run is not None:
        run.attach(p)
    return p


def _half(layer_policies, spec: ModelSpec, batch: int, tokens: int):
    """Rows, device mirrors, workspace and totals per tier of one TieredCache's layers."""
    prints: list[Footprint] = [layer_footprint(lp, spec, batch, tokens) for lp in layer_policies]
    prefetch = max((lp.offload.prefetch for lp in layer_policies if lp.offload is not None), default=0)
    mirrors = mirror_bytes(prints, prefetch)
    workspace = workspace_bytes(prints, spec, batch)
    totals = {tier: sum(f.held.get(tier, 0) for f in prints) for tier in TIERS}
    totals["device"] += mirrors + workspace
    rows = [LayerRow(lp.index, lp.layer_type, _form(lp, spec), _place(lp), f.tokens,
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


# -- models ----------------------------------------------------------------------------------------

def resolve_model(model: str) -> ModelSpec:
    """A preset name (any case), a built-in model (``tiercache.bench.builtin.NAMES``), a local dir /
    config.json (read as JSON), or a hub id."""
    key = str(model).lower()
    if key in PRESETS:
        return PRESETS[key]
    config = local_config(model)
    if config is not None:
        from tiercache.bench import builtin

        spec = ModelSpec.from_config(config)
        if key in builtin.NAMES:
            from dataclasses import replace

            spec = replace(spec, name=key)
        return spec
    try:
        from transformers import AutoConfig

        return ModelSpec.from_config(AutoConfig.from_pretrained(model))
    except Exception as e:  # noqa: BLE001 - any hub / network failure becomes one clear message
        names = ", ".join(s.name for s in PRESETS.values())
        raise PolicyError(
            f"--model {model!r}: not a preset, a local config, or a reachable hub id ({type(e).__name__}: {e}); "
            f"presets: {names}"
        ) from e


def local_config(model: str):
    """The config of a built-in model (``tiercache.bench.builtin.NAMES``: no network, no weights
    needed) or of a local dir / config.json (read as JSON), else ``None`` (a preset or a hub id).
    ``PolicyError`` for a config file that is not a JSON object."""
    from tiercache.bench import builtin

    key = str(model).lower()
    if key in builtin.NAMES:
        return builtin.config(key)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PolicyError(f"model config {str(path)!r} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise PolicyError(f"model config {str(path)!r} must be a JSON object, got {type(data).__name__}")
    return _JsonConfig(data, str(path.parent))


class _JsonConfig:
    """Attribute view of a config.json (multimodal configs: the ``text_config`` part)."""

    def __init__(self, data: dict, name: str):
        data = data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data
        self.__dict__.update(data)
        self._name_or_path = name
        self.dtype = data.get("dtype") or data.get("torch_dtype") or "bfloat16"


# -- CLI -------------------------------------------------------------------------------------------

def main_plan(policy_path: str, model: str, context: int, batch: int, out=None, err=None,
              encoder_length: int | None = None, **run) -> int:
    """``tiercache plan``: print the table (``out``, default stdout); 0 when it fits, 1 when it does
    not or on error (``tiercache plan: error: ...`` on ``err``, default stderr)."""
    out = out if out is not None else sys.stdout  # looked up per call: sys.stdout may be replaced
    err = err if err is not None else sys.stderr
    try:
        p = plan(load_policy(policy_path), model, batch, context, encoder_length, **run)
    except PolicyError as e:
        print(f"tiercache plan: error: {e}", file=err)
        return 1
    print(p.table(), file=out)
    return 0 if p.fits else 1


# -- text helpers ----------------------------------------------------------------------------------

def human(n: int) -> str:
    """Bytes as B / KiB / MiB / GiB / TiB with one decimal."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _dtype_name(spec: ModelSpec) -> str:
    return {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}[spec.dtype]


def _form(lp, spec: ModelSpec) -> str:
    if not lp.attends:  # hybrid models: a conv / recurrent state (fixed size, exact) or nothing
        return "state, exact (not planned)" if lp.states else "nothing cached"
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


def _budget_text(budget: Budget | None) -> str:
    if budget is None:
        return "no budget"
    return ", ".join(f"{t} {human(getattr(budget, t))}" for t in TIERS if getattr(budget, t) is not None)


def _bytes_text(p: Plan) -> str:
    return ", ".join(f"{t} {human(p.bytes[t])}" for t in TIERS) + f" (workspace {human(p.workspace)} included)"
