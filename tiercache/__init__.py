"""tiercache: a memory-tiered KV cache for LLM generation.

Public API: ``load_policy``, ``Policy``, ``TieredCache``, ``plan``, ``generate`` (chunked prefill,
then ``model.generate``), ``PolicyError``, ``CacheError`` (and ``TieredEncoderDecoderCache``, what
``TieredCache.for_encoder_decoder`` returns; ``CompileableCache``, the static cache whose decode step
``torch.compile`` captures once: ``tiercache.cache.compileable``).
``TieredCache`` and ``plan`` are imported lazily so that the torch-only parts load without
transformers.
"""

from tiercache.errors import CacheError, PolicyError
from tiercache.policy.schema import Policy, load_policy

__version__ = "0.1.0"

__all__ = ["CacheError", "CompileableCache", "Policy", "PolicyError", "TieredCache", "TieredEncoderDecoderCache",
           "generate", "load_policy", "plan"]


def __getattr__(name):
    if name in ("TieredCache", "TieredEncoderDecoderCache"):
        from tiercache.cache import tiered as cache

        return getattr(cache, name)
    if name == "CompileableCache":
        from tiercache.cache.compileable import CompileableCache

        return CompileableCache
    if name in ("plan", "Plan"):
        from tiercache.planner import api as planner

        return getattr(planner, name)
    if name == "generate":
        from tiercache.cache.prefill import generate

        return generate
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
