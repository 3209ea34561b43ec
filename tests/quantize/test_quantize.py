"""Quantize processor vs a plain full-precision reference that quantize-dequantizes the same blocks once.

The reference keeps every token in one tensor; it applies the KIVI flush rule one token at a
time (whenever the residual reaches ``residual_length``, its whole blocks are packed) and
replaces the packed tokens by ``codec.roundtrip`` of those blocks. With the native backend the
comparison is exact (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

from tiercache.errors import CacheError
from tiercache.policy.schema import QuantizePolicy
from tiercache.quantize.processor import Quantize
from tests.quantize.quantized import quantized

B, H, D = 3, 2, 8

CONFIGS = [
    pytest.param(QuantizePolicy(bits=4, group_size=4, residual_length=4), id="int4-g4-r4"),
    pytest.param(QuantizePolicy(bits=2, group_size=4, residual_length=0), id="int2-g4-r0"),
    pytest.param(QuantizePolicy(bits=8, group_size=8, residual_length=3, key_axis="token", value_axis="channel"), id="int8-g8-r3-swapped"),
    pytest.param(QuantizePolicy(bits=8, group_size=4, residual_length=2, format="fp8"), id="fp8-g4-r2"),
    pytest.param(QuantizePolicy(bits=2, key_bits=4, group_size=4, residual_length=4), id="K4V2-g4-r4"),
]
KINDS = [pytest.param({}, id="full"), pytest.param({"window": 6}, id="sliding6"), pytest.param({"window": 13}, id="sliding13"),
         pytest.param({"max_length": 64}, id="static64")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
STEPS = [7, 1, 1, 3, 1, 9, 1, 1, 1, 2]  # tokens per update: a prefill, decode steps, chunks


class Reference:
    """All tokens in full precision; flushed ones replaced once by their quantize-dequantize
    (after the update that packs them, which still returns them exact). The flush rule is
    simulated token by token, so a multi-token update must leave what one-token updates would."""

    def __init__(self, layer: Quantize, window: int | None):
        self.layer, self.window = layer, window
        self.k = self.v = None
        self.packed = 0

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        visible = self.k.shape[2] if self.window is None else self.window - 1 + k.shape[2]
        out = self.k[:, :, -visible:].clone(), self.v[:, :, -visible:].clone()  # tokens packed now: still exact
        g, r = self.layer.g, self.layer.r
        held = self.k.shape[2] - k.shape[2] - self.packed  # residual before this update
        for _ in range(k.shape[2]):
            held += 1
            if held >= r:  # the residual reached R: its whole blocks are packed, oldest first
                held -= held // g * g
        end = self.k.shape[2] - held
        if end > self.packed:
            ck, cv = self.layer.codecs
            self.k[:, :, self.packed : end] = ck.roundtrip(self.k[:, :, self.packed : end])
            self.v[:, :, self.packed : end] = cv.roundtrip(self.v[:, :, self.packed : end])
            self.packed = end
        return out

    def crop(self, n):
        keep = self.k.shape[2] - n
        self.k, self.v = self.k[:, :, :keep], self.v[:, :, :keep]
        while self.packed > keep:  # the cut block's kept head is already its dequantized values
            self.packed -= self.layer.g

    def gather(self, idx):
        self.k, self.v = self.k[idx], self.v[idx]


def make(config, kind):
    return quantized(config, **kind)


def kv(t, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, t, D, generator=g).to(dtype), torch.randn(B, H, t, D, generator=g).to(dtype))


def check(out, ref):
    assert out[0].shape == ref[0].shape and out[1].shape == ref[1].shape
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def run(layer, ref, steps, dtype, seed=0):
    for i, t in enumerate(steps):
        k, v = kv(t, dtype, seed * 100 + i)
        check(layer.update(k, v), ref.update(k, v))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_update_matches_reference(config, kind, dtype):
    layer = make(config, kind)
    ref = Reference(layer, kind.get("window"))
    run(layer, ref, STEPS, dtype)
    assert layer.seq_length() == sum(STEPS)
    assert len(layer.residual) == ref.k.shape[2] - ref.packed
    assert len(layer.residual) < max(config.residual_length, config.group_size)


@pytest.mark.parametrize("kind", [KINDS[0], KINDS[2], KINDS[3]])
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("n", [1, 3, 6, 9], ids=lambda n: f"crop{n}")
def test_crop_then_continue(config, kind, n):
    layer = make(config, kind)
    layer.set_recording(True)
    ref = Reference(layer, kind.get("window"))
    run(layer, ref, STEPS[:6], torch.float32)
    layer.crop(n)
    ref.crop(n)
    layer.set_recording(False)
    assert layer.seq_length() == ref.k.shape[2]
    if kind.get("window") is None:
        check(layer.kv(), (ref.k, ref.v))
    run(layer, ref, STEPS[6:], torch.float32, seed=1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", ["reorder", "select", "repeat", "bool-select"])
def test_batch_ops(kind, op):
    layer = make(CONFIGS[0].values[0], kind)
    ref = Reference(layer, kind.get("window"))
    run(layer, ref, STEPS[:6], torch.float32)
    if op == "reorder":
        idx = torch.tensor([2, 0, 0])
        layer.reorder(idx)
    elif op == "select":
        if "max_length" in kind:
            idx = torch.tensor([2, 1, 0])
        else:
            idx = torch.tensor([2, 0])
        layer.select(idx)
    elif op == "bool-select":
        idx = torch.tensor([True, False, True])
        layer.select(idx)
        idx = idx.nonzero().flatten()
    else:
        idx = torch.arange(B).repeat_interleave(2)
        layer.repeat_interleave(2)
    ref.gather(idx)
    for i, t in enumerate(STEPS[6:]):
        k, v = kv(t, torch.float32, 50 + i)
        k, v = k[torch.arange(len(idx)) % B], v[torch.arange(len(idx)) % B]
        check(layer.update(k, v), ref.update(k, v))


def test_reset_forgets_everything():
    layer = make(CONFIGS[0].values[0], {})
    run(layer, Reference(layer, None), STEPS, torch.float32)
    layer.reset()
    assert layer.seq_length() == 0 and layer.kv() is None
    ref = Reference(layer, None)
    run(layer, ref, STEPS[:3], torch.bfloat16)  # may change dtype after a reset


def test_quantizes_each_block_once(monkeypatch):
    layer = make(CONFIGS[0].values[0], {})
    calls = []

    def counting(original):
        def quantize(x, dim):
            calls.append(x.shape[2])  # blocks in this call
            return original(x, dim)
        return quantize

    for backend in layer.codec.backends.values():  # the keys' and the values' (their bits may differ)
        monkeypatch.setattr(backend, "quantize", counting(backend.quantize))
    steps = [37] + [1] * 200
    for i, t in enumerate(steps):
        layer.update(*kv(t, torch.float32, i))
    packed = layer.store.seq_length()
    assert sum(calls) == 2 * packed  # keys and values: every block quantized exactly once
    assert packed * layer.g + len(layer.residual) == sum(steps) and len(layer.residual) < layer.r


def test_sliding_mask_sizes_match_sliding_layer():
    from tiercache.layers.sliding import SlidingLayer

    layer, plain = make(CONFIGS[0].values[0], {"window": 6}), SlidingLayer(6)
    for i, t in enumerate(STEPS):
        k, v = kv(t, torch.float32, i)
        assert layer.mask_sizes(t) == plain.mask_sizes(t)
        a, b = layer.update(k, v), plain.update(k, v)
        assert a[0].shape == b[0].shape
    assert layer.max_length() == plain.max_length() and layer.is_sliding


def test_bad_input_leaves_layer_unchanged():
    layer = make(CONFIGS[0].values[0], {"max_length": 20})
    run(layer, Reference(layer, None), [7, 1], torch.float32)
    before = [t.clone() for t in layer.kv()]
    for bad in (lambda: layer.update(*kv(13, torch.float32, 9)),  # past max_length
                lambda: layer.update(torch.randn(B, H, 1, D + 1), torch.randn(B, H, 1, D + 1)),
                lambda: layer.update(torch.randn(B + 1, H, 1, D), torch.randn(B + 1, H, 1, D)),
                lambda: layer.crop(-1),
                lambda: layer.reorder(torch.tensor([0, 5, 1])),
                lambda: layer.repeat_interleave(0)):
        with pytest.raises(CacheError):
            bad()
        assert layer.seq_length() == 8
        assert all(torch.equal(a, b) for a, b in zip(layer.kv(), before))
    layer.crop(99)  # past the start empties the layer, as transformers' DynamicLayer
    assert layer.seq_length() == 0 and layer.kv() is None and layer.keys.shape == (B, H, 0, D)
    layer.update(*kv(3, torch.float32, 9))  # and it goes on from empty
    assert layer.seq_length() == 3 and torch.equal(layer.keys, kv(3, torch.float32, 9)[0])


def test_sliding_crop_past_window_raises_and_keeps_state():
    layer = make(CONFIGS[1].values[0], {"window": 6})
    run(layer, Reference(layer, 6), [30, 1, 1], torch.float32)
    before = [t.clone() for t in layer.kv()]
    with pytest.raises(CacheError, match="activate_past_recording"):
        layer.crop(20)
    assert layer.seq_length() == 32 and all(torch.equal(a, b) for a, b in zip(layer.kv(), before))


@pytest.mark.parametrize("kind", KINDS)
def test_bits_per_tensor_are_each_uniform_format(kind):
    """keys at 4 bits, values at 2: the keys are what an int4 layer holds, bit for bit, and the
    values what an int2 layer holds (the two halves are independent formats)."""
    def layer(**q):
        return make(QuantizePolicy(group_size=4, residual_length=4, **q), kind)

    mixed, int4, int2 = layer(bits=2, key_bits=4), layer(bits=4), layer(bits=2, value_bits=2)
    for i, t in enumerate(STEPS):
        k, v = kv(t, torch.float32, i)
        (mk, mv), (fk, _), (_, tv) = mixed.update(k, v), int4.update(k, v), int2.update(k, v)
        assert torch.equal(mk, fk) and torch.equal(mv, tv)
    assert mixed.codecs[0].row_bytes == int4.codecs[0].row_bytes > mixed.codecs[1].row_bytes == int2.codecs[1].row_bytes


def test_state_saved_before_bits_per_tensor_loads_and_other_bits_are_refused():
    """A state dict written before ``key_bits`` / ``value_bits`` existed (its config lacks them) is
    the same format; one of other key bits is refused, naming retier."""
    layer = make(QuantizePolicy(bits=2, group_size=4, residual_length=4), {})
    for i, t in enumerate(STEPS):
        layer.update(*kv(t, torch.float32, i))
    sd = layer.state_dict()
    old = {**sd, "config": {k: v for k, v in sd["config"].items() if k not in ("key_bits", "value_bits")}}
    twin = make(QuantizePolicy(bits=2, group_size=4, residual_length=4), {})
    twin.load_state_dict(old)
    check(twin.export()[:2], layer.export()[:2])
    other = make(QuantizePolicy(bits=2, key_bits=4, group_size=4, residual_length=4), {})
    with pytest.raises(CacheError, match="use retier"):
        other.load_state_dict(sd)
