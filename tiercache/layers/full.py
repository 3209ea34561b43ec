"""``full`` storage: every token, in a growable buffer (chunked capacity, views out, no per-token cat)."""

from __future__ import annotations

import torch

from tiercache.layers.base import check_crop
from tiercache.layers.buffer import CHUNK, Buffer, BufferedLayer
from tiercache.layers.state import check_ingest, expect, nest, part
from tiercache.layers.tiers import ComputeTier


class FullLayer(BufferedLayer):
    """``step(key, value)``: the buffer's unchecked one-token write (``Buffer.step``; ``None`` when
    it cannot take the token there), which ``TieredCache.update`` calls before any check of its own
    (torch's ``index_copy_`` refuses a pair of another layout). Only this layer has it: a wrapper's
    ``append`` does more than write."""

    def __init__(self, tier=None, chunk: int = CHUNK, geometric: bool = True):
        # chunk: capacity unit (tokens); geometric: regrow on capacity.grown_capacity's ladder
        self.buffer = Buffer(tier or ComputeTier(), chunk, geometric)
        self.tier = self.buffer.tier
        self.step = self.buffer.step

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.buffer.append_view(key, value)  # [B, H, S, D] views

    def seq_length(self) -> int:
        return len(self.buffer)

    def crop(self, n: int) -> None:
        self.buffer.truncate(check_crop(n, self.seq_length()))

    def reserve(self, tokens: int) -> None:
        self.buffer.reserve(tokens)

    def reset(self) -> None:
        self.buffer.clear()
        self.buffer.reset_reserve()

    def state_dict(self) -> dict:
        return {"kind": "full", **nest("buffer.", self.buffer.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, "full")
        self.buffer.load_state_dict(part(sd, "buffer."), "full")

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        self.buffer.ingest(key, value, check_ingest(key, value, seen, "full", whole=True))
