"""Packed decode attention inside ``generate``: the same tokens as the dequantize-then-SDPA path.

The built-in trained tiny Llama (greedy, int4 and int2 with sinks, a 300-token prompt so blocks are
packed and flushed while decoding), and tiny random models of every family (full, sliding and
GQA layers; gemma2/3 run eager attention here: the fallback) with a padded batch.
"""

from __future__ import annotations

import pytest
import torch

from builders import FAMILIES, build, prompt
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.models.load import load_model
from tiercache.models.tiny import eval_ids
from tiercache.quantize import packed_kv

TINY_POLICIES = [
    pytest.param({"bits": 4, "group_size": 32, "residual_length": 64}, id="int4"),
    pytest.param({"bits": 2, "group_size": 32, "residual_length": 64, "sink_tokens": 4, "key_gain": 1.2},
                 id="int2-sinks-gain"),
]


def cache_for(config, q, packed):
    return TieredCache.from_policy({"name": "p", "quantize": {**q, "packed_attention": packed}}, config)


class Calls:
    """Counts the SDPA calls answered from packed codes."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = packed_kv.attend

        def counted(*a, **k):
            self.n += 1
            return real(*a, **k)

        monkeypatch.setattr(packed_kv, "attend", counted)


@pytest.mark.parametrize("q", TINY_POLICIES)
def test_tiny_model_generates_the_same_tokens(q, monkeypatch):
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 300)[None]
    calls = Calls(monkeypatch)
    outs = []
    for packed in (True, False):
        cache = cache_for(model.config, q, packed)
        with torch.no_grad():
            outs.append(model.generate(ids, **cache_arg(cache), max_new_tokens=40, do_sample=False))
    assert calls.n == 39 * model.config.num_hidden_layers  # every decode step of every layer, none of the prefill
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("family", FAMILIES)
def test_families_logits_match(family, monkeypatch):
    model = build(family)
    ids = prompt(2, 14)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: a mask reaches attention
    q = {"bits": 4, "group_size": 4, "residual_length": 4}
    calls = Calls(monkeypatch)
    logits = []
    for packed in (True, False):
        cache = cache_for(model.config, q, packed)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **cache_arg(cache), max_new_tokens=8, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        logits.append(torch.stack(out.logits))
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)
    if model.config._attn_implementation == "sdpa":  # eager attention (gemma2/3 here) reads the dequantized tensors
        assert calls.n > 0
