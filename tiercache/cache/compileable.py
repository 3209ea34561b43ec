"""``CompileableCache``: a ``TieredCache`` whose decode step ``torch.compile`` captures once.

    cache = CompileableCache.from_policy(policy, model.config)   # storage: static, max_length, quantize or not
    cc = transformers.CompileConfig(fullgraph=True); cc._compile_all_devices = True   # (on CPU; CUDA needs neither)
    model.generate(ids, **cache_arg(cache), compile_config=cc, max_new_tokens=64)

The chain builder makes it in its ``compiled`` mode (``tiercache.cache.chain.build_layers``): every
layer is preallocated for ``max_length`` and written by index with a device-tensor position, full
precision as a padded ``tiercache.layers.static.StaticLayer`` (counted by its device position under
compile), quantized as ``tiercache.quantize.static_layer.StaticQuantized`` (packed blocks + an
exact residual ring, the dynamic ``Quantize`` layer's quantization points). So ``is_compileable``
is True and transformers' ``generate`` compiles the model's forward for the decode steps (the
prefill runs eagerly), builds the 4D mask over the fixed slots for each step, and one graph serves
every position. Under ``torch.compile`` the sequence length is the layer's device counter and
the room of a layer is not checked (``layers.validate.check_room``: eagerly only).

The policy must give every layer ``storage: static`` (``max_length``), no offload, no sliding
window, and a quantize section the static layer supports (``static_layer.supported``); a model
with state layers or KV sharing is refused. Bad input is a ``PolicyError`` naming the layer and
what is allowed. ``fork`` / ``copy.deepcopy``, ``save`` / ``load`` give a ``CompileableCache``
with the same layer kinds (bit-exact); ``retier`` keeps it one, refusing a policy it cannot hold.
"""

from __future__ import annotations

from tiercache.cache.tiered import TieredCache

__all__ = ["CompileableCache"]


class CompileableCache(TieredCache):
    compiled = True
