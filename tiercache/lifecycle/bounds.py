"""What ``load`` takes from a file's header, and what it does not: the checks that keep a hostile
or corrupted save from making ``TieredCache.load`` write files where it chooses or allocate more
than the file holds.

    confine_offload(policy, offload_path) -> dict
        the saved policy (a dict) with every disk tier's ``offload.path`` set to ``offload_path``
        (the caller's; ``None``: a fresh directory of the disk tier's own under the system temp
        directory). A path written in the file is never used: it names a place of the saving
        machine, and a file must not choose where this process creates files.
    offload_paths(policy) -> set
        the ``offload.path`` values a policy (a dict) names for disk tiers (``None`` for the default)
    spare_room(sd) -> dict
        a layer state with every growable buffer's ``capacity`` bounded by the tokens it holds:
        at most ``held + 2 * CHUNK`` (a buffer that grew or slid keeps less than that spare), none
        for a buffer holding no token. Room only: the held tokens are all kept, and a buffer
        regrows as it is appended to.
    max_bytes_for(file_size, model) -> int
        the default bound on what a load allocates (every tier: device, host, disk files):
        ``LOAD_RATIO`` times the file's size, plus ``2 * CHUNK`` tokens of room per layer for one
        batch row of the model at 4 bytes per element (the first chunk a small save allocates).
        A save whose cache preallocates more (``storage: static`` with a long ``max_length``) needs
        ``max_bytes=`` from the caller.
"""

from __future__ import annotations

import copy

import torch

from tiercache.layers.capacity import CHUNK

LOAD_RATIO = 64  # bytes a load may allocate per byte of the file (a cropped cache keeps its room)


def _disk_sections(node):
    """Every ``offload`` mapping with ``device: disk`` in a policy dict (top level, overrides, cross-attention)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "offload" and isinstance(value, dict) and value.get("device") == "disk":
                yield value
            yield from _disk_sections(value)
    elif isinstance(node, (list, tuple)):
        for value in node:
            yield from _disk_sections(value)


def confine_offload(policy, offload_path) -> dict:
    if not isinstance(policy, dict):
        return policy  # Policy.from_dict names the problem
    out = copy.deepcopy(policy)
    for section in _disk_sections(out):
        section["path"] = None if offload_path is None else str(offload_path)
    return out


def offload_paths(policy) -> set:
    return {section.get("path") for section in _disk_sections(policy)}


def spare_room(sd: dict) -> dict:
    out = dict(sd)
    for key, capacity in sd.items():
        if not (key == "capacity" or key.endswith(".capacity")) or not isinstance(capacity, int) \
                or isinstance(capacity, bool):
            continue
        held = sd.get(key[: -len("capacity")] + "keys")
        if isinstance(held, torch.Tensor) and held.dim() == 4:
            n = held.shape[2]  # [B, H, n, D]
            out[key] = 0 if n == 0 else min(capacity, n + 2 * CHUNK)
    return out


def max_bytes_for(file_size: int, model) -> int:
    per_token = sum(h * (dk + dv) for h, dk, dv in (model.kv_shape(i) for i in range(model.num_layers)))
    try:
        element = max(4, model.dtype_bytes)
    except KeyError:  # a dtype without a byte count: the widest there is
        element = 8
    return LOAD_RATIO * int(file_size) + 2 * CHUNK * per_token * element
