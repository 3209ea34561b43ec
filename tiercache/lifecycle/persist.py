"""``save(cache, path, token_ids)`` / ``load(cls, path, model, model_type)``: a cache on disk.

One file, in the safetensors format (readable by any safetensors tool), written as held:
packed codes and scales of quantized blocks (never dequantized), residual windows, sliding
windows, static buffers (the held tokens), disk-tier contents. Its ``__metadata__`` holds one
entry, ``tiercache``, a JSON header:
    format ("tiercache-cache"), format_version (1), tiercache_version, policy (the resolved
    policy as a dict), model (a fingerprint: model_type, layer kinds, KV shape per layer, dtype,
    window, KV sharing), seen (tokens seen), token_ids (or null), layers (per layer: its
    state's plain values and the names of its tensors), sha256 (per tensor, of its bytes),
    kind ("decoder-only", the default when absent, or "encoder-decoder").
An encoder-decoder save (``TieredEncoderDecoderCache.save``) is the same file with the
self-attention half as above and its cross-attention half under ``cross_attention`` (its own
policy, seen, layers, and ``is_updated``: transformers' per-layer "cross K/V written" flags),
tensors named ``cross_attention.layers.{i}.``; each half is rebuilt by its own cache class
(``_build``: the class's layer policies), so cross-attention layers come back as such. Loading
one kind as the other is a ``CacheError`` naming both.
So a saved int4 cache takes about its ``nbytes()`` on disk (without the shared workspace).

Atomic: the file is written under a temporary name in the same directory, fsync-ed, then renamed
over ``path`` (and the directory fsync-ed): a crash or kill during ``save`` leaves the previous
save whole. ``load`` checks the format and version, the fingerprint against the model (naming
the field that differs) and every tensor's sha256; any problem (missing, truncated, corrupted
file, other model, unknown version) is a ``CacheError`` and no cache is returned (the one being
built is closed). Nothing is unpickled: tensors are raw bytes, the rest is JSON.

What a file cannot make ``load`` do (``tiercache.lifecycle.bounds``): create files outside a
directory of the disk tier's own under the system temp directory (a saved ``offload.path`` is
replaced by the caller's ``offload_path``, default none); allocate more than ``max_bytes`` in all
(default ``bounds.max_bytes_for``: 64 times the file's size plus one chunk of room per layer),
counted by every tier before it allocates (``tiercache.layers.allowance``), with a growable
buffer's saved spare room bounded by the tokens it holds. What it does not check: that the
tensors are the K/V of the saved tokens (a sha256 in the header proves only that the file is
whole, not who wrote it), nor ``token_ids`` beyond their count. Load only files you trust to be
what they say; a file from elsewhere can give wrong answers, never a write or an allocation
outside these bounds.
Tensors are written one at a time (two passes: hash, then write), so saving needs no second
copy of the cache in memory; loading reads and loads one layer at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import torch

from tiercache.errors import CacheError, PolicyError
from tiercache.runtime import canonical_device
from tiercache.layers import allowance
from tiercache.lifecycle import bounds
from tiercache.policy.schema import Policy

FORMAT, VERSION = "tiercache-cache", 1
DECODER_ONLY, ENCODER_DECODER, CROSS = "decoder-only", "encoder-decoder", "cross_attention"
_ST = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
       torch.uint8: "U8", torch.int8: "I8", torch.int64: "I64", torch.float8_e4m3fn: "F8_E4M3",
       torch.float8_e5m2: "F8_E5M2"}


def fingerprint(model, model_type: str | None) -> dict:
    """What a save must agree on with the model it is loaded for (from its ``ModelSpec``)."""
    return {"model_type": model_type, "num_layers": model.num_layers, "layer_types": list(model.layer_types),
            "kv_shapes": [list(model.kv_shape(i)) for i in range(model.num_layers)], "dtype": model.dtype,
            "sliding_window": model.sliding_window,
            "kv_sharing": None if model.kv_sharing_modes is None else list(model.kv_sharing_modes)}


def save(cache, path, token_ids=None, cross=None, is_updated=None) -> None:
    """``cross``: the cross-attention half of an encoder-decoder cache (``cache`` is then its
    self-attention half), saved in the same file with ``is_updated`` (transformers' per-layer flags)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise CacheError(f"save: {path!r} is a directory; give a file path (e.g. cache.safetensors)")
    ids = _token_ids(token_ids, _seen(cache), cache.batch_size)
    tensors: dict = {}
    from tiercache import __version__

    header = {"format": FORMAT, "format_version": VERSION, "tiercache_version": __version__,
              "kind": DECODER_ONLY if cross is None else ENCODER_DECODER,
              "model": fingerprint(cache.model, cache.model_type), "token_ids": ids, **_half(cache, "", tensors)}
    if cross is not None:
        header[CROSS] = {**_half(cross, f"{CROSS}.", tensors),
                         "is_updated": [bool(is_updated.get(i, False)) for i in range(len(cross.layers))]}
    header["sha256"] = {name: _sha256(t) for name, t in tensors.items()}
    _write_atomic(path, tensors, json.dumps(header))


def _half(cache, prefix: str, tensors: dict) -> dict:
    """One cache's header entries (policy, seen, layers); its tensors go to ``tensors`` as ``{prefix}layers.{i}.``."""
    layers = []
    for i, layer in enumerate(cache.layers):
        state, names = {}, []
        for key, value in layer.state_dict().items():
            if isinstance(value, torch.Tensor):
                if value.dtype not in _ST:
                    raise CacheError(f"save: {prefix}layer {i} holds {key} as {value.dtype}, which has no "
                                     "safetensors type")
                tensors[f"{prefix}layers.{i}.{key}"] = value
                names.append(key)
            else:
                state[key] = value
        layers.append({"state": state, "tensors": names})
    return {"policy": cache.policy.to_dict(), "seen": _seen(cache), "layers": layers}


def load(cls, path, model, model_type: str | None, device=None, cross_cls=None, offload_path=None, max_bytes=None):
    """``device``: the compute device to load onto (default: the one it was saved from).
    ``cross_cls`` given: an encoder-decoder save is expected and ``(self_attention, cross_attention,
    is_updated)`` come back, the cross half built by ``cross_cls`` (its own layer policies).
    ``offload_path``: where disk tiers put their files (default: the system temp directory; the
    path in the file is never used). ``max_bytes``: the most the load may allocate (default:
    ``bounds.max_bytes_for(file size, model)``)."""
    path = os.fspath(path)
    if device is not None:
        try:
            device = str(canonical_device(device))  # cuda -> cuda:<current>: what its tensors report
        except (RuntimeError, TypeError) as e:
            raise CacheError(f"load: device must be a torch device such as 'cpu' or 'cuda:0', got {device!r}") from e
    if not os.path.isfile(path):
        raise CacheError(f"load: no saved cache at {path!r}" + (" (a directory)" if os.path.isdir(path) else ""))
    if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0):
        raise CacheError(f"load: max_bytes must be an int >= 0 (bytes), got {max_bytes!r}")
    limit = bounds.max_bytes_for(os.path.getsize(path), model) if max_bytes is None else max_bytes
    from safetensors import safe_open

    built = []
    hint = ("the header asks for more than the file holds (a corrupted or foreign save?); a cache that "
            "preallocates (storage: static) loads with max_bytes= set to what it needs")
    try:
        with safe_open(path, framework="pt") as f, allowance.within(limit, "load", hint):
            header = _header(f.metadata(), path)
            _check_kind(header, cross_cls is not None, path)
            _check_model(header["model"], fingerprint(model, model_type), path)
            halves = [(cls, "", header)] + ([(cross_cls, f"{CROSS}.", header[CROSS])] if cross_cls else [])
            for kind, prefix, entry in halves:
                built.append(_load_half(kind, f, entry, prefix, header["sha256"], model, model_type, path, device,
                                        offload_path))
    except BaseException as e:
        for cache in built:
            cache.close()
        if isinstance(e, CacheError) or not isinstance(e, Exception):
            raise
        # safetensors: truncated or malformed file
        raise CacheError(f"load: {path!r} is not a readable tiercache save (truncated or corrupted?): {e}") from e
    built[0].token_ids = header.get("token_ids")
    if cross_cls is None:
        return built[0]
    flags = header[CROSS].get("is_updated") or []
    return built[0], built[1], {i: bool(x) for i, x in enumerate(flags)}


