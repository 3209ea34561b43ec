"""What a file cannot make ``TieredCache.load`` do: create files where its header says, allocate
more than the file's size allows. Fuzzed from real saves: every damaged or hostile file is a
``CacheError`` (or, where the damage is harmless, a cache), never another exception and never
an allocation past the bound."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import builders as models
from lifecycle.policies import filled, next_logits, policy
from tiercache import CacheError, TieredCache
from tiercache.lifecycle import bounds
from tiercache.models.spec import spec_of

SAVED = ["fp", "int4", "static", "disk", "int2-sinks-clip", "mixed"]


@pytest.fixture(scope="module")
def model():
    return models.build("llama")


@pytest.fixture(scope="module")
def saves(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("saves")
    out = {}
    for name in SAVED:
        ids = models.prompt(1, 29)
        cache = filled(model, policy(name, d / "tier"), ids)
        out[name] = (d / f"{name}.safetensors")
        cache.save(out[name], token_ids=ids[0])
        cache.close()
    return out


def split(raw: bytes):
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8:8 + n])
    return head, json.loads(head["__metadata__"]["tiercache"]), raw[8 + n:]


def join(head: dict, meta, data: bytes) -> bytes:
    head = {**head, "__metadata__": {"tiercache": json.dumps(meta)}}
    text = json.dumps(head).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


@contextlib.contextmanager
def allocations():
    """Every tensor allocation torch is asked for, in bytes (empty, zeros, full, ones, from_file)."""
    asked = []
    real_empty = torch.empty

    def size(dtype) -> int:
        return real_empty((), dtype=dtype or torch.float32).element_size()

    def watch(fn, sized):
        def wrapped(*args, **kw):
            asked.append(sized(args, kw))
            return fn(*args, **kw)
        return wrapped

    def nbytes(shape, kw):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = shape[0]
        numel = 1
        for s in shape:
            numel *= int(s)
        return numel * size(kw.get("dtype"))

    real = {name: getattr(torch, name) for name in ("empty", "zeros", "ones", "full", "from_file")}
    patched = {
        "empty": watch(real["empty"], lambda a, k: nbytes(a, k)),
        "zeros": watch(real["zeros"], lambda a, k: nbytes(a, k)),
        "ones": watch(real["ones"], lambda a, k: nbytes(a, k)),
        "full": watch(real["full"], lambda a, k: nbytes(a[:1], k)),
        "from_file": watch(real["from_file"], lambda a, k: int(k.get("size", 0)) * size(k.get("dtype"))),
    }
    for name, fn in patched.items():
        setattr(torch, name, fn)
    try:
        yield asked
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)


def load_or_refuse(path, model, **kw):
    """The cache, or None when refused with CacheError; any other exception fails the test."""
    try:
        cache = TieredCache.load(path, model.config, **kw)
    except CacheError:
        return None
    cache.close()
    return cache


# -- files outside -------------------------------------------------------------------------------
def test_a_saved_offload_path_is_never_used(model, tmp_path):
    theirs, ours = tmp_path / "their-disk", tmp_path / "our-disk"
    ids = models.prompt(1, 29)
    cache = filled(model, policy("disk", theirs), ids)
    cache.save(tmp_path / "c.safetensors", token_ids=ids[0])
    cache.close()
    os.rmdir(theirs)  # (the tier's own directory went with close)
    loaded = TieredCache.load(tmp_path / "c.safetensors", model.config)
    assert set(loaded.tier_nbytes()) == {"disk"} and not theirs.exists()  # under the system temp dir
    assert loaded.policy.offload.path is None
    there = TieredCache.load(tmp_path / "c.safetensors", model.config, offload_path=ours)
    assert not theirs.exists() and any(ours.iterdir()) and there.policy.offload.path == str(ours)
    nxt = models.prompt(1, 3, seed=4)
    ref = filled(model, policy("fp"), ids)
    assert torch.equal(next_logits(model, there, nxt), next_logits(model, ref, nxt))
    there.close(), loaded.close()
    assert not any(ours.iterdir())


# -- allocations bounded by the file -------------------------------------------------------------
def test_a_claimed_capacity_is_bounded_by_the_tokens_held(model, saves, tmp_path):
    head, meta, data = split(saves["fp"].read_bytes())
    for layer in meta["layers"]:
        layer["state"]["buffer.capacity"] = 10**12  # a 25 kB file asking for terabytes
    path = tmp_path / "big.safetensors"
    path.write_bytes(join(head, meta, data))
    with allocations() as asked:
        cache = TieredCache.load(path, model.config)
    assert max(asked) <= bounds.max_bytes_for(path.stat().st_size, spec_of(model.config))
    assert sum(cache.nbytes().values()) <= 3 * 2 * (29 + 512) * 2 * 16 * 4  # held + two chunks of room
    nxt = models.prompt(1, 3, seed=4)
    assert torch.equal(next_logits(model, cache, nxt),
                       next_logits(model, TieredCache.load(saves["fp"], model.config), nxt))


def test_a_preallocation_past_the_bound_is_refused_before_allocating(model, saves, tmp_path):
    head, meta, data = split(saves["static"].read_bytes())
    meta["policy"]["max_length"] = 10**9
    path = tmp_path / "static.safetensors"
    path.write_bytes(join(head, meta, data))
    with allocations() as asked, pytest.raises(CacheError, match=r"would allocate .* over its bound .*max_bytes="):
        TieredCache.load(path, model.config)
    assert max(asked, default=0) <= bounds.max_bytes_for(path.stat().st_size, spec_of(model.config))


def test_a_long_static_cache_loads_with_max_bytes(model, tmp_path):
    ids = models.prompt(1, 29)
    pol = {"name": "long-static", "storage": "static", "max_length": 8192}
    cache = filled(model, pol, ids)
    path = tmp_path / "s.safetensors"
    cache.save(path, token_ids=ids[0])
    with pytest.raises(CacheError, match="max_bytes"):
        TieredCache.load(path, model.config)
    need = sum(cache.nbytes().values())
    loaded = TieredCache.load(path, model.config, max_bytes=need + 2**20)
    nxt = models.prompt(1, 3, seed=4)
    assert torch.equal(next_logits(model, loaded, nxt), next_logits(model, cache, nxt))
    with pytest.raises(CacheError, match="max_bytes must be an int"):
        TieredCache.load(path, model.config, max_bytes=-1)


# -- fuzzing ---------------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)
SIZES = st.sampled_from([0, 1, -1, 7, 2**31, 10**9, 10**12, 2**63, 2**64 + 1])


def _paths(node, at=()):
    """Every (path, value) in a JSON tree."""
    yield at, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield from _paths(value, (*at, key))


def _set(node, at, value):
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = value


@st.composite
def damaged(draw, saves):
    name = draw(st.sampled_from(SAVED))
    raw = saves[name].read_bytes()
    how = draw(st.sampled_from(["meta", "meta-size", "tensor-header", "truncate", "flip", "random"]))
    if how == "random":
        return draw(st.binary(max_size=256))
    if how == "truncate":
        return raw[:draw(st.integers(0, len(raw) - 1))]
    if how == "flip":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            at = draw(st.integers(0, len(raw) - 1))
            out[at] ^= draw(st.integers(1, 255))
        return bytes(out)
    head, meta, data = split(raw)
    if how == "tensor-header":
        tname = draw(st.sampled_from(sorted(k for k in head if k != "__metadata__")))
        field = draw(st.sampled_from(["shape", "data_offsets", "dtype"]))
        head[tname][field] = draw(st.lists(SIZES, min_size=1, max_size=4) if field != "dtype"
                                  else st.sampled_from(["F32", "U8", "F64", "I64", "BOOL", "nope"]))
        return join(head, meta, data)
    paths = [p for p, _ in _paths(meta) if p]
    at = draw(st.sampled_from(paths))
    _set(meta, at, draw(SIZES if how == "meta-size" else JSON))
    return join(head, meta, data)


def test_fuzzed_saves_are_refused_cleanly_and_allocate_within_the_bound(model, saves, tmp_path):
    path = tmp_path / "fuzz.safetensors"
    outcomes = {"refused": 0, "loaded": 0}

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(damaged(saves))
    def check(raw):
        path.write_bytes(raw)
        bound = bounds.max_bytes_for(len(raw), spec_of(model.config))
        with allocations() as asked:
            cache = load_or_refuse(path, model)
        outcomes["refused" if cache is None else "loaded"] += 1
        assert max(asked, default=0) <= bound, (max(asked), bound)

    check()
    assert outcomes["refused"] > 100, outcomes  # (most damage is caught)
