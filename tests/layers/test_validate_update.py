"""An update is validated once, at the cache (``tiercache.layers.validate``).

Every bad input is refused with a ``CacheError`` that names the layer and what is allowed, and
the cache is left exactly as it was: its state equals that of a twin cache that never saw the
bad input, and the next valid update returns the same tensors as the twin's (and, at full
precision, as transformers' ``DynamicCache``). Policies: full precision (Llama: every layer
``full``, whose decode step writes first and lets torch refuse), sliding (Mistral: every layer
slides; Gemma 2: sliding and full layers), quantized, offloaded, both, static.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import builders as models
import tiercache.cache.tiered
import tiercache.layers.base
from tiercache import CacheError, TieredCache

B, PREFILL = 2, 7
Q = {"bits": 4, "group_size": 4, "residual_length": 6}
POLICIES = {
    "full": {},
    "sliding": {},
    "int4": {"quantize": Q},
    "host": {"offload": {"device": "cpu"}},
    "int4-host": {"quantize": Q, "offload": {"device": "cpu"}},
    "static": {"storage": "static", "max_length": 16},
    "static-int4-host": {"storage": "static", "max_length": 16, "quantize": Q, "offload": {"device": "cpu"}},
}
GRID = [(m, p) for m in ("mistral", "gemma2") for p in POLICIES] + [("llama", "full")]  # llama: no layer slides


def pair(h, dk, dv, t=1, batch=B, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, h, t, dk, generator=g).to(dtype=dtype, device=device),
            torch.randn(batch, h, t, dv, generator=g).to(dtype=dtype, device=device))


# (id, bad (key, value) for a layer of kv_shape (h, dk, dv) holding float32 batch B, the message)
BAD = [
    ("rank-3", lambda h, dk, dv: (torch.randn(B, h, dk), torch.randn(B, h, dv)), r"key must have rank 4 \[batch, heads, tokens, head_dim\]"),
    ("rank-5", lambda h, dk, dv: tuple(t[None] for t in pair(h, dk, dv)), "key must have rank 4"),
    ("tokens-differ", lambda h, dk, dv: (pair(h, dk, dv, t=2)[0], pair(h, dk, dv)[1]), r"key and value must agree on \[batch, heads, tokens\]"),
    ("key-value-dtypes", lambda h, dk, dv: (pair(h, dk, dv)[0], pair(h, dk, dv)[1].double()), "key and value differ"),
    ("heads", lambda h, dk, dv: pair(h + 1, dk, dv), r"kv head count: the layer holds \d+, the update has \d+"),
    ("key-dim", lambda h, dk, dv: pair(h, dk + 2, dv), r"key head dim: the layer holds \d+, the update has \d+"),
    ("value-dim", lambda h, dk, dv: pair(h, dk, dv - 2), r"value head dim: the layer holds \d+, the update has \d+"),
    ("batch", lambda h, dk, dv: pair(h, dk, dv, batch=B + 1), r"batch size \(use select / repeat_interleave / reorder to change it\): "
                                                             rf"the layer holds {B}, the update has {B + 1}"),
    ("dtype", lambda h, dk, dv: pair(h, dk, dv, dtype=torch.float64), "dtype: the layer holds torch.float32, the update has torch.float64"),
    ("integer", lambda h, dk, dv: tuple(t.long() for t in pair(h, dk, dv)), "key_states must be floating point, got torch.int64"),
    ("device", lambda h, dk, dv: pair(h, dk, dv, device="meta"), "device: the layer holds cpu, the update has meta"),
    ("not-a-tensor", lambda h, dk, dv: ([[0.0]], [[0.0]]), "key must be a torch.Tensor"),
]


def build(model: str, name: str, tmp_path=None) -> TieredCache:
    return TieredCache.from_policy({"name": name, **POLICIES[name]}, models._config(model)[0])


def write(caches, t: int, seed: int):
    """The same valid update on every cache (a ``DynamicCache`` too), layer by layer: the outputs."""
    outs = []
    for i in range(len(caches[0].layers)):
        h, dk, dv = caches[0].model.kv_shape(i)
        k, v = pair(h, dk, dv, t=t, seed=seed + i)
        outs.append([c.update(k.clone(), v.clone(), i) for c in caches])
    return outs


def counted(calls: list, where: str, real):
    """``real``, appending ``where`` to ``calls`` at each call."""
    def check(*args, **kwargs):
        calls.append(where)
        return real(*args, **kwargs)
    return check


def same_state(a: TieredCache, b: TieredCache) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key, x in sa.items():
        assert torch.equal(x, sb[key]) if isinstance(x, torch.Tensor) else x == sb[key], key
    assert a.nbytes() == b.nbytes() and a.get_seq_length() == b.get_seq_length()


@pytest.mark.parametrize("model,name", GRID, ids=[f"{m}-{p}" for m, p in GRID])
def test_each_bad_update_is_refused_and_leaves_the_cache_unchanged(model, name):
    cache, twin = build(model, name), build(model, name)
    full_precision = "quantize" not in POLICIES[name]
    ref = DynamicCache(config=models._config(model)[0])
    write([cache, twin, ref], PREFILL, 0)
    for i in range(len(cache.layers)):
        h, dk, dv = cache.model.kv_shape(i)
        for _, make, message in BAD:
            with pytest.raises(CacheError, match=f"^layer {i}: {message}"):
                cache.update(*make(h, dk, dv), i)
    for bad_index, message in ((len(cache.layers), "out of range"), (True, "must be an int"), ("0", "must be an int")):
        with pytest.raises(CacheError, match=f"layer_idx {message}|layer_idx .*{message}"):
            cache.update(*pair(*cache.model.kv_shape(0)), bad_index)
    same_state(cache, twin)
    for t, seed in ((3, 50), (1, 60)):  # goes on exactly as a cache that never saw them (a decode step last)
        for (k, v), (k2, v2), (k3, v3) in write([cache, twin, ref], t, seed):
            assert torch.equal(k, k2) and torch.equal(v, v2)
            if full_precision and not name.startswith("static"):  # static returns its held tokens only (not padded)
                assert torch.equal(k, k3) and torch.equal(v, v3)


@pytest.mark.parametrize("model", ["llama", "gemma2"])  # gemma2: layer 0 slides, layer 1 is bounded
@pytest.mark.parametrize("name", ["static", "static-int4-host"])
def test_tokens_past_max_length_are_refused_before_any_layer_takes_them(model, name):
    cache, twin = build(model, name), build(model, name)
    write([cache, twin], PREFILL, 0)
    h, dk, dv = cache.model.kv_shape(0)
    bounded = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    with pytest.raises(CacheError, match=f"^layer {bounded[0]}: static storage is full: it holds {PREFILL} of "
                                         "max_length=16 tokens and cannot take 10 more"):
        cache.update(*pair(h, dk, dv, t=10), 0)  # the forward's first write: no layer counts the tokens
    same_state(cache, twin)
    write([cache, twin], 16 - PREFILL, 9)  # exactly full is fine
    same_state(cache, twin)


@pytest.mark.parametrize("name", ["int4-host", "static-int4-host", "host"])
def test_an_update_is_checked_once_and_the_chain_trusts_it(name, monkeypatch):
    """The cache checks once; the layers of the chain (Quantize, Offload, storage) append without a
    check of their own. A layer used on its own checks once, at the outermost layer called."""
    calls = []

    def passing(where, real):  # the decode step's fast check: counted when it lets the update through
        def check(*args, **kwargs):
            ok = real(*args, **kwargs)
            if ok:
                calls.append(where)
            return ok
        return check

    monkeypatch.setattr(tiercache.cache.tiered, "check_update", counted(calls, "cache", tiercache.cache.tiered.check_update))
    monkeypatch.setattr(tiercache.cache.tiered, "takes_update", passing("cache", tiercache.cache.tiered.takes_update))
    monkeypatch.setattr(tiercache.layers.base, "check_update", counted(calls, "layer", tiercache.layers.base.check_update))
    cache = build("mistral", name)
    write([cache], PREFILL, 0)
    write([cache], 1, 3)
    assert calls == ["cache"] * 2 * len(cache.layers)
    calls.clear()
    layer = cache.layers[1]
    h, dk, dv = cache.model.kv_shape(1)
    before = [t.clone() for t in layer.kv()]
    with pytest.raises(CacheError, match="dtype: the layer holds torch.float32"):
        layer.update(*pair(h, dk, dv, dtype=torch.float64))
    assert all(torch.equal(a, b) for a, b in zip(before, layer.kv()))
    layer.update(*pair(h, dk, dv))
    assert calls == ["layer", "layer"]


def test_a_full_layers_decode_step_is_written_without_a_check_of_ours(monkeypatch):
    """Full-precision ``full`` layers take a decode step's token by ``FullLayer.step`` before any
    check of the cache (torch's ``index_copy_`` refuses a pair of another layout); a refused pair
    then takes the checks, which explain it."""
    calls = []
    for name in ("check_update", "takes_update"):
        monkeypatch.setattr(tiercache.cache.tiered, name, counted(calls, name, getattr(tiercache.cache.tiered, name)))
    cache, ref = build("llama", "full"), DynamicCache(config=models._config("llama")[0])
    write([cache, ref], PREFILL, 0)
    calls.clear()
    for (k, v), (k2, v2) in write([cache, ref], 1, 5):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert calls == []
    h, dk, dv = cache.model.kv_shape(0)
    key, value = pair(h, dk, dv)
    with pytest.raises(CacheError, match="^layer 0: value head dim: the layer holds"):
        cache.update(key, value[..., :-1], 0)  # the key is written, the value refused: not counted
    assert calls and cache.get_seq_length() == PREFILL + 1
    for (k, v), (k2, v2) in write([cache, ref], 1, 9):
        assert torch.equal(k, k2) and torch.equal(v, v2)