def _load_half(cls, f, entry: dict, prefix: str, sums: dict, model, model_type, path: str, device, offload_path):
    if not isinstance(entry, dict):
        raise CacheError(f"load: {path!r}: the header's {prefix or 'cache'} entry is not an object (corrupted save)")
    for key in ("policy", "layers", "seen"):
        if key not in entry:
            raise CacheError(f"load: {path!r}: the header lacks {prefix}{key!r} (corrupted save)")
    try:
        policy = Policy.from_dict(bounds.confine_offload(entry["policy"], offload_path))
    except PolicyError as e:
        raise CacheError(f"load: {path!r}: the saved {prefix}policy is invalid: {e}") from e
    try:
        cache = cls._build(policy, model, model_type)
    except PolicyError as e:  # e.g. a cross-attention half for a decoder-only model
        raise CacheError(f"load: {path!r}: {e}") from e
    try:
        _load_layers(cache, f, entry, sums, prefix, path, device)
    except BaseException:
        cache.close()
        raise
    return cache


# -- reading ---------------------------------------------------------------------------------------
def _header(metadata, path: str) -> dict:
    try:
        header = json.loads((metadata or {})["tiercache"])
    except (KeyError, TypeError, ValueError) as e:
        raise CacheError(f"load: {path!r} has no tiercache header: not a cache saved by tiercache") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        got = header.get("format") if isinstance(header, dict) else type(header).__name__
        raise CacheError(f"load: {path!r} is not a tiercache cache save (format {got!r})")
    if header.get("format_version") != VERSION:
        raise CacheError(f"load: {path!r} has format_version {header.get('format_version')!r}; this tiercache "
                         f"reads version {VERSION} (saved by tiercache {header.get('tiercache_version')!r})")
    for key in ("model", "sha256"):
        if key not in header:
            raise CacheError(f"load: {path!r}: the header lacks {key!r} (corrupted save)")
    return header


