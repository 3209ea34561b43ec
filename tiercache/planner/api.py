"""Planner: the bytes a policy's cache will hold on each tier, and whether that fits its budget.

Interface
    plan(policy, model, batch_size=1, context_length=4096, encoder_length=None) -> Plan
        ``policy``: a Policy, YAML path or dict; ``model``: a ModelSpec, a transformers config,
        a preset name or a local path (``resolve_model``). An ``auto: true`` policy is first
        resolved by the candidate ladder (``tiercache.planner.ladder``); the Plan then carries every rung.
        Encoder-decoder models: ``context_length`` is the decoder's tokens (self-attention);
        ``encoder_length`` the encoder output's, whose cross-attention K/V every decoder layer
        holds (``policy.cross_attention``, ``TieredCache.for_encoder_decoder``). Without it the
        cross-attention is not counted (the table says so).
    fits_card(policy, model, batch_size, context_length, gpu_memory, **run) -> (bool, int)
        whether the whole run's device footprint (weights, cache, growth, activations of a prefill
        chunk, runtime, margin) fits a GPU of ``gpu_memory`` bytes, and that footprint in bytes;
        what ``tiercache plan --gpu-memory`` checks, for a search that tries many policies
    choose(policy, model, batch_size=1, context_length=4096) -> Policy
        the concrete policy an ``auto`` policy stands for (``TieredCache.from_policy`` calls it).
    resolve_model(name_or_path) -> ModelSpec
    local_config(name_or_path) -> config | None
        a built-in model's or a local config.json's config (what ``resolve_model`` and the whole
        footprint's shapes both read); None for a preset or a hub id
    main_plan(policy_path, model, context, batch, out, err, encoder_length, **run) -> exit code (the
        ``tiercache plan`` CLI; ``run``: ``weights``, ``device``, ``prefill_chunk``, ``runtime``,
        ``gpu_memory`` as ``plan`` takes them; no ``device``: chosen and said, see ``main_plan``)

Plan
    .bytes       {"device", "host", "disk"}: bytes *held* once ``context_length`` tokens are in
                 the cache: what ``TieredCache.nbytes()`` reports (allocated, chunk-rounded),
                 the shared buffers (offload mirrors, dequantization workspace) included.
    .workspace   the part of ``.bytes["device"]`` that is the quantized layers' shared
                 dequantization workspace: the full-precision K/V one decode step returns for
                 the largest layer that dequantizes every step (``packed_attention: false``;
                 packed-attention layers hold none: ``tiercache.planner.footprint``).
    .whole       the whole footprint of a run (``tiercache.planner.whole``): weights, cache, growth,
                 activations of one prefill chunk, runtime, margin, line by line per tier;
                 ``.prefill_chunk`` the chunk size it was planned with.
    .fits        every tier named in ``policy.budget`` holds what the budget counts: with
                 ``budget.scope: cache`` (the default) the cache's bytes (``.bytes``, workspace
                 and mirrors included); with ``scope: total`` the whole footprint's total;
                 and, on a CUDA run with a card stated (``.card``), the whole footprint's device
                 total fits the card, whatever the scope. True when there is neither.
    .card        the GPU's memory in bytes: ``plan(..., gpu_memory=)``, else the policy's
                 ``budget.gpu_memory``, else None; ``.card_verdict()`` -> CardVerdict(used, card,
                 fits, note) or None (no card, or a CPU run).
    .layers      one LayerRow per layer; ``.rungs`` (auto only) one Rung per ladder candidate.
    .cross_layers  encoder-decoder with ``encoder_length``: one LayerRow per cross-attention
                 layer (the ``cross_attention_cache`` half); their bytes, device mirrors and
                 workspace (that half has its own) are in ``.bytes``, ``.mirrors``, ``.workspace``.
    .states      hybrid and recurrent models: the conv / recurrent states (``tiercache.planner.states``:
                 shapes per layer from the config, or why they are not predicted); ``.state_bytes``
                 their device bytes, part of ``.bytes["device"]`` (a fixed size, whatever the context;
                 0 and said so in the table when not predicted)
    .table()     the human-readable report.

Places and tiers: ``cache.nbytes()`` is keyed by *place* (``cuda:0``, ``cpu``, ``disk``: where the
bytes are now), ``Plan.bytes`` by *tier* (``device``, ``host``, ``disk``: what the policy asks for);
``cache.tier_nbytes()`` is the cache's bytes keyed by tier, the one to compare with a plan (host-tier
bytes apart from compute-device bytes even on a CPU-only machine, where both are in ``cpu``).
``tier_bytes(nbytes, device)`` maps a place dict to tiers (the compute device's place -> device,
``cpu`` -> host, ``disk`` -> disk).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from tiercache.errors import PolicyError
from tiercache.models.spec import PRESETS, ModelSpec
from tiercache.planner.concrete import LayerRow, Plan, budget_text, bytes_text, check_sizes, plan_concrete, tier_bytes
from tiercache.planner.resolve import local_config, resolve_model
from tiercache.planner.states import state_plan
from tiercache.planner.units import human
from tiercache.policy.schema import Policy, load_policy

__all__ = ["Plan", "LayerRow", "plan", "fits_card", "choose", "resolve_model", "local_config", "main_plan", "tier_bytes", "human",
           "check_sizes", "plan_concrete"]


def plan(policy, model, batch_size: int = 1, context_length: int = 4096, encoder_length: int | None = None, *,
         weights: str | None = None, device: str = "cuda", prefill_chunk: int | None = None,
         runtime: int | None = None, gpu_memory: int | None = None) -> Plan:
    """``model`` may also be a loaded ``torch.nn.Module`` (its parameters are counted exactly).
    ``encoder_length``: an encoder-decoder model's encoder tokens (its cross-attention K/V are
    counted, in ``.cross_layers``, ``.bytes`` and the whole footprint's cache line).
    ``weights``: the weights' format (``tiercache.planner.weights.FORMATS``; default the model's dtype);
    ``device``: ``cuda`` or ``cpu`` (the attention kernel and the runtime line); ``prefill_chunk``:
    default the largest of ``activations.CHUNKS`` that fits a ``scope: total`` budget, else 2048;
    ``runtime``: the runtime baseline in bytes (default ``whole.RUNTIME``); ``gpu_memory``: the
    card's bytes (``24 * 10**9`` for a 24 GB card; a CUDA run only): the verdict then also needs
    the whole footprint's device total to fit it, and the prefill chunk is chosen against it."""
    from tiercache.planner.run import RunSpec

    policy = load_policy(policy)
    run = RunSpec.of(model, weights, device, prefill_chunk, runtime, gpu_memory)
    spec = model if isinstance(model, ModelSpec) else (
        resolve_model(model) if isinstance(model, (str, Path)) else ModelSpec.from_config(
            model.config if hasattr(model, "parameters") and hasattr(model, "config") else model))
    check_sizes(batch_size, context_length)
    if encoder_length is not None:
        check_sizes(batch_size, encoder_length, "encoder_length")
        if not spec.cross_attention:
            raise PolicyError(f"plan: encoder_length is for encoder-decoder models; {spec.name} is decoder-only "
                              "(no cross-attention to count)")
    stateful = any(spec.states(i) for i in range(spec.num_layers))  # (only then is a config looked up)
    states = state_plan(spec, _config_of(model)) if stateful and not isinstance(model, ModelSpec) else state_plan(spec, None)
    if policy.auto:
        from tiercache.planner.ladder import walk

        return walk(policy, spec, batch_size, context_length, encoder_length, run, states)
    return plan_concrete(policy, spec, batch_size, context_length, encoder_length, run, states)


