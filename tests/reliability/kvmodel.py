"""The chains users get, and a plain full-precision model of each layer to check them against.

``CHAINS`` is the grid storage x quantize x offload, each a ``Chain``; ``Chain.build(path)``
makes a ``TieredCache`` through ``TieredCache.from_policy(Policy.from_dict(...), SPEC)``, which
is ``chain.build_layers(policy.resolve(spec))``: exactly what a user's policy builds. The model
has three layers, ``full, sliding, full``, so every cache holds a sliding layer next to the
policy's storage; offloading policies also offload the sliding layer (an override), so the
prefetcher cycles through three layers.

``Ref`` is one layer's plain model: every token ever written, in one full-precision tensor
(``torch.cat``), plus the few numbers that say what a layer of that kind shows:

- full: all tokens; static: all tokens in a ``max_length`` view (the tail is masked) when the
  cache is compileable as a whole, else exactly the tokens held (as full);
- sliding: the last ``window - 1 + T`` tokens (transformers' contract), keeping the last
  ``window - 1`` (all of them while recording) for crops;
- quantized: leading tokens that the layer has packed into blocks are replaced, once, by the
  codec's quantize-dequantize of those same blocks (``codec.roundtrip``), after the update that
  packed them (that update still returns them exact). Which tokens are packed is read from the
  layer's block store (``store.seq_length()`` blocks of ``group_size``), so the model follows the
  residual rule whatever it is and the comparison stays exact (``torch.equal``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tiercache.cache.tiered import TieredCache
from tiercache.models.spec import ModelSpec
from tiercache.policy.schema import Policy
from tiercache.offload.processor import Offload
from tiercache.quantize.processor import Quantize

H, DK, DV = 2, 8, 6  # kv heads, key head dim, value head dim (they may differ)
MAX_LENGTH = 40  # static storage
PROGRAM_OPS = 40 if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else 14  # operations per program
LAYER_KINDS = ("full_attention", "sliding_attention", "full_attention")

STORAGES = {"full": {}, "static": {"storage": "static", "max_length": MAX_LENGTH}}
QUANTIZE = {
    "fp": None,
    "int4-g4-r4": {"bits": 4, "group_size": 4, "residual_length": 4},
    "int2-g2-r0-tok": {"bits": 2, "group_size": 2, "residual_length": 0, "key_axis": "token"},
    "int8-g4-r3-swap": {"bits": 8, "group_size": 4, "residual_length": 3, "key_axis": "token", "value_axis": "channel"},
    "int4-g8-r5": {"bits": 4, "group_size": 8, "residual_length": 5},
}
OFFLOAD = {
    "resident": None,
    "host-p0": {"device": "cpu", "prefetch": 0},
    "host-p1": {"device": "cpu", "prefetch": 1},
    "host-p2": {"device": "cpu", "prefetch": 2},
    "disk-p1": {"device": "disk", "prefetch": 1},
}


def spec(window: int) -> ModelSpec:
    return ModelSpec("tiny-reliability", len(LAYER_KINDS), LAYER_KINDS, kv_heads=H, head_dim=DK,
                     sliding_window=window, dtype="float32")


@dataclass(frozen=True)
class Chain:
    storage: str
    quantize: str
    offload: str
    window: int = 5
    dtype: torch.dtype = torch.float32

    @property
    def id(self) -> str:
        dt = "" if self.dtype == torch.float32 else "-" + str(self.dtype).replace("torch.", "")
        return f"{self.storage}-{self.quantize}-{self.offload}-w{self.window}{dt}"

    @property
    def quantized(self) -> bool:
        return QUANTIZE[self.quantize] is not None

    @property
    def on_disk(self) -> bool:
        return self.offload.startswith("disk")

    def policy(self, path: str | None = None) -> dict:
        d = {"name": self.id, **STORAGES[self.storage]}
        if self.quantized:
            d["quantize"] = dict(QUANTIZE[self.quantize])
        off = OFFLOAD[self.offload]
        if off is not None:
            off = dict(off, **({"path": path} if off["device"] == "disk" else {}))
            d["offload"] = off
            d["overrides"] = [{"layer_type": "sliding_attention", "offload": off}]
        return d

    def build(self, path: str | None = None) -> TieredCache:
        return TieredCache.from_policy(Policy.from_dict(self.policy(path)), spec(self.window))

    def refs(self, cache: TieredCache) -> list["Ref"]:
        out = []
        for i, kind in enumerate(LAYER_KINDS):
            sliding = kind == "sliding_attention"
            storage = "sliding" if sliding else ("static" if self.storage == "static" else "full")
            out.append(Ref(storage, window=self.window if sliding else None, limit=MAX_LENGTH,
                           quant=quantizer(cache.layers[i]), padded=cache.is_compileable))
        return out


def quantizer(layer) -> Quantize | None:
    return layer if isinstance(layer, Quantize) else None


def describe(layer) -> str:
    """The chain's structure, e.g. ``Quantize(Offload(FullLayer))``."""
    if isinstance(layer, Quantize):
        return f"Quantize({describe(layer.store)})"
    if isinstance(layer, Offload):
        return f"Offload({describe(layer.inner)})"
    return type(layer).__name__


