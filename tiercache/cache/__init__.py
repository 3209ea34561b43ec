"""The cache transformers talks to: ``TieredCache`` and how it is built.

Modules: ``tiered`` (``TieredCache``, the ``transformers.Cache`` subclass), ``encoder_decoder`` (the pair
of an encoder-decoder model: both halves' lifecycle and bytes), ``chain`` (the chain
builder, the only constructor of a layer's processors, from the planner's ``ChainSpec``),
``fork`` / ``retier`` (a copy; a live cache moved to another policy), ``legacy`` (tuple caches in
and out), ``inputs`` (a policy for a model, ``auto`` planned), ``layer_roles`` (which layer is a
KV-sharing placeholder, stores K/V or keeps a state: one table), ``prefill`` (chunked prefill and
``tiercache.generate``), ``compat`` (the keyword a cache is passed under), ``side_state`` (a layer's
chain plus an exact side state) and its kinds: ``state_layer`` (hybrid and recurrent models' conv /
recurrent states), ``indexed_layer`` / ``compressed_layer`` (sparse attention's indexer keys,
DeepSeek-V4's compressor state).

``TieredCache``, ``TieredEncoderDecoderCache`` and ``generate`` are imported lazily, so that
``tiercache.cache.chain`` loads without transformers.
"""


def __getattr__(name):
    if name in ("TieredCache", "TieredEncoderDecoderCache"):
        from tiercache.cache import tiered

        return getattr(tiered, name)
    if name == "generate":
        from tiercache.cache.prefill import generate

        return generate
    raise AttributeError(f"module 'tiercache.cache' has no attribute {name!r}")
