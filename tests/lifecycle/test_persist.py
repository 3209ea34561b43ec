"""``cache.save(path, token_ids)`` / ``TieredCache.load(path, model_config, policy=None)``.

Exact (continuing a loaded cache gives the logits of continuing the saved one, bit for bit, for
every storage and processor, on Llama, Mistral (sliding), Gemma 2 and Qwen 3), compact (a
quantized save is its packed bytes), safe (atomic writes, checksums, clear errors)."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import save_file

import builders as models
from lifecycle.policies import POLICIES, filled, next_logits, policy
from tiercache import CacheError, TieredCache
from tiercache.lifecycle import persist

SAVE_POLICIES = [*POLICIES, "quanto"]


def _policy(name, tmp_path):
    if name == "quanto":
        return {"name": "quanto", "quantize": {"backend": "quanto", "bits": 4, "group_size": 8, "residual_length": 8}}
    return policy(name, tmp_path / "tier")


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "qwen3"])
@pytest.mark.parametrize("name", SAVE_POLICIES)
def test_continuing_a_loaded_cache_is_bit_identical(family, name, tmp_path):
    if name == "quanto":
        pytest.importorskip("optimum.quanto")
    model = models.build(family)
    ids, nxt = models.prompt(1, 29), models.prompt(1, 3, seed=6)
    cache = filled(model, _policy(name, tmp_path), ids)
    path = tmp_path / "c.safetensors"
    cache.save(path, token_ids=ids[0])
    loaded = TieredCache.load(path, model.config, offload_path=tmp_path / "tier")  # disk tiers: where they were
    assert loaded.token_ids == ids[0].tolist() and loaded.get_seq_length() == 29
    assert loaded.policy == cache.policy
    assert [a.nbytes() for a in loaded.layers] == [b.nbytes() for b in cache.layers]
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
    more = models.prompt(1, 1, seed=7)
    assert torch.equal(next_logits(model, loaded, more), next_logits(model, cache, more))


@pytest.mark.parametrize("name", ["int4", "int4-disk", "int2-token"])
def test_a_quantized_save_takes_about_its_nbytes(name, tmp_path):
    model = models.build("llama")
    pol = {**policy(name), "quantize": {**POLICIES[name]["quantize"], "group_size": 32, "residual_length": 32}}
    cache = filled(model, pol, models.prompt(1, 300))
    path = tmp_path / "q.safetensors"
    cache.save(path)
    head = int.from_bytes(path.read_bytes()[:8], "little")
    data = path.stat().st_size - 8 - head
    held = sum(sum(layer.nbytes().values()) for layer in cache.layers)
    assert data <= 1.05 * held, (data, held)
    fp = filled(model, policy("fp"), models.prompt(1, 300))
    fp.save(tmp_path / "fp.safetensors")
    assert path.stat().st_size < 0.4 * (tmp_path / "fp.safetensors").stat().st_size  # packed, not dequantized


def test_load_with_a_policy_retiers_on_the_way_in(tmp_path):
    model = models.build("llama")
    ids, nxt = models.prompt(1, 29), models.prompt(1, 2, seed=3)
    filled(model, policy("fp"), ids).save(tmp_path / "c.safetensors")
    loaded = TieredCache.load(tmp_path / "c.safetensors", model.config, policy=policy("int4-host"))
    ref = filled(model, policy("int4-host"), ids)
    assert loaded.policy.name == "int4-host" and set(loaded.tier_nbytes()) == {"host", "device"}
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, ref, nxt))


@pytest.fixture
def saved(tmp_path):
    model = models.build("llama")
    ids = models.prompt(1, 29)
    cache = filled(model, policy("int4"), ids)
    path = tmp_path / "c.safetensors"
    cache.save(path, token_ids=ids[0])
    return model, cache, path


def _rewrite_header(path, change):
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    meta = json.loads(head["__metadata__"]["tiercache"])
    change(meta)
    head["__metadata__"]["tiercache"] = json.dumps(meta)
    new = json.dumps(head).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(len(new).to_bytes(8, "little") + new + raw[8 + n :])


def test_a_save_from_another_model_says_which_field_differs(saved):
    _, _, path = saved
    with pytest.raises(CacheError, match="another model: model_type is 'llama' in the save, 'mistral'"):
        TieredCache.load(path, models.build("mistral").config)
    other = models.build("llama").config
    other.num_key_value_heads = 4
    with pytest.raises(CacheError, match="kv_shapes"):
        TieredCache.load(path, other)


@pytest.mark.parametrize("damage, match", [
    ("truncate", "not a readable tiercache save"),
    ("flip", "sha256"),
    ("version", "format_version 99"),
    ("format", "not a tiercache cache save"),
    ("seen", "header says 30"),
])
def test_a_damaged_save_is_a_clear_error(saved, damage, match):
    model, _, path = saved
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "flip":
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:
        key, value = {"version": ("format_version", 99), "format": ("format", "other"), "seen": ("seen", 30)}[damage]
        _rewrite_header(path, lambda m: m.__setitem__(key, value))
    with pytest.raises(CacheError, match=match):
        TieredCache.load(path, model.config)


def test_missing_paths_and_foreign_files_are_clear_errors(saved, tmp_path):
    model, cache, _ = saved
    with pytest.raises(CacheError, match="no saved cache at"):
        TieredCache.load(tmp_path / "nope.safetensors", model.config)
    with pytest.raises(CacheError, match="no saved cache at.*directory"):
        TieredCache.load(tmp_path, model.config)
    save_file({"x": torch.zeros(2)}, tmp_path / "plain.safetensors")
    with pytest.raises(CacheError, match="no tiercache header"):
        TieredCache.load(tmp_path / "plain.safetensors", model.config)
    with pytest.raises(CacheError, match="is a directory"):
        cache.save(tmp_path)
    with pytest.raises(CacheError, match="token_ids must be"):
        cache.save(tmp_path / "x.safetensors", token_ids=["a"])
    assert not (tmp_path / "x.safetensors").exists()


def test_token_ids_must_cover_every_token_the_cache_holds(saved, tmp_path):
    # fewer ids than tokens would let a caller's "my prompt extends the saved ids" check pass
    # for tokens the cache does not hold: a silently wrong continuation after load
    model, cache, _ = saved
    ids = models.prompt(1, 29)[0].tolist()
    with pytest.raises(CacheError, match="token_ids has 5 ids, the cache holds 29 tokens"):
        cache.save(tmp_path / "x.safetensors", token_ids=ids[:5])
    with pytest.raises(CacheError, match="2 row.*batch of 1"):
        cache.save(tmp_path / "x.safetensors", token_ids=[ids, ids])
    assert not (tmp_path / "x.safetensors").exists()
    cache.save(tmp_path / "g.safetensors", token_ids=ids + [9])  # a generate output: one past the cache
    assert TieredCache.load(tmp_path / "g.safetensors", model.config).token_ids == ids + [9]
    wide = filled(model, policy("fp"), models.prompt(2, 7))
    wide.save(tmp_path / "w.safetensors", token_ids=models.prompt(2, 7))
    assert TieredCache.load(tmp_path / "w.safetensors", model.config).token_ids == models.prompt(2, 7).tolist()


def test_a_failed_save_leaves_the_previous_save_whole(saved, monkeypatch):
    model, cache, path = saved
    before = path.read_bytes()
    calls, wrote = [], []
    tensors = sum(isinstance(v, torch.Tensor) for v in cache.state_dict().values())

    def dying(t):  # the process dies halfway through writing the tensors
        calls.append(1)
        if len(calls) > tensors + tensors // 2:  # (the hashing pass reads every tensor first)
            wrote.append(sorted(os.listdir(path.parent)))
            raise KeyboardInterrupt
        return real(t)

    real = persist._bytes
    monkeypatch.setattr(persist, "_bytes", dying)
    with pytest.raises(KeyboardInterrupt):
        cache.save(path)
    monkeypatch.setattr(persist, "_bytes", real)
    assert len(wrote[0]) == 2  # it died while a temporary file was half written
    assert path.read_bytes() == before
    assert sorted(os.listdir(path.parent)) == ["c.safetensors"]  # no temporary left behind
    assert TieredCache.load(path, model.config).token_ids == models.prompt(1, 29)[0].tolist()


def test_load_never_unpickles(saved, monkeypatch):
    model, cache, path = saved

    def refuse(*a, **k):
        raise AssertionError("load must not unpickle")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = TieredCache.load(path, model.config)
    assert loaded.get_seq_length() == cache.get_seq_length()


def test_a_save_from_another_device_is_loaded_where_asked(saved):
    model, cache, path = saved
    _rewrite_header(path, lambda m: [layer["state"].__setitem__("spec", {**layer["state"]["spec"], "device": "cuda:0"})
                                     for layer in m["layers"]])
    if not torch.cuda.is_available():
        with pytest.raises(CacheError, match="saved on cuda:0 and CUDA is not available here; pass device='cpu'"):
            TieredCache.load(path, model.config)
    loaded = TieredCache.load(path, model.config, device="cpu")
    nxt = models.prompt(1, 2, seed=9)
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
    with pytest.raises(CacheError, match="device must be"):
        TieredCache.load(path, model.config, device="nowhere")


def test_loading_onto_a_missing_device_names_the_device_asked(saved):
    # the message used to say the save was made on cuda (it was made on the CPU) when the caller
    # asked for device="cuda" on a machine without CUDA
    model, _, path = saved
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(CacheError, match="device='cuda' was asked and CUDA is not available here") as e:
        TieredCache.load(path, model.config, device="cuda")
    assert "saved on" not in str(e.value)
