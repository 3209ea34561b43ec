"""The keyword a cache is passed under, decided once for the installed transformers.

transformers 5.24 renamed ``past_key_values`` to ``cache`` (models' ``forward``: the old name
removed in 5.40; ``generate``: in 6.0) and model outputs carry ``.cache``. Every call this
package makes into a model or ``generate`` goes through this module:

    from tiercache.cache.compat import CACHE_KW, cache_arg, output_cache
    model(input_ids=x, **cache_arg(cache), use_cache=True)       # cache= or past_key_values=
    model.generate(ids, **cache_arg(cache), max_new_tokens=8)
    output_cache(out)                                             # out.cache or out.past_key_values

``CACHE_KW`` is ``"cache"`` when the installed transformers' causal-LM outputs have a ``cache``
field (the rename came with it), else ``"past_key_values"``.
"""

from __future__ import annotations

from transformers.modeling_outputs import CausalLMOutputWithPast


def _cache_keyword() -> str:
    fields = getattr(CausalLMOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


CACHE_KW: str = _cache_keyword()


def cache_arg(cache) -> dict:
    """``{CACHE_KW: cache}``: the cache under the name the installed transformers expects."""
    return {CACHE_KW: cache}


def output_cache(output):
    """The cache a model output (or ``generate(..., return_dict_in_generate=True)``) carries back."""
    return getattr(output, CACHE_KW)
