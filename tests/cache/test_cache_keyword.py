"""The cache keyword (issue 31): every call this package makes into a model or ``generate``
passes the cache under the name the installed transformers expects (``tiercache.cache.compat``),
so none triggers transformers' ``past_key_values`` deprecation FutureWarning.

pyproject's pytest ``filterwarnings`` makes that warning an error for the whole suite; the
tests here make it an error locally too, so they fail even when run with other options.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import tiercache
from builders import build, prompt
from tiercache import TieredCache
from tiercache.cache.compat import CACHE_KW, cache_arg, output_cache

DEPRECATED = r"`past_key_values` is deprecated"


def test_keyword_follows_the_installed_transformers():
    has_cache = "cache" in CausalLMOutputWithPast.__dataclass_fields__
    assert CACHE_KW == ("cache" if has_cache else "past_key_values")
    assert cache_arg(42) == {CACHE_KW: 42}


@pytest.mark.skipif(CACHE_KW != "cache", reason="transformers predates the `cache` keyword")
def test_the_old_keyword_warns_so_the_filter_has_teeth():
    model = build("llama")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message=DEPRECATED, category=FutureWarning)
        with pytest.raises(FutureWarning, match="past_key_values"):
            model(prompt(1, 4), past_key_values=TieredCache.from_policy({"name": "fp"}, model.config))


def test_forward_generate_and_chunked_prefill_raise_no_deprecation_warning():
    model = build("llama")
    cache = TieredCache.from_policy({"name": "fp"}, model.config)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("error", message=DEPRECATED, category=FutureWarning)
        out = model(prompt(1, 6), **cache_arg(cache), use_cache=True)
        assert output_cache(out) is cache and cache.get_seq_length() == 6
        gen = model.generate(prompt(1, 6), **cache_arg(TieredCache.from_policy({"name": "fp"}, model.config)),
                             max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        assert isinstance(output_cache(gen), TieredCache)
        ids = tiercache.generate(model, prompt(1, 9), TieredCache.from_policy({"name": "fp"}, model.config),
                                 prefill_chunk=4, max_new_tokens=3, do_sample=False)
        assert ids.shape == (1, 12)
