"""``CompileableCache``: a ``TieredCache`` whose decode step ``torch.compile`` captures once.

    cache = CompileableCache.from_policy(policy, model.config)   # storage: static, max_length, quantize or not
    cc = transformers.CompileConfig(fullgraph=True); cc._compile_all_devices = True   # (on CPU; CUDA needs neither)
    model.generate(ids, **cache_arg(cache), compile_config=cc, max_new_tokens=64)

Every layer is preallocated for ``max_length`` and written by index with a device-tensor position:
full precision as ``tiercache.layers.static.StaticLayer`` (padded, counted by its device position), quantized as
``tiercache.quantize.static_layer.StaticQuantized`` (packed blocks + an exact residual ring, the
dynamic ``Quantize`` layer's quantization points). So ``is_compileable`` is True and transformers'
``generate`` compiles the model's forward for the decode steps (the prefill runs eagerly), builds the
4D mask over the fixed slots for each step, and one graph serves every position.

What differs from ``TieredCache`` (why a subclass): under ``torch.compile`` an ``update`` goes straight
to the layer (the checks of ``TieredCache.update`` compare host counters, which would make dynamo
specialize on the position and recompile every token), and ``get_seq_length`` returns the layer's
device counter. Eagerly (the prefill, a manual loop) both are ``TieredCache``'s, checks included.

The policy must give every layer ``storage: static`` (``max_length``), no offload, no sliding
window, and a quantize section the static layer supports (``static_layer.supported``); a model
with state layers or KV sharing is refused. Bad input is a ``PolicyError`` naming the layer and
what is allowed.
"""

from __future__ import annotations

import torch

from tiercache.cache.chain import Shared
from tiercache.cache.tiered import TieredCache
from tiercache.errors import PolicyError
from tiercache.layers.static import StaticLayer
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import LayerPolicy, Policy
from tiercache.quantize import static_layer
from tiercache.quantize.blocks import Codec
from tiercache.quantize.codec import CodecSpec

__all__ = ["CompileableCache", "build_static"]


class _CountedStatic(StaticLayer):
    """``StaticLayer`` (padded) whose token count is its device position under ``torch.compile``
    (a host int there would make dynamo guard on it and recompile every token), and eagerly a
    host count that eager writes keep, so an eager update never reads the device. A compiled
    step only marks that count stale (an attribute store, replayed after the graph: no guard);
    the next eager read takes the device position once (one sync after a run of compiled steps)."""

    _count = 0  # tokens held, as the eager writes left it
    _stale = False  # compiled steps moved ``position`` since

    @property
    def length(self):
        if self.position is None:
            return 0
        if torch.compiler.is_compiling():
            return self.position.clone()  # a copy: += on it
        if self._stale:
            self._count, self._stale = int(self.position), False
        return self._count

    @length.setter
    def length(self, value) -> None:
        # every writer of ``length`` has moved ``position`` to the same count
        if torch.compiler.is_compiling():
            self._stale = True
        else:
            self._count, self._stale = value, False


def build_static(lp: LayerPolicy):
    """The compileable layer of ``lp`` (module docstring), or ``PolicyError`` saying why there is none."""
    where = f"layer {lp.index} ({lp.layer_type})"
    if not lp.attends or lp.states or lp.kv_sharing is not None:
        raise PolicyError(f"{where}: a compileable cache holds attention K/V only (no recurrent state, no KV sharing)")
    if lp.window is not None:
        raise PolicyError(f"{where}: sliding window {lp.window}; a compileable cache supports full-attention layers only")
    if lp.storage != "static" or lp.max_length is None:
        raise PolicyError(f"{where}: storage {lp.storage!r}; a compileable cache needs storage: static with max_length")
    if lp.offload is not None:
        raise PolicyError(f"{where}: offload; a compileable cache keeps every layer on the compute device (offload: null)")
    q = lp.quantize
    if q is None:
        layer = _CountedStatic(lp.max_length, padded=True)
    else:
        why = static_layer.supported(q)
        if why is not None:
            raise PolicyError(f"{where}: quantize {why} is not supported by the static quantized layer")
        layer = static_layer.StaticQuantized(Codec(CodecSpec.of(q)), q.residual_length, lp.max_length)
    layer.policy = lp
    return layer


class CompileableCache(TieredCache):
    @classmethod
    def _build(cls, policy: Policy, model: ModelSpec, model_type: str | None = None) -> "CompileableCache":
        layers = [build_static(lp) for lp in cls.layer_policies(policy, model)]
        return cls(layers, policy, model, Shared(), model_type)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if torch.compiler.is_compiling():  # checked eagerly at the prefill; shapes are fixed in the graph
            return self.layers[layer_idx].append(key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0):
        if torch.compiler.is_compiling():
            layer = self.layers[layer_idx]
            return layer.position.clone() if layer.position is not None else 0
        return super().get_seq_length(layer_idx)
