"""``ChainSpec``: one pure spec per layer from its LayerPolicy, and ``build(spec)`` the only constructor.

The spec is checked for purity (deterministic, hashable, equal for equal policies, made by
modules that import no torch), for telling policies apart where the chains differ, and
``build(spec)`` against a chain assembled by hand from the public constructors
(``make_storage``, ``offloaded``, ``Quantize(inner, Codec)``, ``CrossAttention``) for every preset
in ``configs/``: the same structure, state dict (keys, types, tensors) and outputs.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import tiercache
from tiercache.cache.chain import Shared, build, build_layers, make_storage
from tiercache.planner.chainspec import spec_for
from tiercache.errors import CacheError
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import LayerPolicy, OffloadPolicy, QuantizePolicy, load_policy
from tiercache.quantize.blocks import Codec
from tiercache.quantize.codec import CodecSpec
from tiercache.layers.cross import CrossAttention
from tiercache.quantize.geometry import static_rows, store_window
from tiercache.offload.processor import offloaded
from tiercache.quantize.processor import Quantize

ROOT = Path(tiercache.__file__).parent
CONFIGS = sorted(p for p in (ROOT.parent / "configs").glob("*.yaml") if not load_policy(p).auto)
MODELS = [
    ModelSpec("llama", 2, ("full_attention", "full_attention"), 2, 16, dtype="float32"),
    ModelSpec("gemma", 2, ("sliding_attention", "full_attention"), 2, 16, sliding_window=40, dtype="float32"),
]
Q4 = QuantizePolicy(bits=4, group_size=16, residual_length=32)


def models_for(path) -> list[ModelSpec]:
    """``MODELS``, widened (their layer types repeated) when the policy's overrides name more layers
    than they have: a policy written for a 32-layer model names indices up to 31."""
    named = max((i + 1 if i >= 0 else -i for o in load_policy(path).overrides for i in (o.layers or ())), default=0)
    if named <= min(m.num_layers for m in MODELS):
        return MODELS
    n = named + 2
    return [dataclasses.replace(m, num_layers=n, layer_types=tuple(m.layer_types[i % m.num_layers] for i in range(n)))
            for m in MODELS]


def lp(storage="full", window=None, max_length=None, quantize=None, offload=None, kv_sharing=None,
       layer_type=None):
    layer_type = layer_type or ("sliding_attention" if window else "full_attention")
    return LayerPolicy(0, layer_type, storage, window, max_length, quantize, offload, kv_sharing)


def resolved(path, model, tmp_path):
    """The preset's layer policies for ``model``, disk tiers under ``tmp_path``."""
    out = []
    for p in load_policy(path).resolve(model):
        if p.offload is not None and p.offload.device == "disk":
            p = dataclasses.replace(p, offload=dataclasses.replace(p.offload, path=str(tmp_path)))
        out.append(p)
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_spec_is_pure_hashable_and_equal_for_equal_policies(path):
    for model in models_for(path):
        for p in load_policy(path).resolve(model):
            twin = LayerPolicy(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})  # equal, not the same
            a, b = spec_for(p), spec_for(twin)
            assert a == b and hash(a) == hash(b) and len({a, b}) == 1
            assert spec_for(p) == a  # deterministic
            with pytest.raises(dataclasses.FrozenInstanceError):
                a.index = 1  # type: ignore[misc]
            assert a.policy == p and a.index == p.index


