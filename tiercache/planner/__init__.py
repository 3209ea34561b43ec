"""The planner: what a policy costs before it runs.

Modules: ``api`` (``plan``, ``fits_card``, ``choose``, ``main_plan``: the entry points), ``concrete`` (the per-layer
plan of one concrete policy and ``Plan``), ``resolve`` (a model name, a built-in model or a
config.json -> ``ModelSpec``), ``chainspec`` (a layer policy's chain, pure: what the chain builder
of ``tiercache.cache`` builds and the planner prices), ``cross_attention`` (the layer policies of
an encoder-decoder model's cross-attention half), ``footprint`` (bytes of one layer's chain per tier), ``ladder``
(``auto``: the least lossy rung that fits), ``run`` / ``whole`` / ``activations`` / ``weights`` (the
whole footprint of a run: weights, activations, growth), ``table`` (the text table), ``units``
(byte formatting), ``hostmem`` (the host's free memory). Torch-only; no transformers import.
"""


def __getattr__(name):
    if name in ("plan", "Plan", "choose", "fits_card"):
        from tiercache.planner import api

        return getattr(api, name)
    raise AttributeError(f"module 'tiercache.planner.api' has no attribute {name!r}")
