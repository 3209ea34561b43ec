"""How a planned run executes: weights format, compute device, prefill chunk, runtime baseline.

Interface
    RunSpec.of(model, weights, device, prefill_chunk, runtime) -> RunSpec
        ``model`` as ``tiercache.plan`` takes it (a preset or tiny name, a path, a config, a
        ModelSpec, or a loaded ``torch.nn.Module``); raises ``PolicyError`` on a bad option.
    run.attach(plan)      sets ``plan.whole`` and ``plan.prefill_chunk``

Choosing the chunk: an explicit ``prefill_chunk`` is used as given. Otherwise, with a
``budget.scope: total`` budget, the largest of ``activations.CHUNKS`` (capped at the context)
whose whole footprint fits; the smallest when none does. Without one, 2048 tokens (capped at the
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

    @classmethod
    def of(cls, model, weights=None, device="cuda", chunk=None, runtime=None) -> "RunSpec":
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
        return cls(arch, weights, str(device).split(":")[0], chunk, runtime, exact, kernel_for(device, impl))

    def attach(self, plan) -> None:
        from tiercache.planner.whole import whole

        make = lambda c: whole(plan, self.arch, self.weights, c, self.device, self.runtime,  # noqa: E731
                               self.exact_weights, self.kernel)
        context = plan.context_length
        if self.chunk is not None:
            chosen = min(self.chunk, context)
        elif plan.scope == "total" and plan.budget is not None:
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
