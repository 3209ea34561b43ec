"""Quantized policies inside transformers' generate on tiny random models of every family.

Small groups and residuals (4 tokens) so a 14-token prompt already packs blocks, on full and
sliding (window 8) layers alike; transformers' own QuantizedCache refuses the sliding ones.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from builders import FAMILIES, MORE_FAMILIES, build, prompt
from tiercache import TieredCache
from tiercache.quantize.processor import Quantize
from tiercache.cache.compat import cache_arg


def policy(bits=4, fmt="int", backend="native", **extra):
    q = {"backend": backend, "bits": bits, "format": fmt, "group_size": 4, "residual_length": 4}
    return {"name": f"q{bits}", "quantize": q, **extra}


MODES = {
    "greedy": dict(),
    "beam": dict(num_beams=3, num_return_sequences=2, max_new_tokens=10),
}


def gen(model, cache, ids, **kw):
    torch.manual_seed(0)
    kw.setdefault("max_new_tokens", 16)
    kw.setdefault("do_sample", False)
    return model.generate(ids, **cache_arg(cache), **kw)


def logits_error(model, ours, ids, steps: int = 6) -> float:
    """Relative error of ``ours``' logits against ``DynamicCache``'s after a prefill of ``ids`` and
    ``steps`` greedy steps (both fed full precision's tokens)."""
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        a = model(ids, **cache_arg(ref), use_cache=True).logits
        b = model(ids, **cache_arg(ours), use_cache=True).logits
        for _ in range(steps):
            nxt = a[:, -1:].argmax(-1)
            a = model(nxt, **cache_arg(ref), use_cache=True).logits
            b = model(nxt, **cache_arg(ours), use_cache=True).logits
    return ((a - b).norm() / a.norm()).item()


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_with_quantized_policy(family, mode):
    model = build(family)
    ids = prompt(2 if mode != "beam" else 1, 14)
    cache = TieredCache.from_policy(policy(), model.config)
    out = gen(model, cache, ids, **MODES[mode])
    new = MODES[mode].get("max_new_tokens", 16)
    assert out.shape[1] == 14 + new
    assert all(isinstance(layer, Quantize) for layer in cache.layers)
    assert cache.get_seq_length() == 14 + new - 1
    if family == "gemma3":
        again = gen(model, TieredCache.from_policy(policy(), model.config), ids, **MODES[mode])
        assert torch.equal(out, again)  # deterministic


@pytest.mark.parametrize("family", FAMILIES)
def test_assisted_generation_with_quantized_policy(family):
    model, assistant = build(family), build(family, seed=3)
    ids = prompt(1, 10)
    cache = TieredCache.from_policy(policy(), model.config)
    out = gen(model, cache, ids, assistant_model=assistant, max_new_tokens=20)
    assert out.shape[1] == 30 and cache.get_seq_length() in (29, 30)


@pytest.mark.parametrize("family", ["mistral", "gemma2", "gemma3"])
def test_sliding_layers_left_in_full_precision_by_override(family):
    model = build(family)
    p = policy(overrides=[{"layer_type": "sliding_attention", "quantize": None}])
    cache = TieredCache.from_policy(p, model.config)
    gen(model, cache, prompt(1, 14))
    kinds = [(layer.is_sliding, isinstance(layer, Quantize)) for layer in cache.layers]
    assert all(not q for sliding, q in kinds if sliding) and all(q for sliding, q in kinds if not sliding)


@pytest.mark.parametrize("fmt,bits,tol", [("int", 8, 0.02), ("fp8", 8, 0.1), ("int", 4, 0.3)], ids=["int8", "fp8", "int4"])
@pytest.mark.parametrize("family", ["llama", "mistral", "gemma3"])
def test_logits_close_to_full_precision(family, fmt, bits, tol):
    model = build(family)
    ids = prompt(2, 24)
    assert logits_error(model, TieredCache.from_policy(policy(bits, fmt), model.config), ids) < tol


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_meta_bits_8_in_generate(family):
    """Scales and offsets as bytes on every family: int8 codes stay as close to full precision as
    int8 with dtype metadata is held to, and beam search (reorders of the byte rows) runs."""
    model = build(family)
    ids = prompt(2, 24)
    meta8 = {"meta_bits": 8, "sink_tokens": 2}
    ours = TieredCache.from_policy({"name": "q8m8", "quantize": {**policy(8)["quantize"], **meta8}}, model.config)
    assert logits_error(model, ours, ids) < 0.02
    cache = TieredCache.from_policy({"name": "q4m8", "quantize": {**policy(4)["quantize"], **meta8}}, model.config)
    out = gen(model, cache, prompt(1, 14), **MODES["beam"])
    assert out.shape == (2, 24) and cache.get_seq_length() == 23


def test_quanto_and_hqq_backends_generate():
    model = build("gemma3")
    for backend, bits in (("quanto", 2), ("hqq", 3)):
        cache = TieredCache.from_policy(policy(bits, backend=backend), model.config)
        assert gen(model, cache, prompt(1, 14), max_new_tokens=8).shape[1] == 22


def test_static_quantized_policy():
    model = build("llama")
    cache = TieredCache.from_policy(policy(storage="static", max_length=40), model.config)
    out = gen(model, cache, prompt(1, 14))
    assert out.shape[1] == 30 and cache.layers[0].max_length() == 40