def _check_kind(header: dict, encoder_decoder: bool, path: str) -> None:
    kind = header.get("kind", DECODER_ONLY)  # saves before encoder-decoder support were all decoder-only
    want = ENCODER_DECODER if encoder_decoder else DECODER_ONLY
    if kind not in (DECODER_ONLY, ENCODER_DECODER) or (kind == ENCODER_DECODER and CROSS not in header):
        raise CacheError(f"load: {path!r}: unknown save kind {kind!r} (corrupted save?); allowed: "
                         f"{DECODER_ONLY!r}, {ENCODER_DECODER!r}")
    if kind != want:
        how = "tiercache.TieredEncoderDecoderCache.load" if kind == ENCODER_DECODER else "TieredCache.load"
        article = {DECODER_ONLY: "a", ENCODER_DECODER: "an"}
        raise CacheError(f"load: {path!r} holds {article[kind]} {kind} cache, not {article[want]} {want} one; "
                         f"load it with {how}")


def _check_model(saved: dict, given: dict, path: str) -> None:
    for key, want in given.items():
        have = saved.get(key)
        if key == "model_type" and (have is None or want is None):
            continue  # a ModelSpec has no model_type: the shapes still decide
        if have != want:
            raise CacheError(f"load: {path!r} was saved for another model: {key} is {have!r} in the save, "
                             f"{want!r} for this model")