def _config_of(model):
    """The config behind ``model`` (a config, a loaded model, a built-in name, a local path or a hub
    id), read only for a model whose layers keep a conv / recurrent state; None if unreachable."""
    if hasattr(model, "parameters") and hasattr(model, "config"):
        return model.config
    if not isinstance(model, (str, Path)):
        return model
    if str(model).lower() in PRESETS:
        return None
    config = local_config(str(model))
    if config is None:
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(str(model))
        except Exception:  # noqa: BLE001 - resolve_model already reached it; the plan says "not predicted"
            return None
    return config


def fits_card(policy, model, batch_size: int = 1, context_length: int = 4096, gpu_memory: int | None = None,
              **run) -> tuple[bool, int]:
    """Whether ``policy`` run on ``model`` at ``batch_size`` x ``context_length`` tokens fits a GPU of
    ``gpu_memory`` bytes (``24 * 10**9`` for a "24 GB" card), and the whole footprint's device
    total in bytes (``Plan.whole.total["device"]``: weights, cache, growth, activations, runtime,
    margin). Only the card is judged, not the policy's cache budget; an ``auto`` policy is the
    rung its ladder chooses against the card. ``run``: ``weights``, ``prefill_chunk``, ``runtime``
    as ``plan`` takes them (the chunk, when not given, is the largest that fits). ``model``: a
    name, a path, a config or a loaded model (a bare ``ModelSpec`` has no weights to count, so
    it is refused). ``PolicyError`` on bad input, or when the weights cannot be counted."""
    if gpu_memory is None:
        raise PolicyError("fits_card: gpu_memory is the card's memory in bytes (24 * 10**9 for a 24 GB card), got None")
    if isinstance(model, ModelSpec) and model.name.lower() not in PRESETS:
        raise PolicyError(f"fits_card: a ModelSpec ({model.name}) gives no weight shapes; pass the model's config, "
                          "name or path")
    p = plan(policy, model, batch_size, context_length, gpu_memory=gpu_memory, **run)
    verdict = p.card_verdict()
    if verdict.note:
        raise PolicyError(f"fits_card: {verdict.note}")
    return verdict.fits, verdict.used