def _grid() -> list[Chain]:
    # windows longer than residual + 1, so that sliding layers are quantized (a window that fits in the
    # residual is kept exact: the sliding-layer rule of Policy.resolve)
    chains = [Chain(s, q, o, window=7 if i % 2 else 8)
              for i, (s, q, o) in enumerate((s, q, o) for s in STORAGES for q in QUANTIZE for o in OFFLOAD)]
    chains += [Chain("full", "int4-g4-r4", "host-p1", window=7, dtype=torch.bfloat16),
               Chain("full", "fp", "disk-p1", window=2, dtype=torch.bfloat16),
               Chain("full", "int2-g2-r0-tok", "resident", window=2)]
    return chains


CHAINS = _grid()


def tokens(batch: int, t: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, H, t, DK, generator=g).to(dtype), torch.randn(batch, H, t, DV, generator=g).to(dtype))


def files_under(path) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def layer_bytes(layer) -> int:
    sizes = layer.nbytes()
    assert all(isinstance(n, int) and n >= 0 for n in sizes.values()), sizes
    return sum(sizes.values())


def snapshot(cache: TieredCache):
    """What the cache holds, by value: per layer ``(seq_length, kv clones, nbytes)``."""
    out = []
    for layer in cache.layers:
        held = layer.kv()
        out.append((layer.seq_length(), None if held is None else tuple(t.clone() for t in held), layer.nbytes()))
    return out


def same_snapshot(a, b) -> bool:
    for (sa, ka, na), (sb, kb, nb) in zip(a, b):
        if sa != sb or na != nb or (ka is None) != (kb is None):
            return False
        if ka is not None and not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ka, kb)):
            return False
    return True


