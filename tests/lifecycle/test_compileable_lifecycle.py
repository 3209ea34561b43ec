"""A ``CompileableCache`` keeps what it is through ``fork``, ``save`` / ``load`` and ``retier``.

Each case fills a compiled static cache (full precision and int4) eagerly, then forks, saves and
loads, or re-tiers it, and checks that the result is a ``CompileableCache`` whose layers are the
same compiled kinds (the padded, device-counted ``StaticLayer``; ``StaticQuantized``), that it holds
the same state bit for bit, and that the next steps give what the original gives. The full-precision
cache is compared with a plain full-precision ``TieredCache`` fed the same tokens. A policy a
compiled cache cannot hold is refused by name and moves nothing. That a forked cache still decodes
in one graph is checked through ``generate`` with ``error_on_recompile`` (``slow``).
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from transformers import CompileConfig

from builders import build
from tiercache import CacheError, TieredCache
from tiercache.cache.compat import cache_arg
from tiercache.cache.compileable import CompileableCache
from tiercache.layers.static import StaticLayer
from tiercache.models.load import load_model
from tiercache.models.tiny import eval_ids
from tiercache.quantize.static_layer import StaticQuantized
from tests.compile_counting import Counting

INT4 = {"bits": 4, "group_size": 16, "residual_length": 32}
POLICIES = {
    "fp": {"name": "fp", "storage": "static", "max_length": 96},
    "int4": {"name": "int4", "storage": "static", "max_length": 96, "quantize": INT4},
}
KIND = {"fp": StaticLayer, "int4": StaticQuantized}


def _pair(t, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, t, 16, generator=g), torch.randn(1, 2, t, 16, generator=g)


def _steps(cache, sizes, seed=0):
    """Updates of ``sizes`` tokens on every layer; the last outputs."""
    out = None
    for i, t in enumerate(sizes):
        k, v = _pair(t, seed + i)
        out = [cache.update(k, v, layer) for layer in range(len(cache.layers))]
    return out


def _feed(cache, steps):
    """A 37-token prefill (int4: one packed residual, 5 exact) then ``steps`` one-token updates."""
    return _steps(cache, [37] + [1] * steps)


def _assert_same_kind(cache, name):
    assert type(cache) is CompileableCache and cache.is_compileable
    for layer in cache.layers:
        assert type(layer) is KIND[name] and layer.padded


def _assert_same_state(a, b):
    for x, y in zip(a.layers, b.layers):
        sx, sy = x.state_dict(), y.state_dict()
        assert sx.keys() == sy.keys()
        for key, value in sx.items():
            assert torch.equal(value, sy[key]) if isinstance(value, torch.Tensor) else value == sy[key], key


@pytest.mark.parametrize("name", POLICIES)
def test_fork_is_a_compileable_cache_of_the_same_layers(name):
    config = build("llama").config
    cache = CompileableCache.from_policy(POLICIES[name], config)
    _feed(cache, 3)
    twin = cache.fork()
    _assert_same_kind(twin, name)
    _assert_same_state(cache, twin)
    a, b = _steps(cache, [1] * 40, seed=100), _steps(twin, [1] * 40, seed=100)  # past a flush of the int4 residual
    for (ka, va), (kb, vb) in zip(a, b):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert cache.get_seq_length() == twin.get_seq_length() == 80
    for i in range(len(twin.layers)):  # independent: the original does not see it
        twin.update(*_pair(1, 500), i)
    assert cache.get_seq_length() == 80 and twin.get_seq_length() == 81


def test_full_precision_fork_holds_what_a_plain_cache_holds():
    config = build("llama").config
    cache = CompileableCache.from_policy(POLICIES["fp"], config)
    ref = TieredCache.from_policy({"name": "full"}, config)
    _feed(cache, 5)
    _feed(ref, 5)
    twin = cache.fork()
    for mine, theirs in zip(twin.layers, ref.layers):
        assert all(torch.equal(x, y) for x, y in zip(mine.kv(), theirs.kv()))
    (k, v), = [twin.update(*_pair(1, 9), 0)]
    (rk, rv) = ref.update(*_pair(1, 9), 0)
    assert k.shape[2] == 96 and torch.equal(k[:, :, :43], rk) and torch.equal(v[:, :, :43], rv)
    assert not k[:, :, 43:].any()  # the padded tail, masked by transformers


@pytest.mark.parametrize("name", POLICIES)
def test_save_and_load_give_the_same_compileable_cache(name, tmp_path):
    config = build("llama").config
    cache = CompileableCache.from_policy(POLICIES[name], config)
    _feed(cache, 4)
    cache.save(tmp_path / "c.safetensors")
    back = CompileableCache.load(tmp_path / "c.safetensors", config)
    _assert_same_kind(back, name)
    _assert_same_state(cache, back)
    a, b = _steps(cache, [1] * 30, seed=50), _steps(back, [1] * 30, seed=50)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_quantized_state_is_lossless_and_checked():
    cache = CompileableCache.from_policy(POLICIES["int4"], build("llama").config)
    _feed(cache, 0)
    sd = cache.layers[0].state_dict()
    assert sd["kind"] == "static_quantized" and sd["length"] == 37
    assert sd["krows"].shape[2] == 2 and sd["rk"].shape[2] == 5  # 32 packed tokens in 2 rows of 16, 5 exact
    bad = {**sd, "rk": sd["rk"][:, :, :4]}
    with pytest.raises(CacheError, match=r"static_quantized layer: rk should be \(1, 2, 5, 16\)"):
        cache.layers[1].load_state_dict(bad)
    with pytest.raises(CacheError, match="this is a static_quantized layer; the state is of a 'static' layer"):
        cache.layers[1].load_state_dict({**sd, "kind": "static"})


def test_retier_keeps_a_compileable_cache():
    config = build("llama").config
    cache = CompileableCache.from_policy(POLICIES["fp"], config)
    _feed(cache, 3)
    held = [layer.kv() for layer in cache.layers]
    cache.retier(POLICIES["int4"])
    _assert_same_kind(cache, "int4")
    ref = CompileableCache.from_policy(POLICIES["int4"], config)  # one update of the same 40 tokens
    for i, (k, v) in enumerate(held):
        ref.update(k, v, i)
    _assert_same_state(cache, ref)
    cache.retier(POLICIES["fp"])  # out of quantization: the dequantized values
    _assert_same_kind(cache, "fp")
    for layer, theirs in zip(cache.layers, ref.layers):
        assert all(torch.equal(x, y) for x, y in zip(layer.kv(), theirs.kv()))


@pytest.mark.parametrize("policy, why", [
    ({"name": "full"}, "storage 'full'; a compileable cache needs storage: static"),
    ({"name": "off", "storage": "static", "max_length": 96, "offload": {"device": "cpu"}}, "offload"),
    ({"name": "q", "storage": "static", "max_length": 96, "quantize": {**INT4, "residual_length": 24}},
     "residual_length 24 with group_size 16"),
])
def test_retier_refuses_a_policy_a_compileable_cache_cannot_hold(policy, why):
    cache = CompileableCache.from_policy(POLICIES["fp"], build("llama").config)
    _feed(cache, 1)
    before = [layer.kv() for layer in cache.layers]
    with pytest.raises(CacheError, match=r"retier: layer 0 \(full_attention\): .*" + why):
        cache.retier(policy)
    _assert_same_kind(cache, "fp")
    for layer, (k, v) in zip(cache.layers, before):
        assert torch.equal(layer.kv()[0], k) and torch.equal(layer.kv()[1], v)


@pytest.mark.slow
@pytest.mark.parametrize("name", POLICIES)
def test_a_forked_cache_decodes_in_one_graph(name):
    model, tok = load_model("tiny")
    ids = eval_ids(tok, 30)[None]  # [1, 30]
    cache = CompileableCache.from_policy({**POLICIES[name], "max_length": 80}, model.config)
    with torch.no_grad():
        model(ids[:, :-1], **cache_arg(cache))  # the prompt but its last token, eagerly
    twin = cache.fork()
    backend = Counting()
    cc = CompileConfig(fullgraph=True, backend=backend, dynamic=False)
    cc._compile_all_devices = True  # transformers compiles on CPU only when asked
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.no_grad():
        out = model.generate(ids, **cache_arg(twin), max_new_tokens=20, do_sample=False, compile_config=cc)
    assert backend.graphs == 1
    ref = CompileableCache.from_policy({**POLICIES[name], "max_length": 80}, model.config)
    with torch.no_grad():  # the same cache, never forked, eagerly
        want = model.generate(ids, **cache_arg(ref), max_new_tokens=20, do_sample=False)
    assert torch.equal(out, want)