def choose(policy, model, batch_size: int = 1, context_length: int = 4096, *, batch: int | None = None,
           context: int | None = None) -> Policy:
    """The concrete policy an auto policy resolves to; PolicyError when no rung fits. ``batch_size`` /
    ``context_length`` as ``plan`` takes them; ``batch=`` / ``context=`` are the deprecated spellings."""
    if batch is not None or context is not None:
        warnings.warn("choose(batch=, context=) is deprecated: use batch_size= and context_length= (as plan takes "
                      "them)", DeprecationWarning, stacklevel=2)
        batch_size = batch if batch is not None else batch_size
        context_length = context if context is not None else context_length
    p = plan(policy, model, batch_size, context_length)
    if not p.fits:
        card = p.card if p.card_verdict() is not None else None
        raise PolicyError(
            f"policy.budget: no candidate of the auto ladder fits {budget_text(p.budget, card)} for "
            f"{p.model.name} at batch {batch_size}, context {context_length}; the smallest reachable is "
            f"{p.policy.name} with {bytes_text(p)}"
        )
    return p.policy


# -- CLI -------------------------------------------------------------------------------------------

def main_plan(policy_path: str, model: str, context: int, batch: int, out=None, err=None,
              encoder_length: int | None = None, **run) -> int:
    """``tiercache plan``: print the table (``out``, default stdout); 0 when it fits, 1 when it does
    not or on error (``tiercache plan: error: ...`` on ``err``, default stderr). Without a
    ``device`` the run is planned for ``run.default_device`` (cuda when a card is stated or torch
    sees a CUDA device, else cpu), and the first line says which and why."""
    out = out if out is not None else sys.stdout  # looked up per call: sys.stdout may be replaced
    err = err if err is not None else sys.stderr
    try:
        policy = load_policy(policy_path)
        if run.get("device") is None:
            from tiercache.planner.run import default_device

            stated = run.get("gpu_memory") is not None or getattr(policy.budget, "gpu_memory", None) is not None
            run["device"], why = default_device(stated)
            print(f"planning a {run['device']} run: {why}", file=out)
        p = plan(policy, model, batch, context, encoder_length, **run)
    except PolicyError as e:
        print(f"tiercache plan: error: {e}", file=err)
        return 1
    print(p.table(), file=out)
    return 0 if p.fits else 1