class Ref:
    def __init__(self, storage: str, window: int | None = None, limit: int | None = None, quant: Quantize | None = None,
                 padded: bool = False):
        self.storage, self.window, self.limit, self.quant = storage, window, limit, quant
        self.padded = storage == "static" and quant is None and padded  # shows all max_length slots
        self.k = self.v = None  # [B, H, S, D]: every token, full precision (packed ones round-tripped)
        self.kept_from = 0  # sliding: first position a plain sliding layer still holds
        self.recording = False
        self.packed = 0  # quantized: leading tokens replaced by their quantize-dequantize

    @property
    def seen(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    @property
    def batch(self) -> int | None:
        return None if self.k is None else self.k.shape[0]

    # -- what the layer must answer --------------------------------------------------------------
    def overflows(self, t: int) -> bool:
        return self.storage == "static" and self.seen + t > self.limit

    def update(self, k, v):
        """The expected ``update`` result (compared up to ``n`` tokens: static views span max_length)."""
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        t = k.shape[2]
        if self.storage == "sliding":
            visible = self.window - 1 + t
            out = self.k[:, :, -visible:].clone(), self.v[:, :, -visible:].clone()
            if not self.recording:
                self.kept_from = max(self.kept_from, self.seen - (self.window - 1))
        else:
            out = self.k.clone(), self.v.clone()
        return out

    def out_length(self) -> int | None:
        """Token axis length of ``update`` results, when it is not the expected tensor's own."""
        return self.limit if self.padded else None

    def mask_sizes(self, q: int) -> tuple[int, int]:
        if self.storage == "sliding":
            offset = max(self.seen - self.window + 1, 0)
            return (self.window - 1 + q if self.seen >= self.window else self.seen + q), offset
        if self.padded:
            return self.limit, 0
        return self.seen + q, 0

    def crop_allowed(self, n: int) -> bool:
        """Whether a plain layer of this kind accepts ``crop(n)`` (past the start: every token)."""
        if n < 0:
            return False
        n = min(n, self.seen)
        if self.storage != "sliding" or n == self.seen:  # emptying the layer is always exact
            return True
        held = self.seen - self.kept_from
        return held - n >= min(self.window - 1, self.seen - n)

    # -- following the layer -------------------------------------------------------------------
    def sync_packed(self) -> None:
        """After an update or crop of a quantized layer: round-trip what it packed since."""
        if self.quant is None or self.k is None:
            return
        q = self.quant
        now = q.store.seq_length() * q.g if q.stored else 0
        assert now % q.g == 0 and now <= self.seen, (now, self.seen)
        assert 0 <= self.seen - now < max(q.r, q.g), (self.seen, now)  # the residual is bounded
        if now > self.packed:
            ck, cv = q.codecs
            self.k[:, :, self.packed : now] = ck.roundtrip(self.k[:, :, self.packed : now])
            self.v[:, :, self.packed : now] = cv.roundtrip(self.v[:, :, self.packed : now])
        self.packed = now

    def crop(self, n: int) -> None:
        if self.k is None:
            return
        keep = self.seen - min(n, self.seen)
        self.k, self.v = self.k[:, :, :keep], self.v[:, :, :keep]
        if self.storage == "sliding":
            self.kept_from = min(max(self.kept_from, keep - (self.window - 1)), keep)
        self.packed = min(self.packed, keep)  # sync_packed sets it to the block boundary
        self.sync_packed()

    def gather(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]

    def reset(self) -> None:
        self.k = self.v = None
        self.kept_from = self.packed = 0

    def record_past(self, on: bool) -> None:
        self.recording = on
        if not on and self.storage == "sliding" and self.k is not None:
            self.kept_from = max(self.kept_from, self.seen - (self.window - 1))

    def check_held(self, held) -> None:
        """``kv()`` of the layer: every token (sliding: what a plain sliding layer keeps; a
        quantized sliding layer keeps whole blocks, so a longer suffix of the same tokens)."""
        lo = self.kept_from if self.storage == "sliding" else 0
        want = 0 if self.k is None else self.seen - lo
        if held is None:
            assert want == 0, f"kv() is None, {want} tokens expected"
            return
        n = held[0].shape[2]
        if self.storage == "sliding" and self.quant is not None:
            assert want <= n <= self.seen, (n, want, self.seen)
        else:
            assert n == want, (n, want)
        for h, w in zip(held, (self.k, self.v)):
            assert h.shape[:2] == w.shape[:2] and h.shape[3] == w.shape[3], (h.shape, w.shape)
            assert torch.equal(h, w[:, :, self.seen - n :]), "kv() differs from the reference"


def assert_update(out, want, length: int | None) -> None:
    """``out`` equals ``want`` exactly; with ``length`` (static) the token axis spans it and the
    first ``want``-many tokens are compared."""
    for o, w in zip(out, want):
        n = w.shape[2]
        assert o.shape[:2] == w.shape[:2] and o.shape[3] == w.shape[3], (o.shape, w.shape)
        assert o.shape[2] == (length if length is not None else n), (o.shape, w.shape, length)
        assert o.dtype == w.dtype and o.device == w.device
        assert torch.equal(o[:, :, :n], w), f"values differ: max |diff| {(o[:, :, :n].float() - w.float()).abs().max()}"


