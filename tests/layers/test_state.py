"""The lifecycle half of the layer protocol, for every chain kind: ``state_dict`` /
``load_state_dict`` (lossless, no side effects), ``export`` / ``ingest`` (a bulk load that
leaves the state a fed layer holds), ``batch_size`` and ``tier_nbytes``."""

from __future__ import annotations

import pytest
import torch

from tiercache.errors import CacheError
from tiercache.quantize.processor import Quantize

from layers.chains import CHAINS, build, feed, kv

IDS = list(CHAINS)
STEPS = [13, 1, 1, 5, 1, 1, 1]  # a prefill, then decode steps (several flushes of 4-token blocks)


def tensors_equal(a: dict, b: dict, skip: str | None = None) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if skip is not None and key.endswith(skip):
            continue
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


@pytest.mark.parametrize("name", IDS)
def test_state_dict_round_trip_is_lossless(name, tmp_path):
    src = build(CHAINS[name](tmp_path))
    feed(src, STEPS)
    dst = build(CHAINS[name](tmp_path))
    dst.load_state_dict(src.state_dict())
    tensors_equal(dst.state_dict(), src.state_dict())
    assert dst.nbytes() == src.nbytes() and dst.seq_length() == src.seq_length()
    assert dst.mask_sizes(1) == src.mask_sizes(1) and dst.batch_size() == src.batch_size() == 2
    k, v = kv(3, seed=99)  # the next step gives the same K/V on both
    a, b = src.update(k, v), dst.update(k, v)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name", IDS)
def test_state_dict_has_no_side_effects_and_keeps_tensors_in_place(name, tmp_path):
    layer = build(CHAINS[name](tmp_path))
    feed(layer, STEPS)
    before = layer.nbytes()
    sd = layer.state_dict()
    sd2 = layer.state_dict()
    tensors_equal(sd, sd2)
    assert layer.nbytes() == before
    for key, value in sd.items():
        assert isinstance(value, (torch.Tensor, int, float, str, bool, dict, type(None))), key
        if isinstance(value, torch.Tensor) and value.numel():  # a view of the layer's memory, not a copy
            value.view(torch.uint8).bitwise_xor_(1)
            assert torch.equal(layer.state_dict()[key], value), key
            value.view(torch.uint8).bitwise_xor_(1)


@pytest.mark.parametrize("name", IDS)
def test_export_is_full_precision_and_changes_nothing(name, tmp_path):
    layer = build(CHAINS[name](tmp_path))
    fed = feed(layer, STEPS)
    sd = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in layer.state_dict().items()}
    k, v, seen = layer.export()
    assert seen == sum(STEPS) and k.dtype == torch.float32 and k.shape[:2] == (2, 2)
    tensors_equal(layer.state_dict(), sd)
    allk = torch.cat([f[0] for f in fed], 2)
    if "int" not in name:  # lossless chains export exactly the newest tokens they hold
        assert torch.equal(k, allk[:, :, -k.shape[2]:])
    else:
        assert k.shape[2] <= seen and (k - allk[:, :, -k.shape[2]:]).abs().max() < 1.0


@pytest.mark.parametrize("name", IDS)
@pytest.mark.parametrize("seen", [0, 3, 6, 9, 22, 23])
def test_ingest_equals_a_layer_fed_the_same_tokens(name, seen, tmp_path):
    fed = build(CHAINS[name](tmp_path))
    k, v = kv(seen, seed=7)
    for i in range(seen):  # one token at a time: the state depends only on the tokens seen
        fed.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
    bulk = build(CHAINS[name](tmp_path))
    bulk.ingest(k, v, seen)
    if seen == 0:
        fed.update(k, v)  # a zero-token update: the layer learns its spec
    # the same state; buffer capacity (spare room, not state) may differ where a sliding store regrew
    tensors_equal(bulk.state_dict(), fed.state_dict(), skip="capacity")
    nk, nv = kv(2, seed=8)
    a, b = fed.update(nk, nv), bulk.update(nk, nv)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("name", ["sliding", "int4-sliding", "sliding-host"])
