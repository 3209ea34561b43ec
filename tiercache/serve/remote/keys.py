"""Chunk addresses: which Redis key holds the K/V of a run of tokens.

    fp = model_fingerprint(model, name)              hex digest: architecture, KV shapes, dtype, weights
    keys = chunk_keys(ids, chunk_tokens, namespace, scope="")
                                                     one key per *whole* chunk of ``ids``, in order;
                                                     ``scope``: a ``tenants.Scope.digest``
    namespace = f"tiercache:v1:{fp}:{format_name}"   (``RemoteTier`` builds it)

A chunk's hash is chained: ``h_i = sha256(h_{i-1} || ids of chunk i as int32 little-endian)``
with ``h_{-1} = sha256(namespace)`` (``sha256(namespace || ":" || scope)`` for a scope other than
the shared one: a tenant, a ``cache_salt``), so a key names its whole prefix and its scope, not
only its own tokens, and two conversations share a chunk exactly when they share every token up
to its end and their scope. The scope is hashed in, never written in the key. The
namespace carries the model fingerprint and the chunk's block format, so another model, other
weights or another format never read these chunks. Python's ``hash()`` is never used (it is
salted per process).

The fingerprint covers ``lifecycle.persist.fingerprint`` (what a saved cache must agree on with
its model), the model's name, and the weights: each parameter's name, shape and dtype and a
sha256 of its first and last 64 KiB (enough to tell a trained model from its random twin or a
fine-tune, without hashing every byte at start).
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

_SAMPLE = 64 * 1024  # bytes of each parameter's head and tail in the fingerprint


def model_fingerprint(model, name: str) -> str:
    from tiercache.lifecycle.persist import fingerprint
    from tiercache.models.spec import ModelSpec, model_type_of

    h = hashlib.sha256()
    spec = ModelSpec.from_config(model.config)
    h.update(json.dumps({"name": name, "model": fingerprint(spec, model_type_of(model.config))},
                        sort_keys=True).encode())
    for pname, p in sorted(model.state_dict().items()):
        h.update(f"{pname}:{tuple(p.shape)}:{p.dtype}".encode())
        raw = p.detach().reshape(-1).contiguous().view(torch.uint8) if p.numel() else torch.empty(0, dtype=torch.uint8)
        h.update(raw[:_SAMPLE].cpu().numpy().tobytes())  # sliced on its device: only the samples move
        h.update(raw[-_SAMPLE:].cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def chunk_keys(ids, chunk_tokens: int, namespace: str, scope: str = "") -> list[str]:
    """Keys of the whole chunks of ``ids`` (a partial last chunk has none), in ``scope`` ("": shared)."""
    whole = len(ids) // chunk_tokens
    arr = np.asarray(list(ids[:whole * chunk_tokens]), dtype="<i4")
    digest = hashlib.sha256((namespace + (f":{scope}" if scope else "")).encode()).digest()
    keys = []
    for i in range(whole):
        digest = hashlib.sha256(digest + arr[i * chunk_tokens:(i + 1) * chunk_tokens].tobytes()).digest()
        keys.append(f"{namespace}:{digest.hex()}")
    return keys
