"""``generate`` in every mode transformers 5.23 runs itself, with ``TieredCache`` in place of
``DynamicCache``, on tiny random Llama, Mistral (all layers sliding), Gemma 2 (sliding + full),
Qwen 3, Gemma 3n (KV sharing: layers that reuse another layer's K/V) and Jamba (hybrid: Mamba
layers that keep a conv / recurrent state between attention layers).

A full-precision policy must give exactly DynamicCache's tokens. Quantized (int4, group 2,
residual 4, so that these short sequences really quantize) and offloaded policies must run and
give the same shapes and cache lengths (``min_new_tokens`` pins the length). Group beam search
and contrastive search moved to hub ``custom_generate`` repositories in transformers 5.x, which
need the network and ``trust_remote_code``: they are skipped here.
"""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

from builders import build, prompt
from tiercache import TieredCache
from tiercache.cache.compat import cache_arg

FAMILIES = ["llama", "mistral", "gemma2", "qwen3", "gemma3n", "jamba"]
Q = {"backend": "native", "bits": 4, "group_size": 2, "residual_length": 4}
POLICIES = {
    "int4": {"name": "int4", "quantize": Q},
    "offload-cpu": {"name": "cpu", "offload": {"device": "cpu"}},
    "int4-offload": {"name": "int4-cpu", "quantize": Q, "offload": {"device": "cpu"}},
}
NEW = 8
MOVED_TO_HUB = "transformers 5.23 moved it to a hub custom_generate repo (needs the network and trust_remote_code)"
MODES = {
    "greedy": dict(),
    "sample": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam": dict(num_beams=3, num_return_sequences=2),
    "beam-sample": dict(num_beams=2, do_sample=True, top_k=20),
    "group-beam": pytest.param(dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
                               marks=pytest.mark.skip(reason=MOVED_TO_HUB)),
    "contrastive": pytest.param(dict(penalty_alpha=0.6, top_k=4), marks=pytest.mark.skip(reason=MOVED_TO_HUB)),
    "assisted": dict(assistant="draft"),
    "prompt-lookup": dict(prompt_lookup_num_tokens=3),
    "continue": dict(follow=True),
    "left-padding": dict(left_padding=True),
}


@functools.lru_cache(maxsize=None)
def model(family: str, seed: int = 0):
    return build(family, seed)


def run(family: str, cache_of, mode: dict):
    """Generate in ``mode`` with a fresh cache from ``cache_of(config)``: (tokens, cache)."""
    m = model(family)
    kw = dict(mode)
    batch = 2 if kw.pop("left_padding", False) or not any(k in kw for k in ("num_beams", "assistant",
                                                                             "prompt_lookup_num_tokens")) else 1
    ids = prompt(batch, 10)
    if mode.get("left_padding"):
        kw["attention_mask"] = torch.ones_like(ids)
        kw["attention_mask"][0, :4] = 0
    if kw.pop("assistant", None):
        kw["assistant_model"] = model(family, 3)
    follow = kw.pop("follow", False)
    cache = cache_of(m.config)
    torch.manual_seed(0)
    out = m.generate(ids, **cache_arg(cache), max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    if follow:  # the same cache again: only the tokens it has not seen are run
        more = torch.cat([out, prompt(batch, 4, seed=7)], dim=1)
        torch.manual_seed(0)
        out = m.generate(more, **cache_arg(cache), max_new_tokens=NEW, min_new_tokens=NEW, **kw)
    return out, cache


STATEFUL = {"jamba"}  # transformers refuses assisted generation (and prompt lookup) for stateful models


def refused_for_stateful(family: str, mode: dict, policy: dict) -> bool:
    """For a stateful model in a mode transformers refuses: both caches get the same refusal."""
    if family not in STATEFUL or not ("assistant" in mode or "prompt_lookup_num_tokens" in mode):
        return False
    for cache_of in (lambda c: DynamicCache(config=c), lambda c: TieredCache.from_policy(policy, c)):
        with pytest.raises(ValueError, match="not supported with stateful models"):
            run(family, cache_of, mode)
    return True


@pytest.mark.parametrize("mode", list(MODES.values()), ids=list(MODES))
@pytest.mark.parametrize("family", FAMILIES)
def test_full_precision_gives_dynamic_cache_tokens(family, mode):
    if refused_for_stateful(family, mode, {"name": "fp"}):
        return
    want, ref = run(family, lambda c: DynamicCache(config=c), mode)
    got, ours = run(family, lambda c: TieredCache.from_policy({"name": "fp"}, c), mode)
    assert torch.equal(got, want)
    assert ours.get_seq_length() == ref.get_seq_length()


LOSSY_MODES = ["greedy", "beam", "assisted", "prompt-lookup", "continue"]


@pytest.mark.parametrize("mode", LOSSY_MODES)
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_and_offloaded_policies_run(family, policy, mode):
    if refused_for_stateful(family, MODES[mode], POLICIES[policy]):
        return
    want, ref = run(family, lambda c: DynamicCache(config=c), MODES[mode])
    got, ours = run(family, lambda c: TieredCache.from_policy(POLICIES[policy], c), MODES[mode])
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(got[:, : want.shape[1] - NEW], want[:, : want.shape[1] - NEW])  # the prompt is kept
    assert ours.get_seq_length() == ref.get_seq_length()
    if "offload" in policy:
        assert torch.equal(got, want)  # offload alone is lossless