def test_ingest_of_a_window_keeps_seen_for_the_mask(name, tmp_path):
    layer = build(CHAINS[name](tmp_path))
    k, v = kv(6, seed=3)
    layer.ingest(k, v, 40)  # the last 6 of 40 tokens (a sliding source keeps window - 1)
    assert layer.seq_length() == 40 and layer.mask_sizes(1) == (7, 34)
    out = layer.update(*kv(1, seed=4))
    assert out[0].shape[2] == 7 and torch.allclose(out[0][:, :, :6], k, atol=0.5 if "int" in name else 0)


def test_quantize_ingest_packs_blocks_once_by_the_residual_rule(tmp_path):
    layer = build(CHAINS["int4"](tmp_path))
    k, v = kv(23, seed=5)
    layer.ingest(k, v, 23)
    sd = layer.state_dict()
    assert sd["residual.keys"].shape[2] == 3 and sd["store.buffer.keys"].shape[2] == 5  # 20 packed, 3 exact
    assert torch.equal(sd["residual.keys"], k[:, :, 20:])


def test_adopt_moves_packed_blocks_as_they_are(tmp_path):
    src = build(CHAINS["int4"](tmp_path))
    feed(src, STEPS)
    dst = build(CHAINS["int4-host"](tmp_path))
    assert isinstance(dst, Quantize)
    dst.adopt(src)
    a, b = src.state_dict(), dst.state_dict()
    assert torch.equal(a["store.buffer.keys"], b["store.inner.buffer.keys"])
    assert torch.equal(a["residual.values"], b["residual.values"]) and b["seen"] == a["seen"]
    assert dst.tier_nbytes().keys() == {"host", "device"} and src.tier_nbytes().keys() == {"device"}


@pytest.mark.parametrize("bad, match", [
    ({"kind": "sliding"}, "this is a full layer"),
    ({"kind": "full", "buffer.spec": {"batch": 1}}, "layer spec needs"),
    ({"kind": "full", "buffer.spec": {"batch": 2, "heads": 2, "key_dim": 8, "value_dim": 6, "dtype": "float32",
                                      "device": "cpu"}, "buffer.capacity": 4,
      "buffer.keys": torch.zeros(2, 2, 3, 8), "buffer.values": torch.zeros(2, 2, 3, 5)}, "values should be"),
    ("not a dict", "expected a dict"),
])
def test_a_malformed_state_is_a_clear_error(bad, match, tmp_path):
    layer = build(CHAINS["full"](tmp_path))
    with pytest.raises(CacheError, match=match):
        layer.load_state_dict(bad)


def test_a_state_of_another_block_format_is_refused(tmp_path):
    src = build(CHAINS["int4"](tmp_path))
    feed(src, STEPS)
    with pytest.raises(CacheError, match="block format"):
        build(CHAINS["int2-token"](tmp_path)).load_state_dict(src.state_dict())


@pytest.mark.parametrize("name, seen, match", [("full", 5, "needs all 5"), ("static", 70, "max_length=64"),
                                               ("int4-static", 70, "max_length=64")])
def test_ingest_refuses_what_the_layer_cannot_hold(name, seen, match, tmp_path):
    layer = build(CHAINS[name](tmp_path))
    k, v = kv(min(seen, 70) - (1 if name == "full" else 0))
    with pytest.raises(CacheError, match=match):
        layer.ingest(k, v, seen)
    assert layer.batch_size() is None


def test_tier_nbytes_keeps_host_apart_from_device_on_cpu(tmp_path):
    layer = build(CHAINS["int4-host"](tmp_path))
    feed(layer, STEPS)
    tiers = layer.tier_nbytes()
    assert set(tiers) == {"host", "device"} and sum(tiers.values()) == sum(layer.nbytes().values())
    disk = build(CHAINS["disk"](tmp_path))
    feed(disk, STEPS)
    assert set(disk.tier_nbytes()) == {"disk"}