def _relocate(sd: dict, device: str | None, path: str) -> dict:
    """Point a layer state's compute device at ``device`` (or check that the saved one exists)."""
    for key, value in sd.items():
        if key.endswith("spec") and isinstance(value, dict) and "device" in value:
            value = sd[key] = {**value, "device": device or value["device"]}
            where = value["device"]
        elif (key == "device" or key.endswith(".device")) and isinstance(value, str):
            where = sd[key] = device or value
        else:
            continue
        if torch.device(where).type == "cuda" and not torch.cuda.is_available():
            how = f"device={device!r} was asked" if device else f"{path!r} was saved on {where}"
            raise CacheError(f"load: {how} and CUDA is not available here; "
                             "pass device='cpu' (or another device) to load it there")
    return sd


def _load_layers(cache, f, header: dict, sums: dict, prefix: str, path: str, device: str | None) -> None:
    layers = header["layers"]
    if not isinstance(layers, list) or len(layers) != len(cache.layers):
        raise CacheError(f"load: {path!r}: header has {len(layers) if isinstance(layers, list) else layers!r} "
                         f"{prefix}layers, the model {len(cache.layers)} (corrupted save)")
    for i, (layer, entry) in enumerate(zip(cache.layers, layers)):
        sd = _relocate(dict(entry["state"]), device, path)
        for key in entry["tensors"]:
            name = f"{prefix}layers.{i}.{key}"
            t = f.get_tensor(name)
            if _sha256(t) != sums.get(name):
                raise CacheError(f"load: {path!r}: tensor {name} fails its sha256 check (corrupted save)")
            sd[key] = t
        sd = bounds.spare_room(sd)
        try:
            layer.load_state_dict(sd)
        except CacheError as e:
            raise CacheError(f"load: {path!r}: {prefix}layer {i}: {e}") from e
    if _seen(cache) != header["seen"]:
        raise CacheError(f"load: {path!r}: {prefix}layers hold {_seen(cache)} tokens, the header says "
                         f"{header['seen']} (corrupted save)")


def _seen(cache) -> int:
    """Tokens the cache's attention layers hold; 0 for a model without attention layers (Mamba:
    its states count no tokens, as transformers' linear-attention layers)."""
    return cache.get_seq_length() if any(cache.model.attends(i) for i in range(len(cache.layers))) else 0


# -- writing ---------------------------------------------------------------------------------------
def _token_ids(token_ids, seen: int, batch: int):
    """The ids as JSON lists, checked against the cache: they must cover every token it holds (a
    ``generate`` output, one token past the cache, is fine; fewer ids would let a caller's "does my
    prompt extend the saved one?" check pass for tokens the cache does not hold), one row per batch
    row when nested (a flat list stands for a batch of one)."""
    if token_ids is None:
        return None
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    try:
        out = json.loads(json.dumps(list(token_ids)))
    except (TypeError, ValueError) as e:
        raise CacheError(f"save: token_ids must be a list (or nested lists / a tensor) of ints, got {token_ids!r}") from e
    rows = out if out and isinstance(out[0], list) else [out]
    if not all(isinstance(row, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in row) for row in rows):
        raise CacheError(f"save: token_ids must be ints, got {token_ids!r}")
    if batch > 0 and len(rows) != batch:
        raise CacheError(f"save: token_ids has {len(rows)} row(s), the cache holds a batch of {batch}; give one "
                         "list of ids per batch row (a flat list for a batch of one)")
    if min(len(row) for row in rows) < seen:
        raise CacheError(f"save: token_ids has {min(len(row) for row in rows)} ids, the cache holds {seen} tokens; "
                         f"give the ids of all {seen} (or a generate output, which ends one token past the cache)")
    return out


def _bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    return memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(t)).hexdigest()


def _write_atomic(path: str, tensors: dict, header_json: str) -> None:
    entries, at = {}, 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _ST[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
        at += n
    head = json.dumps({"__metadata__": {"tiercache": header_json}, **entries}).encode()
    head += b" " * (-len(head) % 8)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        raise CacheError(f"save: cannot write in {directory!r}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(len(head).to_bytes(8, "little"))
            out.write(head)
            for t in tensors.values():
                out.write(_bytes(t))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise CacheError(f"save: writing {path!r} failed: {e.strerror or e} (the previous save, if any, "
                             "is untouched)") from e
        raise
