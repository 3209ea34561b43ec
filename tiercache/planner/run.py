"""How a planned run executes: weights format, compute device, prefill chunk, runtime baseline.

Interface
    RunSpec.of(model, weights, device, prefill_chunk, runtime, gpu_memory=None) -> RunSpec
        ``model`` as ``tiercache.plan`` takes it (a preset or tiny name, a path, a config, a
        ModelSpec, or a loaded ``torch.nn.Module``); ``gpu_memory``: the card's bytes (a CUDA
        run only); raises ``PolicyError`` on a bad option.
    run.attach(plan)      sets ``plan.whole``, ``plan.prefill_chunk`` and ``plan.gpu_memory``
    default_device(card) -> (device, why)
        the compute device ``tiercache plan`` plans for when no ``--device`` is given: ``cuda`` when a
        card is stated (a GPU's memory) or torch sees a CUDA device here, else ``cpu``; ``why`` is
        the sentence the CLI prints, so the choice is never silent

Choosing the chunk: an explicit ``prefill_chunk`` is used as given. Otherwise, with a
``budget.scope: total`` budget or a card (``gpu_memory``, or the policy's ``budget.gpu_memory``
on a CUDA run), the largest of ``activations.CHUNKS`` (capped at the context) whose whole
footprint fits; the smallest when none does. Without either, 2048 tokens (capped at the
context): chunks that large keep the matrix products efficient, and smaller ones only pay off
when memory is short.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tiercache.planner.activations import CHUNKS, DEFAULT_CHUNK, kernel_for
from tiercache.errors import PolicyError
from tiercache.planner.weights import FORMATS, Arch, arch_preset, module_bytes


@dataclass(frozen=True)
class RunSpec:
    arch: Arch | None
    weights: str | None
    device: str
    chunk: int | None
    runtime: int | None
    exact_weights: int | None = None
    kernel: str = "flash"
    card: int | None = None  # the GPU's memory in bytes, when the caller states one

    @classmethod
    def of(cls, model, weights=None, device="cuda", chunk=None, runtime=None, gpu_memory=None) -> "RunSpec":
        if gpu_memory is not None:
            from tiercache.policy.schema import MIN_CARD

            if not isinstance(gpu_memory, int) or isinstance(gpu_memory, bool) or gpu_memory < MIN_CARD:
                raise PolicyError(f"plan: gpu_memory is the card's memory in bytes (>= {MIN_CARD}; 24GB is "
                                  f"{24 * 10**9}), got {gpu_memory!r}")
            if str(device).split(":")[0] != "cuda":
                raise PolicyError(f"plan: gpu_memory is a GPU's memory; the plan is for device {device!r}: "
                                  "plan a cuda run (device='cuda', --device cuda) or leave the card out")
        if weights is not None and weights not in FORMATS:
            raise PolicyError(f"plan: weights must be one of {', '.join(FORMATS)}, got {weights!r}")
        if str(device).split(":")[0] not in ("cpu", "cuda"):
            raise PolicyError(f"plan: device must be cpu or cuda, got {device!r}")
        for name, v in (("prefill_chunk", chunk), ("runtime", runtime)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "prefill_chunk" else 0)):
                raise PolicyError(f"plan: {name} must be a whole number >= {1 if name == 'prefill_chunk' else 0}, got {v!r}")
        exact = None
        config = None
        if hasattr(model, "parameters") and hasattr(model, "config"):  # a loaded model
            config, exact = model.config, module_bytes(model)
            if weights is not None:
                exact = None  # the user asks what another format would take: count from the shapes
        arch = _arch(config if config is not None else model)
        impl = getattr(config if config is not None else model, "_attn_implementation", None)
        return cls(arch, weights, str(device).split(":")[0], chunk, runtime, exact, kernel_for(device, impl),
                   None if gpu_memory is None else int(gpu_memory))

    def attach(self, plan) -> None:
        from tiercache.planner.whole import whole

        make = lambda c: whole(plan, self.arch, self.weights, c, self.device, self.runtime,  # noqa: E731
                               self.exact_weights, self.kernel)
        context = plan.context_length
        plan.gpu_memory = self.card
        if self.chunk is not None:
            chosen = min(self.chunk, context)
        elif (plan.scope == "total" and plan.budget is not None) or (plan.card is not None and self.device == "cuda"):
            sizes = sorted({min(c, context) for c in CHUNKS}, reverse=True)
            chosen = sizes[-1]
            for c in sizes:
                plan.whole, plan.prefill_chunk = make(c), c
                if plan.fits:
                    chosen = c
                    break
        else:
            chosen = min(DEFAULT_CHUNK, context)
        plan.whole, plan.prefill_chunk = make(chosen), chosen


def default_device(card: bool) -> tuple[str, str]:
    """The device a plan without ``--device`` is for, and why (``card``: a GPU's memory is stated)."""
    if card:
        return "cuda", "a card is stated (--gpu-memory or budget.gpu_memory), so a GPU run"
    import torch

    if torch.cuda.is_available():
        return "cuda", "torch sees a CUDA device here; --device cpu plans a CPU run"
    return "cpu", "torch sees no CUDA device here; --device cuda plans the run on a GPU"


def _arch(model) -> Arch | None:
    from tiercache.models.spec import ModelSpec

    if isinstance(model, ModelSpec):
        return arch_preset(model.name)
    if isinstance(model, (str, Path)):
        preset = arch_preset(str(model))
        if preset is not None:
            return preset
        from tiercache.planner.resolve import local_config

        try:  # a built-in model (the real one included: its config ships) or a local config
            config = local_config(str(model))
        except PolicyError:
            return None
        return None if config is None else Arch.from_config(config)  # None: a hub id; the weights line says unknown
    return Arch.from_config(model)
