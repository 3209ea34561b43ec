"""One chunk of K/V as one checksummed (or signed) blob: header, payload, tag. Nothing is pickled.

    fmt = ChunkFormat(spec, dtype, quantize=None, secret=None)
                                                    spec: the model's ``ModelSpec``; quantize: a
                                                    native ``QuantizePolicy`` or None (the dtype as is);
                                                    secret: bytes, the HMAC key (``remote.secret``)
    fmt.name                                        "fp-float32", "int4-g64-1a2b3c4d": part of every key
    blob = fmt.encode(kv, key)                      kv: per layer ``(k, v)``, each ``[1, H, C, D]``
    kv = fmt.decode(blob, key, device="cpu", tokens=None)   the same shapes, ``ChunkError`` when anything
                                                    is off (``tokens``: the chunk length the reader expects)
    fmt.bytes_per_token()                           payload bytes per token (the wire cost, no header)

Blob layout::

    b"TCKV" | u32 little-endian header length | header (JSON, utf-8) | payload | tag (32 bytes)

The tag covers everything before it: without a secret a sha256 (it finds a torn or altered value,
not a forged one: anyone who can write to the Redis can compute it); with a secret an
HMAC-SHA256 under it, and the header says ``"mac": "hmac-sha256"``. A reader with a secret
accepts only chunks whose HMAC under its secret matches (compared in constant time): a chunk
without one (written unsigned) or with another (another secret, a forgery) is a
``ChunkTagError``, a miss. Every server sharing a Redis must have the same secret. The header: ``version`` (1), ``key`` (the Redis key the
blob was written under: a value moved to another key is refused), ``format`` (``fmt.name``),
``codec`` (``raw`` | ``native``), ``dtype``, ``tokens`` (C), ``layers`` (``[H, Dk, Dv]`` per layer),
``payload`` (its length), and for ``native`` the block format (bits, group size, axes ...).
Payload, layer by layer, keys then values: ``raw`` is the tensor's bytes ``[1, H, C, D]``;
``native`` is the packed rows ``[1, H, C / G, row_bytes]`` of ``tiercache.quantize.blocks``
(codes, then scale and offset in the model dtype, per block of G tokens): quantized chunks
travel packed and are dequantized by the reader.

``decode`` checks, in order: magic, the tag (before anything the blob says is trusted), lengths,
version, key, format, dtype, tokens (a whole number of blocks, and ``tokens`` when given), layer
shapes, payload length; the first failure is a ``ChunkError`` saying which. Sizes come from the
format (the model's shapes) and ``tokens``, and the payload length must match them, so a blob never
makes ``decode`` allocate more than about twice its own size. A chunk that fails is a miss for the
caller, never a wrong prefix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import struct

import torch

MAGIC, VERSION = b"TCKV", 1
_DIGEST = 32
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ChunkError(ValueError):
    """A blob that is not a valid chunk for this key and format (corrupted, truncated, foreign)."""


class ChunkTagError(ChunkError):
    """A chunk whose HMAC tag is missing or wrong under this reader's secret (another secret, a forgery)."""


