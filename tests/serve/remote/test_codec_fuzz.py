"""The chunk codec against random and mutated blobs: every one decodes to the right shapes or is a
``ChunkError`` (a miss), never another exception, never an allocation past a small multiple of
the blob. Mutations start from real chunks and are re-signed (a fresh sha256) so that they reach
the header checks behind the checksum, as a writer with access to the Redis could."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import QuantizePolicy
from tiercache.serve.remote.codec import ChunkError, ChunkFormat

SPEC = ModelSpec(name="t", num_layers=2, kv_heads=2, head_dim=16, layer_types=("full_attention",) * 2, dtype="float32")
TOKENS = 32
FORMATS = {"fp": ChunkFormat(SPEC, torch.float32),
           "int4": ChunkFormat(SPEC, torch.float32, QuantizePolicy(bits=4, group_size=16, residual_length=0))}


def blob_of(fmt):
    g = torch.Generator().manual_seed(0)
    kv = [(torch.randn(1, 2, TOKENS, 16, generator=g), torch.randn(1, 2, TOKENS, 16, generator=g)) for _ in range(2)]
    return fmt.encode(kv, "key-1")


BLOBS = {name: blob_of(fmt) for name, fmt in FORMATS.items()}


def signed(body: bytes) -> bytes:
    return body + hashlib.sha256(body).digest()


def parts(blob: bytes):
    (n,) = struct.unpack_from("<I", blob, 4)
    return json.loads(blob[8:8 + n]), blob[8 + n:-32]


def assemble(header, payload: bytes) -> bytes:
    head = header if isinstance(header, bytes) else json.dumps(header).encode()
    return signed(b"TCKV" + struct.pack("<I", len(head)) + head + payload)


VALUES = st.recursive(st.none() | st.booleans() | st.integers(-2**66, 2**66) | st.floats(allow_nan=False)
                      | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)


@st.composite
def mutated(draw):
    name = draw(st.sampled_from(sorted(BLOBS)))
    blob = BLOBS[name]
    how = draw(st.sampled_from(["random", "truncate", "flip", "field", "tokens", "payload", "header-bytes"]))
    if how == "random":
        return name, draw(st.binary(max_size=300))
    if how == "truncate":
        return name, blob[:draw(st.integers(0, len(blob) - 1))]
    if how == "flip":
        out = bytearray(blob)
        at = draw(st.integers(0, len(blob) - 1))
        out[at] ^= draw(st.integers(1, 255))
        return name, bytes(out)
    header, payload = parts(blob)
    if how == "field":
        header[draw(st.sampled_from(sorted(header) + ["extra"]))] = draw(VALUES)
    elif how == "tokens":
        header["tokens"] = draw(st.sampled_from([0, 1, 15, 16, 17, 31, 33, 64, 2**31, 2**63, -32, True]))
        if draw(st.booleans()):  # a payload that matches the claim, as far as the blob's size allows
            payload = (payload * 3)[:max(0, FORMATS[name].payload_bytes(max(1, min(header["tokens"], 96))))]
    elif how == "payload":
        payload = payload[:draw(st.integers(0, len(payload)))] + draw(st.binary(max_size=64))
    else:
        return name, assemble(draw(st.binary(max_size=64)), payload)
    return name, assemble(header, payload)


@settings(max_examples=250, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_mutated_chunks_decode_exactly_or_are_a_miss(case):
    name, blob = case
    fmt = FORMATS[name]
    asked = []
    real = torch.empty

    def watched(*shape, **kw):
        t = real(*shape, **kw)
        asked.append(t.numel() * t.element_size())
        return t

    torch.empty = watched
    try:
        kv = fmt.decode(blob, "key-1", tokens=TOKENS)
    except ChunkError:
        return
    finally:
        torch.empty = real
    assert max(asked, default=0) <= 4 * len(blob)
    assert [tuple(t.shape) for pair in kv for t in pair] == [(1, 2, TOKENS, 16)] * 4
    assert parts(blob)[1] == parts(BLOBS[name])[1]  # only the payload as written decodes (a changed extra
    ref = fmt.decode(BLOBS[name], "key-1")         # header field aside), to the tensors as written
    assert all(torch.equal(a, b) for pa, pb in zip(kv, ref) for a, b in zip(pa, pb))


def test_a_chunk_of_another_length_is_a_miss():
    fmt = FORMATS["fp"]
    with pytest.raises(ChunkError, match="this reader's chunks hold 64"):
        fmt.decode(BLOBS["fp"], "key-1", tokens=64)
    header, payload = parts(BLOBS["int4"])
    header["tokens"], payload = 24, payload[: FORMATS["int4"].payload_bytes(24)]
    with pytest.raises(ChunkError, match="whole blocks of 16"):
        FORMATS["int4"].decode(assemble(header, payload), "key-1")
    with pytest.raises(ChunkError, match="not an object"):
        fmt.decode(assemble(b"[1, 2]", b""), "key-1")
