"""The whole footprint of a generation run, line by line, per tier: what ``tiercache plan`` adds up.

Interface
    whole(plan, arch, weights, chunk, device, runtime, weight_bytes_exact) -> Whole
    Whole.lines      [Line(name, tier, bytes, note)]; Whole.total {tier: bytes}; Whole.chunk
    Whole.allocated(tier)   the total without the runtime line (what ``torch.cuda.max_memory_allocated``
                            can see: the CUDA context and the interpreter are not PyTorch allocations)
    RUNTIME          bytes of the runtime baseline per compute device kind (see below)
    MARGIN           the stated allocator slack, a fraction of what the run allocates

Lines (device tier unless said):
- ``weights``: from the model's shapes in the chosen format (``tiercache.planner.weights``), or a loaded
  model's parameters exactly;
- ``kv cache``: the policy's layers at ``context`` tokens (``Plan.bytes``: device and host
  tiers; disk for files), prefetch mirrors, the dequantization workspace and a hybrid model's
  conv / recurrent states (``Plan.state_bytes``) included;
- ``cache growth``: the largest layer's resident bytes once more: a buffer that regrows (a full
  layer on its ladder (``capacity.grown_capacity``), a quantized store at each flush, a ``DynamicCache`` at every step)
  holds its old and new memory for a moment; on the host tier for offloaded layers;
- ``activations``: the peak of one prefill chunk over the whole context
  (``tiercache.planner.activations``), or of a decode step if larger;
- ``runtime``: what the process holds before any model: on CPU the resident set of Python with
  torch and transformers imported (``RUNTIME["cpu"]``, measured on this project's machine with
  ``bench/bench_memory.py --baseline``; pass your own), on CUDA the context and kernels
  (``RUNTIME["cuda"]``, not visible to ``max_memory_allocated``);
- ``margin``: ``MARGIN`` (5%) of the allocations above, for allocator slack (the CUDA caching
  allocator's block rounding and fragmentation; glibc arenas on the CPU).
On a CPU run the compute device *is* host memory, so the device and host lines of a policy share
it: ``fits`` checks each budgeted tier as the policy names them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiercache.planner.activations import decode_peak, prefill_peak
from tiercache.planner.footprint import TIERS

RUNTIME = {"cpu": 330 * 2**20, "cuda": 512 * 2**20}
MARGIN = 0.05


@dataclass(frozen=True)
class Line:
    name: str
    tier: str
    bytes: int
    note: str = ""


@dataclass
class Whole:
    lines: list[Line] = field(default_factory=list)
    chunk: int = 0
    device: str = "cuda"

    @property
    def total(self) -> dict[str, int]:
        out = dict.fromkeys(TIERS, 0)
        for line in self.lines:
            out[line.tier] += line.bytes
        return out

    def allocated(self, tier: str = "device") -> int:
        return sum(x.bytes for x in self.lines if x.tier == tier and x.name != "runtime")

    def line(self, name: str, tier: str = "device") -> int:
        return sum(x.bytes for x in self.lines if x.name == name and x.tier == tier)


def whole(plan, arch, weights: str | None, chunk: int, device: str = "cuda", runtime: int | None = None,
          weight_bytes_exact: int | None = None, kernel: str = "flash") -> Whole:
    """The lines of ``plan`` (a cache Plan) run with ``chunk``-token prefill chunks on ``device``."""
    from tiercache.planner.weights import weight_bytes

    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    w = Whole(chunk=chunk, device=kind)
    add = lambda *a: w.lines.append(Line(*a))  # noqa: E731
    if weight_bytes_exact is not None:
        add("weights", "device", int(weight_bytes_exact), "the loaded model's parameters and buffers")
    elif arch is not None:
        fmt = weights or arch.native_format
        add("weights", "device", weight_bytes(arch, fmt), f"{fmt}, from the config's shapes")
    else:
        add("weights", "device", 0, "unknown: the model config gives no hidden/MLP/vocab sizes")
    for tier in TIERS:
        if plan.bytes[tier]:
            cross = getattr(plan, "encoder_length", None)
            add("kv cache", tier, plan.bytes[tier], f"{plan.policy.name} at {plan.context_length} tokens"
                + (f" + cross-attention at {cross} encoder tokens" if cross else "")
                + (", mirrors and workspace included" if tier == "device" and (plan.mirrors or plan.workspace) else "")
                + (", conv / recurrent states included" if tier == "device" and getattr(plan, "state_bytes", 0) else ""))
    growth = _growth(plan)
    for tier, n in growth.items():
        if n:
            add("cache growth", tier, n, "one layer regrowing: old and new buffers for a moment")
    if arch is not None:
        sliding = any(t != "full_attention" for t in plan.model.layer_types)
        acts = prefill_peak(arch, plan.batch_size, chunk, plan.context_length, kernel, "bool" if kernel == "flash"
                            else "float", sliding)
        peak = max(acts["peak"], decode_peak(arch, plan.batch_size, plan.context_length))
        add("activations", "device", peak, f"one prefill chunk of {chunk} tokens over {plan.context_length}"
            f" ({kernel} attention; mlp {_h(acts['mlp'])}, attention {_h(acts['attention'])}, mask {_h(acts['mask'])})")
    base = RUNTIME[kind] if runtime is None else int(runtime)
    add("runtime", "device", base, "Python, torch, transformers resident set" if kind == "cpu"
        else "CUDA context and kernels (not in max_memory_allocated)")
    slack = {t: int(MARGIN * sum(x.bytes for x in w.lines if x.tier == t and x.name != "runtime")) for t in TIERS}
    for tier in TIERS:
        if slack[tier] and tier != "disk":
            add("margin", tier, slack[tier], f"{MARGIN:.0%} allocator slack")
    return w


def _growth(plan) -> dict[str, int]:
    """The largest single layer's bytes on each tier: the transient of one regrow."""
    out = dict.fromkeys(TIERS, 0)
    for row in [*plan.layers, *getattr(plan, "cross_layers", [])]:
        for tier in ("device", "host"):
            out[tier] = max(out[tier], row.bytes.get(tier, 0))
        out["device"] = max(out["device"], row.mirror)  # an offload mirror regrows in its slot
    return out


def _h(n: int) -> str:
    from tiercache.planner.units import human

    return human(n)
