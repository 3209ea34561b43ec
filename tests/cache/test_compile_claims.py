"""``is_compileable`` is a promise: a cache that makes it decodes in one compiled graph.

transformers' ``generate`` compiles the decode step of a cache that reports ``is_compileable``;
each such cache here runs through it with ``fullgraph=True`` and ``error_on_recompile`` (a graph
break or a recompile per token fails) and a backend that counts its graphs, and gives the tokens
a plain full-precision cache gives. Caches that cannot keep the promise do not make it.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from builders import build
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.compileable import CompileableCache
from tiercache.models.load import load_model
from tiercache.models.tiny import eval_ids
from tests.compile_counting import Counting

STATIC = {"name": "static", "storage": "static", "max_length": 64}
CLAIMS = [
    pytest.param(TieredCache, STATIC, id="tiered-static-fp"),
    pytest.param(CompileableCache, STATIC, id="compileable-fp"),
]
NO_CLAIM = [
    pytest.param({**STATIC, "quantize": {"bits": 4}}, id="static-int4"),
    pytest.param({**STATIC, "offload": {"device": "cpu"}}, id="static-offload"),
    pytest.param({"name": "full"}, id="full"),
    pytest.param({**STATIC, "overrides": [{"layers": [1], "quantize": {"bits": 4}}]}, id="one-layer-int4"),
]


@pytest.mark.slow
@pytest.mark.parametrize("cls, policy", CLAIMS)
def test_a_cache_that_claims_compileable_decodes_in_one_graph(cls, policy):
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 20)[None]  # [1, 20]
    cache = cls.from_policy(policy, model.config)
    assert cache.is_compileable
    backend = Counting()
    cc = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on CPU only when asked
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        out = model.generate(ids, **cache_arg(cache), max_new_tokens=12, do_sample=False, compile_config=cc)
    assert backend.graphs == 1 and not torch._dynamo.utils.counters["graph_break"]
    with torch.no_grad():
        want = model.generate(ids, **cache_arg(TieredCache.from_policy({"name": "full"}, model.config)),
                              max_new_tokens=12, do_sample=False)
    assert torch.equal(out, want)


@pytest.mark.parametrize("policy", NO_CLAIM)
def test_a_cache_that_cannot_compile_once_does_not_claim_it(policy):
    assert not TieredCache.from_policy(policy, build("llama").config).is_compileable
