"""Bytes of a hybrid model's conv / recurrent states, predicted from its config.

Interface
    state_plan(spec, config) -> StatePlan | None
        None when the model has no layer with a state (``spec.states(i) == 0`` everywhere);
        ``config``: the model's config (a transformers config, ``resolve.local_config``'s view of
        a config.json, or None when only a ``ModelSpec`` is known)
    StatePlan.layers          {layer index: (StateTensor, ...)}: what each state layer holds
    StatePlan.bytes(batch)    device bytes of every state at ``batch`` rows (0 when not predicted)
    StatePlan.layer_bytes(i, batch), StatePlan.describe(i)
    StatePlan.unknown         None, or why the shapes are not predicted (the plan then says so,
                              and its totals exclude the states, rather than count them as 0)
    StatePlan.elsewhere       None, or why the cache holds no state although the layers have one
                              (RecurrentGemma keeps its states in the model itself)
    RULES                     model_type -> the rule that gives a layer's state tensors

What the cache holds (``tiercache.cache.state_layer``): transformers' ``LinearAttentionLayer``
allocates each state at the first update with the shape and dtype the model passes
(``lazy_initialization``): ``[B, channels, kernel]`` for a conv state, and a recurrent state of a
per-family shape, both independent of the context length: one line of the plan, on the device,
exact (no policy tiers or quantizes them). The rules below restate each family's mixer (its
``__init__`` and the tensors its forward passes to ``update_conv_state`` / ``update_recurrent_state``)
and are checked against ``StateLayer.state_nbytes()`` of a real cache after a prefill, for every
hybrid family of ``tests/hybrid_models.py``, in float32 and bfloat16:
- Mamba (``mamba``, ``falcon_mamba``, ``jamba``): conv ``[I, d_conv]``, ssm ``[I, d_state]``, ``I`` the
  mixer's inner size (``intermediate_size``; Jamba ``mamba_expand * hidden``);
- Mamba-2 (``mamba2``, ``bamba``, ``falcon_h1``, ``granitemoehybrid``, ``zamba2``, ``nemotron_h``):
  conv ``[I + 2 * groups * d_state, d_conv]``, ssm ``[heads, head_dim, d_state]``;
- Zamba: conv ``[I, d_conv]``, ssm ``[heads, I / heads, d_state]``;
- gated delta nets (``qwen3_next``, ``qwen3_5*``, ``olmo_hybrid``, ``lara_mini``): conv
  ``[2 * Hk * Dk + Hv * Dv, kernel]``, recurrent ``[Hv, Dk, Dv]``; KDA (``kimi_linear``,
  ``bailing_hybrid``): conv ``[3 * H * D, kernel]``, recurrent ``[H, D, D]``;
- LFM short convolutions (``lfm3``): conv ``[hidden, conv_L_cache]``;
- ZAYA: conv ``[(heads + kv_heads) * head_dim, cca_time0 + cca_time1 - 2]``, recurrent
  ``[kv_heads * head_dim / 2]``;
- Inkling (``inkling_text``, ``inkling2_text``, ``inkling2_loop_text``): four conv states, K and V
  ``[kv_heads * head_dim, sconv_kernel]`` (a ``hybrid_sliding`` layer: the ``swa_`` sizes) and two
  ``[hidden, conv_kernel]``, all float32.
dtypes: a conv state in the model's dtype (Inkling: float32), a recurrent state in float32 (the
reference PyTorch paths keep it so; ZAYA: the model's dtype). An optimized kernel that keeps a
recurrent state in the model's dtype holds less: the plan is then an upper bound.
A family not listed is not predicted (``unknown`` says so and names the model type).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tiercache.models.spec import ModelSpec

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64"}


@dataclass(frozen=True)
class StateTensor:
    kind: str  # "conv" | "recurrent"
    index: int  # transformers' state_idx
    shape: tuple[int, ...]  # per batch row: [B, *shape]
    dtype: str

    def bytes(self, batch: int) -> int:
        return batch * math.prod(self.shape) * _BYTES[self.dtype]


@dataclass(frozen=True)
class StatePlan:
    layers: dict = field(default_factory=dict)  # layer index -> (StateTensor, ...)
    unknown: str | None = None
    elsewhere: str | None = None

    def layer_bytes(self, index: int, batch: int) -> int:
        return sum(t.bytes(batch) for t in self.layers.get(index, ()))

    def bytes(self, batch: int) -> int:
        return sum(self.layer_bytes(i, batch) for i in self.layers)

    def describe(self, index: int) -> str:
        if self.unknown is not None:
            return "state, exact: NOT PREDICTED (see the states line)"
        if self.elsewhere is not None:
            return "state kept by the model, not the cache"
        parts = [f"{t.kind} [{', '.join(map(str, t.shape))}] {_SHORT[t.dtype]}" for t in self.layers.get(index, ())]
        return "state, exact: " + " + ".join(parts)


def state_plan(spec: ModelSpec, config) -> StatePlan | None:
    stateful = [i for i in range(spec.num_layers) if spec.states(i)]
    if not stateful:
        return None
    if config is None:
        return StatePlan(unknown="only the model's layer layout is known (a ModelSpec or preset): give its config "
                                 "(a local path, hub id or transformers config) to predict the state shapes")
    config = _full(config)
    kind = getattr(config, "model_type", None)
    if kind in ELSEWHERE:
        return StatePlan(elsewhere=ELSEWHERE[kind])
    rule = RULES.get(kind)
    if rule is None:
        return StatePlan(unknown=f"model type {kind!r} has no state-shape rule in tiercache.planner.states "
                                 f"(known: {', '.join(sorted(RULES))})")
    dtype = spec.dtype
    try:
        layers = {i: tuple(rule(config, spec.layer_types[i], dtype)) for i in stateful}
    except (AttributeError, TypeError) as e:
        return StatePlan(unknown=f"the {kind} config lacks a size its state needs ({e})")
    for i in stateful:
        if len(layers[i]) and max(t.index for t in layers[i]) + 1 != spec.states(i):
            return StatePlan(unknown=f"layer {i}: the {kind} rule gives {len(layers[i])} tensors for "
                                     f"{spec.states(i)} states")
    return StatePlan(layers=layers)


def _full(config):
    """A config.json read as plain attributes, completed with its transformers config class's
    defaults (a saved config omits them), when transformers knows its ``model_type``."""
    if not type(config).__name__.startswith("_Json"):
        return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers import AutoConfig

        data = {k: v for k, v in vars(config).items() if not k.startswith("_") and k != "model_type"}
        return AutoConfig.for_model(config.model_type, **data).get_text_config(decoder=True)
    except Exception:  # noqa: BLE001 - an unknown or malformed type: read the attributes as they are
        return config


def _c(*a, dtype):
    return StateTensor("conv", 0, tuple(int(x) for x in a), dtype)


def _r(*a, dtype="float32"):
    return StateTensor("recurrent", 0, tuple(int(x) for x in a), dtype)


def _mamba(c, t, dt):
    inner = c.mamba_expand * c.hidden_size if c.model_type == "jamba" else c.intermediate_size
    kernel, state = (c.mamba_d_conv, c.mamba_d_state) if c.model_type == "jamba" else (c.conv_kernel, c.state_size)
    return [_c(inner, kernel, dtype=dt), _r(inner, state)]


def _mamba2(inner, groups, state, kernel, heads, head_dim, dt):
    return [_c(inner + 2 * groups * state, kernel, dtype=dt), _r(heads, head_dim, state)]


def _mamba2_family(c, t, dt):
    m = c.model_type
    if m == "mamba2":
        return _mamba2(int(c.expand * c.hidden_size), c.n_groups, c.state_size, c.conv_kernel, c.num_heads,
                       c.head_dim, dt)
    if m == "nemotron_h":
        return _mamba2(c.mamba_num_heads * c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel,
                       c.mamba_num_heads, c.mamba_head_dim, dt)
    if m == "zamba2":
        return _mamba2(int(c.mamba_expand * c.hidden_size), c.mamba_ngroups, c.mamba_d_state, c.mamba_d_conv,
                       c.n_mamba_heads, c.mamba_headdim, dt)
    inner = int(c.mamba_expand * c.hidden_size)
    if m == "falcon_h1" and c.mamba_d_ssm is not None:
        inner = c.mamba_d_ssm
    return _mamba2(inner, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv, c.mamba_n_heads, c.mamba_d_head, dt)


def _zamba(c, t, dt):
    inner = c.mamba_expand * c.hidden_size
    return [_c(inner, c.mamba_d_conv, dtype=dt), _r(c.n_mamba_heads, inner // c.n_mamba_heads, c.mamba_d_state)]


def _gated_delta(c, t, dt):
    hk, dk, hv, dv = c.linear_num_key_heads, c.linear_key_head_dim, c.linear_num_value_heads, c.linear_value_head_dim
    return [_c(2 * hk * dk + hv * dv, c.linear_conv_kernel_dim, dtype=dt), _r(hv, dk, dv)]


def _kda(c, t, dt):
    h, d = c.linear_num_heads, c.linear_head_dim
    return [_c(3 * h * d, c.linear_conv_kernel_dim, dtype=dt), _r(h, d, d)]


def _lfm(c, t, dt):
    return [_c(c.hidden_size, c.conv_L_cache, dtype=dt)]


def _zaya(c, t, dt):
    kv = c.num_key_value_heads * c.head_dim
    return [_c(c.num_attention_heads * c.head_dim + kv, c.cca_time0 + c.cca_time1 - 2, dtype=dt), _r(kv // 2, dtype=dt)]


def _inkling(c, t, dt):
    sliding = t == "hybrid_sliding"
    kv = (c.swa_num_key_value_heads * c.swa_head_dim) if sliding else c.num_key_value_heads * c.head_dim
    k = c.sconv_kernel_size
    return [StateTensor("conv", 0, (kv, k), "float32"), StateTensor("conv", 1, (kv, k), "float32"),
            StateTensor("conv", 2, (c.hidden_size, c.conv_kernel_size), "float32"),
            StateTensor("conv", 3, (c.hidden_size, c.conv_kernel_size), "float32")]


RULES = {
    "mamba": _mamba, "falcon_mamba": _mamba, "jamba": _mamba,
    "mamba2": _mamba2_family, "bamba": _mamba2_family, "falcon_h1": _mamba2_family,
    "granitemoehybrid": _mamba2_family, "zamba2": _mamba2_family, "nemotron_h": _mamba2_family,
    "zamba": _zamba,
    "qwen3_next": _gated_delta, "qwen3_5_text": _gated_delta, "qwen3_5_moe_text": _gated_delta,
    "olmo_hybrid": _gated_delta, "lara_mini": _gated_delta,
    "kimi_linear": _kda, "bailing_hybrid": _kda,
    "lfm3": _lfm, "zaya": _zaya,
    "inkling_text": _inkling, "inkling2_text": _inkling, "inkling2_loop_text": _inkling,
}

ELSEWHERE = {"recurrent_gemma": "RecurrentGemma keeps its recurrent and conv states in the model's own modules, "
                                "not in the cache: the cache holds none of them"}
