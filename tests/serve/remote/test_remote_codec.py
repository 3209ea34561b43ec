"""Chunk blobs and keys: full precision round-trips bit-exact, int4 travels packed within an SQNR
bound of the full-precision reference, and anything altered is refused, never decoded."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
import torch

from tiercache.models.load import load_model
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import QuantizePolicy
import hmac

from tiercache.serve.remote.codec import ChunkError, ChunkFormat, ChunkTagError
from tiercache.serve.remote.keys import chunk_keys, model_fingerprint

SPEC = ModelSpec(name="t", num_layers=3, kv_heads=2, head_dim=64, layer_types=("full_attention",) * 3, dtype="float32")
INT4 = QuantizePolicy(bits=4, group_size=64, residual_length=0)


def chunk(tokens=128, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, tokens, 64, generator=g).to(dtype) * (1 + i),
             torch.randn(1, 2, tokens, 64, generator=g).to(dtype)) for i in range(3)]  # [1, H, C, D] per layer


def sqnr(ref, got) -> float:
    return float(10 * torch.log10(ref.float().pow(2).mean() / (ref.float() - got.float()).pow(2).mean()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_full_precision_round_trips_bit_exact(dtype):
    fmt = ChunkFormat(SPEC, dtype)
    kv = chunk(dtype=dtype)
    back = fmt.decode(fmt.encode(kv, "k1"), "k1")
    for (k, v), (bk, bv) in zip(kv, back):
        assert torch.equal(k, bk) and torch.equal(v, bv) and bk.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_int4_travels_packed_within_bounds(dtype):
    fp, q = ChunkFormat(SPEC, dtype), ChunkFormat(SPEC, dtype, INT4)
    kv = chunk(dtype=dtype)
    blob_fp, blob_q = fp.encode(kv, "k"), q.encode(kv, "k")
    assert len(blob_q) <= 0.3 * len(blob_fp)  # packed codes + scales, not dequantized values
    assert q.bytes_per_token() <= 0.3 * fp.bytes_per_token()
    back = q.decode(blob_q, "k")
    for (k, v), (bk, bv) in zip(kv, back):
        assert sqnr(k, bk) > 15 and sqnr(v, bv) > 15
        assert not torch.equal(k, bk)  # it did quantize


def test_formats_have_different_names():
    names = {ChunkFormat(SPEC, torch.float32).name, ChunkFormat(SPEC, torch.float16).name,
             ChunkFormat(SPEC, torch.float32, INT4).name,
             ChunkFormat(SPEC, torch.float32, QuantizePolicy(bits=2, group_size=64, residual_length=0)).name}
    assert len(names) == 4


def flip(blob: bytes, at: int) -> bytes:
    b = bytearray(blob)
    b[at] ^= 0x10
    return bytes(b)


@pytest.mark.parametrize("quantize", [None, INT4], ids=["fp", "int4"])
def test_anything_altered_is_refused(quantize):
    fmt = ChunkFormat(SPEC, torch.float32, quantize)
    blob = fmt.encode(chunk(), "key-a")
    for at in (0, 6, 20, len(blob) // 2, len(blob) - 40, len(blob) - 1):  # magic, length, header, payload, digest
        with pytest.raises(ChunkError):
            fmt.decode(flip(blob, at), "key-a")
    with pytest.raises(ChunkError, match="key"):
        fmt.decode(blob, "key-b")  # a value moved under another key
    with pytest.raises(ChunkError):
        fmt.decode(blob[: len(blob) // 2], "key-a")  # torn / truncated
    with pytest.raises(ChunkError, match="format"):
        ChunkFormat(SPEC, torch.float32, None if quantize else INT4).decode(blob, "key-a")
    other = ModelSpec(name="t", num_layers=3, kv_heads=1, head_dim=64, layer_types=("full_attention",) * 3, dtype="float32")
    with pytest.raises(ChunkError, match="layers"):
        ChunkFormat(other, torch.float32, quantize).decode(blob, "key-a")


@pytest.mark.parametrize("quantize", [None, INT4], ids=["fp", "int4"])
def test_signed_chunks_are_read_only_under_their_secret(quantize):
    signed = ChunkFormat(SPEC, torch.float32, quantize, secret=b"secret-A")
    kv = chunk()
    blob = signed.encode(kv, "key-a")
    body = blob[:-32]
    assert blob[-32:] == hmac.new(b"secret-A", body, hashlib.sha256).digest()
    back = signed.decode(blob, "key-a")
    if quantize is None:  # bit-exact; int4 is checked against the unsigned codec's result
        assert all(torch.equal(a, b) for pa, pb in zip(kv, back) for a, b in zip(pa, pb))
    else:
        plain_back = ChunkFormat(SPEC, torch.float32, quantize).decode(
            ChunkFormat(SPEC, torch.float32, quantize).encode(kv, "key-a"), "key-a")
        assert all(torch.equal(a, b) for pa, pb in zip(plain_back, back) for a, b in zip(pa, pb))
    other = ChunkFormat(SPEC, torch.float32, quantize, secret=b"secret-B")
    with pytest.raises(ChunkTagError, match="HMAC tag missing or wrong"):
        other.decode(blob, "key-a")  # another secret
    plain = ChunkFormat(SPEC, torch.float32, quantize)
    with pytest.raises(ChunkTagError):
        signed.decode(plain.encode(kv, "key-a"), "key-a")  # unsigned: no tag under the secret
    forged = body + hashlib.sha256(body).digest()  # what a writer without the secret can compute
    with pytest.raises(ChunkTagError):
        signed.decode(forged, "key-a")
    with pytest.raises(ChunkError, match="checksum") as e:
        plain.decode(blob, "key-a")  # a signed chunk read without the secret: refused too
    assert not isinstance(e.value, ChunkTagError)
    for at in (6, 20, len(blob) // 2, len(blob) - 1):
        with pytest.raises(ChunkTagError):
            signed.decode(flip(blob, at), "key-a")
    with pytest.raises(ValueError, match="empty secret"):
        ChunkFormat(SPEC, torch.float32, secret=b"")


def test_keys_are_chained_and_namespaced():
    ids = list(range(300))
    keys = chunk_keys(ids, 64, "ns")
    assert len(keys) == 4  # whole chunks only
    assert chunk_keys(ids[:200] + [9] * 100, 64, "ns")[:3] == keys[:3]
    changed = chunk_keys([7] + ids[1:], 64, "ns")
    assert not set(changed) & set(keys)  # a change in chunk 0 renames every later chunk
    assert not set(chunk_keys(ids, 64, "other")) & set(keys)
    want = hashlib.sha256(hashlib.sha256(b"ns").digest() + torch.arange(64, dtype=torch.int32).numpy().tobytes())
    assert keys[0] == f"ns:{want.hexdigest()}"


def test_keys_and_fingerprint_are_the_same_in_another_process():
    code = ("from tiercache.serve.remote.keys import chunk_keys, model_fingerprint;"
            "from tiercache.models.load import load_model;"
            "print(chunk_keys(list(range(100)), 32, 'ns')[-1]); print(model_fingerprint(load_model('tiny')[0], 'tiny'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [chunk_keys(list(range(100)), 32, "ns")[-1], model_fingerprint(load_model("tiny")[0], "tiny")]


def test_fingerprint_tells_weights_and_names_apart():
    tiny, random = load_model("tiny")[0], load_model("tiny-random")[0]
    assert model_fingerprint(tiny, "tiny") != model_fingerprint(random, "tiny")
    assert model_fingerprint(tiny, "tiny") != model_fingerprint(tiny, "other-name")