class ChunkFormat:
    def __init__(self, spec, dtype: torch.dtype, quantize=None, secret: bytes | None = None):
        from tiercache.quantize.blocks import Codec
        from tiercache.quantize.codec import CodecSpec

        names = {v: k for k, v in _DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"remote chunks: K/V dtype {dtype} is not supported; allowed: {', '.join(_DTYPES)}")
        self.dtype, self.dtype_name = dtype, names[dtype]
        self.shapes = [list(spec.kv_shape(i)) for i in range(spec.num_layers)]  # [H, Dk, Dv] per layer
        self.quantize = quantize
        if secret is not None and not secret:
            raise ValueError("remote chunks: an empty secret; give one, or None for unsigned chunks")
        self._secret = secret
        self.signed = secret is not None
        if quantize is None:
            self.codec_header = {"codec": "raw"}
            self.name = f"fp-{self.dtype_name}"
            self._codecs = None
        else:
            cspec = CodecSpec.of(quantize)
            desc = dataclasses.asdict(cspec)
            self.codec_header = {"codec": "native", "block": desc}
            digest = hashlib.sha256(json.dumps({**desc, "dtype": self.dtype_name}, sort_keys=True).encode()).hexdigest()
            self.name = f"int{cspec.bits}-g{cspec.group_size}-{digest[:8]}"
            codec = Codec(cspec)
            self._codecs = [codec.for_kv(dk, dv, dtype) for _, dk, dv in self.shapes]  # (keys, values) per layer

    # -- sizes -----------------------------------------------------------------------------------
    def _part_bytes(self, layer: int, which: int, tokens: int) -> int:
        h, dk, dv = self.shapes[layer]
        d = (dk, dv)[which]
        if self._codecs is None:
            return h * tokens * d * self.dtype.itemsize
        bc = self._codecs[layer][which]
        return h * (tokens // bc.g) * bc.row_bytes

    def payload_bytes(self, tokens: int) -> int:
        return sum(self._part_bytes(i, w, tokens) for i in range(len(self.shapes)) for w in (0, 1))

    def bytes_per_token(self) -> float:
        g = 1 if self._codecs is None else self._codecs[0][0].g
        return self.payload_bytes(g) / g

    # -- encode ----------------------------------------------------------------------------------
    def encode(self, kv, key: str) -> bytes:
        if len(kv) != len(self.shapes):
            raise ValueError(f"encode: {len(kv)} layers given, the model has {len(self.shapes)}")
        tokens = kv[0][0].shape[2]
        parts = []
        for i, pair in enumerate(kv):
            for w, t in enumerate(pair):  # [1, H, C, D]
                want = (1, self.shapes[i][0], tokens, self.shapes[i][1 + w])
                if tuple(t.shape) != want or t.dtype != self.dtype:
                    raise ValueError(f"encode: layer {i} {'kv'[w]} is {tuple(t.shape)} {t.dtype}, expected {want} "
                                     f"{self.dtype}")
                if self._codecs is not None:
                    t = self._codecs[i][w].encode(t)  # [1, H, C / G, row_bytes] uint8, packed
                parts.append(_raw(t))
        header = {"version": VERSION, "key": key, "format": self.name, **self.codec_header,
                  "dtype": self.dtype_name, "tokens": tokens, "layers": self.shapes,
                  "payload": sum(len(p) for p in parts), **self._mac_header()}
        head = json.dumps(header, sort_keys=True).encode()
        body = b"".join([MAGIC, struct.pack("<I", len(head)), head, *parts])
        return body + self._tag(body)

    def _mac_header(self) -> dict:
        return {"mac": "hmac-sha256"} if self.signed else {}

    def _tag(self, body) -> bytes:
        if self._secret is None:
            return hashlib.sha256(body).digest()
        return hmac.new(self._secret, body, hashlib.sha256).digest()

    # -- decode ----------------------------------------------------------------------------------
    def decode(self, blob: bytes, key: str, device="cpu", tokens: int | None = None):
        if len(blob) < len(MAGIC) + 4 + _DIGEST or blob[:4] != MAGIC:
            raise ChunkError("not a tiercache chunk (bad magic or too short)")
        if not hmac.compare_digest(self._tag(memoryview(blob)[:-_DIGEST]), blob[-_DIGEST:]):
            if self.signed:
                raise ChunkTagError("HMAC tag missing or wrong (written unsigned, under another secret, or forged)")
            raise ChunkError("checksum mismatch (the value was altered or torn)")
        (n,) = struct.unpack_from("<I", blob, 4)
        start = 8 + n
        if start + _DIGEST > len(blob):
            raise ChunkError(f"truncated: header of {n} bytes in a blob of {len(blob)}")
        try:
            header = json.loads(blob[8:start].decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ChunkError(f"unreadable header: {e}") from e
        if not isinstance(header, dict):
            raise ChunkError(f"the header is a JSON {type(header).__name__}, not an object")
        want_tokens, tokens = tokens, header.get("tokens")
        expect = {"version": VERSION, "key": key, "format": self.name, "dtype": self.dtype_name, "layers": self.shapes,
                  "mac": self._mac_header().get("mac"), **self.codec_header}
        for field, want in expect.items():
            if header.get(field) != want:
                raise ChunkError(f"header {field} is {header.get(field)!r}, expected {want!r}")
        g = 1 if self._codecs is None else self._codecs[0][0].g
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1 or tokens % g:
            raise ChunkError(f"header tokens is {tokens!r}; a chunk holds whole blocks of {g} tokens")
        if want_tokens is not None and tokens != want_tokens:
            raise ChunkError(f"header tokens is {tokens}, this reader's chunks hold {want_tokens}")
        size = self.payload_bytes(tokens)
        if header.get("payload") != size or len(blob) - _DIGEST - start != size:
            raise ChunkError(f"payload is {len(blob) - _DIGEST - start} bytes, {size} expected for {tokens} tokens")
        buf = bytearray(memoryview(blob)[start:start + size])  # one copy: the tensors below are views of it
        at, out = 0, []
        for i, (h, dk, dv) in enumerate(self.shapes):
            pair = []
            for w, d in enumerate((dk, dv)):
                nb = self._part_bytes(i, w, tokens)
                if self._codecs is None:
                    t = torch.frombuffer(buf, dtype=self.dtype, count=nb // self.dtype.itemsize, offset=at)
                    pair.append(t.view(1, h, tokens, d).to(device))  # [1, H, C, D]
                else:
                    bc = self._codecs[i][w]
                    rows = torch.frombuffer(buf, dtype=torch.uint8, count=nb, offset=at)
                    rows = rows.view(1, h, tokens // bc.g, bc.row_bytes).to(device)  # [1, H, C / G, row]
                    x = torch.empty((1, h, tokens, d), dtype=self.dtype, device=device)  # [1, H, C, D]
                    bc.decode_plain(rows, x, remember=False)
                    pair.append(x)
                at += nb
            out.append(tuple(pair))
        return out


def _raw(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()