def _imports(path: Path) -> set[str]:
    """Modules ``path`` imports at load time (its top-level import statements)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_spec_and_allocation_rules_import_no_torch():
    """The spec and the rules it is made of are plain integers: none of them imports torch."""
    modules = ["planner/chainspec.py", "layers/capacity.py", "quantize/codec.py", "quantize/geometry.py", "policy/schema.py",
               "policy/fields.py", "policy/backends.py"]
    for name in modules:
        imported = _imports(ROOT / name)
        assert not {m for m in imported if m.split(".")[0] == "torch"}, name
        for m in imported:  # only the other torch-free modules of this list, within tiercache
            if m.startswith("tiercache.") and m != "tiercache.errors":
                assert m.removeprefix("tiercache.").replace(".", "/") + ".py" in modules, (name, m)


def test_specs_differ_where_the_chains_do():
    base = spec_for(lp(quantize=Q4))
    bits = spec_for(lp(quantize=dataclasses.replace(Q4, bits=2)))
    assert bits.quantize.codec != base.quantize.codec and bits.store == base.store
    residual = spec_for(lp(quantize=dataclasses.replace(Q4, residual_length=64)))
    assert residual.quantize.codec == base.quantize.codec and residual.quantize != base.quantize
    host = spec_for(lp(quantize=Q4, offload=OffloadPolicy()))
    assert host.quantize == base.quantize and host.store == base.store and host.offload == OffloadPolicy()
    assert spec_for(lp(quantize=Q4, kv_sharing="store")).owned_outputs and not base.owned_outputs
    assert spec_for(lp(layer_type="cross_attention")).cross and not base.cross
    # geometry: a full-precision layer's store in tokens, a quantized one's in blocks
    assert spec_for(lp("sliding", window=40)).store.window == 40
    assert spec_for(lp("sliding", window=40, quantize=Q4)).store.window == store_window(40, 16) == 4
    assert spec_for(lp("static", max_length=100)).store.max_length == 100
    assert spec_for(lp("static", max_length=100, quantize=Q4)).store.max_length == static_rows(100, 16) == 6
    assert base.store.kind == "full" and base.store.chunk == 1 and spec_for(lp()).store.chunk == 256
    # padded only for a resident store; sinks only on full-attention layers
    assert spec_for(lp("static", max_length=100), padded=True).store.padded
    assert not spec_for(lp("static", max_length=100, offload=OffloadPolicy()), padded=True).store.padded
    sinks = dataclasses.replace(Q4, sink_tokens=4)
    assert spec_for(lp(quantize=sinks)).quantize.sinks == 4
    assert spec_for(lp("sliding", window=40, quantize=sinks)).quantize.sinks == 0


def by_hand(p: LayerPolicy, shared: Shared, padded: bool):
    """The chain of ``p`` assembled from the public constructors, as the builder did before specs."""
    window, limit = p.window, (p.max_length if p.storage == "static" else None)
    q, owned = p.quantize, p.kv_sharing == "store"
    rows = None
    if q is not None:
        g = q.group_size
        window, limit, rows = (store_window(window, g) if window else None), (static_rows(limit, g) if limit else None), 1
    chunk = rows or 256
    if p.offload is None:
        layer = make_storage(window, limit, chunk=chunk, padded=padded)
    else:
        layer = offloaded(lambda tier: make_storage(window, limit, tier, chunk), p.offload, shared.prefetcher, p.index,
                          owned_outputs=owned and q is None)
    if q is not None:
        layer = Quantize(layer, Codec(CodecSpec.of(q)), q.residual_length, q.sink_tokens, window=p.window,
                         max_length=p.max_length if p.storage == "static" else None, shared=None if owned else shared,
                         packed_attention=q.packed_attention and p.layer_type != "cross_attention")
    if p.layer_type == "cross_attention":
        layer = CrossAttention(layer, fresh_reads=q is not None)
    return layer


def structure(layer) -> list[str]:
    names = []
    while layer is not None:
        names.append(type(layer).__name__)
        layer = getattr(layer, "inner", None) or getattr(layer, "store", None)
    return names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_build_gives_the_chain_of_the_policy_for_every_preset(path, tmp_path):
    for model in models_for(path):
        lps = resolved(path, model, tmp_path)
        built, shared = build_layers(lps)
        padded = all(p.storage == "static" and p.window is None and p.quantize is None and p.offload is None
                     for p in lps)
        ref_shared = Shared()
        g = torch.Generator().manual_seed(0)
        for p, layer in zip(lps, built):
            ref = by_hand(p, ref_shared, padded)
            assert structure(layer) == structure(ref) and layer.policy == p
            spec = spec_for(p, padded)
            assert build(spec, Shared()).policy == p
            for t in (70, 1, 1, 9, 1):
                if p.storage == "static" and layer.seq_length() + t > p.max_length:
                    break
                k, v = torch.randn(1, 2, t, 16, generator=g), torch.randn(1, 2, t, 16, generator=g)
                for a, b in zip(layer.update(k, v), ref.update(k, v)):
                    assert torch.equal(a, b)
            got, want = layer.state_dict(), ref.state_dict()
            assert got.keys() == want.keys()
            for key in got:
                assert type(got[key]) is type(want[key]), key
                if isinstance(got[key], torch.Tensor):
                    assert torch.equal(got[key], want[key]), key
                elif key not in ("spec",):
                    assert got[key] == want[key], key
            assert layer.nbytes() == ref.nbytes()
            layer.close()
            ref.close()
        shared.close()
        ref_shared.close()


def test_quantize_refuses_a_store_of_the_wrong_geometry():
    codec = Codec(CodecSpec.of(Q4))
    with pytest.raises(CacheError, match="store must hold 4 blocks"):
        Quantize(make_storage(window=40), codec, 32, window=40)  # tokens, not blocks
    with pytest.raises(CacheError, match="store must hold"):
        Quantize(make_storage(), codec, 32, max_length=100)


def test_can_adopt_compares_the_codec_and_the_residual_rule():
    layers, _ = build_layers([lp(quantize=Q4), lp(quantize=Q4, offload=OffloadPolicy()),
                              lp(quantize=dataclasses.replace(Q4, residual_length=64)),
                              lp(quantize=dataclasses.replace(Q4, bits=2))])
    resident, host, longer, int2 = layers
    assert host.can_adopt(resident) and resident.can_adopt(host)  # same block format, another tier
    assert not longer.can_adopt(resident) and not int2.can_adopt(resident)
    assert resident.codec == host.codec and resident.codec != int2.codec
    assert resident.config == Q4  # the policy it reports (and saves) is the one it was built from
