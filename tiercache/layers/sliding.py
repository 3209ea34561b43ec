"""``sliding`` storage: the last ``window`` tokens, for sliding-window layers (Mistral, Gemma ...).

It follows transformers' sliding-window cache contract exactly, so outputs are identical to
``DynamicCache``: an update of ``T`` tokens returns the last ``window - 1 + T`` tokens (held plus
new), then only the last ``window - 1`` are kept. With ``set_recording(True)`` (assisted decoding)
tokens are kept until the next ``crop``, which may then roll back and trims to the window. A
crop is refused (``CacheError``) only when its result could not be exact: when the tokens the
window needs after it were already dropped (past the window without recording; transformers
raises there too, or, recording, keeps a wrong window). Cropping every token (or more) empties
the layer, as in transformers before the window fills.

Memory: a buffer of about ``window + min(window, CHUNK)`` tokens (at least one CHUNK); when its end is reached the kept tokens
slide down to the front (one copy of the window every ``CHUNK`` tokens, not per token). The
slack and the long-update rule are ``layers/capacity.py``'s (``sliding_slack``, ``long_update``,
``sliding_capacity``), which the planner uses too.
"""

from __future__ import annotations

import torch

from tiercache.errors import CacheError
from tiercache.layers.base import check_crop
from tiercache.layers.buffer import CHUNK, Buffer, BufferedLayer
from tiercache.layers.capacity import long_update, sliding_slack
from tiercache.layers.spec import KVSpec
from tiercache.layers.state import check_ingest, expect, field, nest, part
from tiercache.layers.tiers import ComputeTier


class SlidingLayer(BufferedLayer):
    is_sliding = True

    def __init__(self, window: int, tier=None, chunk: int = CHUNK):
        if not isinstance(window, int) or window < 1:
            raise CacheError(f"sliding window must be an int >= 1, got {window!r}")
        self.window = window
        self.buffer = Buffer(tier or ComputeTier(), chunk)  # chunk: capacity added at a time (tokens)
        self.tier = self.buffer.tier
        self.seen = 0  # tokens seen, including those slid out
        self.recording = False
        self.slack = sliding_slack(window, chunk)  # tokens appended between two slides of the window

    def append(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        buf = self.buffer
        t, keep = key.shape[2], self.window - 1
        visible = keep + t
        if not self.recording and long_update(len(buf), t, buf.capacity, buf.chunk):
            # A long update (prefill): attend over held + new once, keep only the window's tail.
            if len(buf):
                hk, hv = buf.view()
                key, value = torch.cat([hk, key], dim=2), torch.cat([hv, value], dim=2)
            out = key[:, :, -visible:], value[:, :, -visible:]
            buf.drop_front(len(buf))
            if keep:
                buf.append(key[:, :, -keep:], value[:, :, -keep:], slack=self.slack)
            elif buf.spec is None:
                buf.spec = KVSpec.read(key, value)
            self.seen += t
            return out
        buf.append(key, value, slack=self.slack)
        self.seen += t
        n = len(buf)
        out = buf.view(max(0, n - visible), n)
        if not self.recording and n > keep:
            buf.drop_front(n - keep)
        return out

    def seq_length(self) -> int:
        return self.seen

    def max_length(self) -> int:
        return self.window

    def set_recording(self, on: bool) -> None:
        self.recording = bool(on)
        if not on:
            self._trim()

    def validate_crop(self, n: int) -> None:
        n = check_crop(n, self.seen)  # past the start: every token (transformers empties the layer)
        held, keep = len(self.buffer), self.window - 1
        # Refused only when the result could not be exact: emptying the layer always is.
        if n < self.seen and held - n < min(keep, self.seen - n):
            raise CacheError(
                f"cannot crop {n} tokens from a sliding layer (window {self.window}) that kept only {held}: "
                "tokens before the window are gone; call activate_past_recording() before "
                "updates you may want to roll back"
            )

    def crop(self, n: int) -> None:
        self.validate_crop(n)
        n = check_crop(n, self.seen)
        self.buffer.truncate(min(n, len(self.buffer)))  # (n > held only when it empties the layer)
        self.seen -= n
        self._trim(always=True)  # a crop ends a recorded step: back to the working size

    def reset(self) -> None:
        self.buffer.clear()
        self.seen = 0

    def state_dict(self) -> dict:
        return {"kind": "sliding", "window": self.window, "seen": self.seen, "recording": self.recording,
                **nest("buffer.", self.buffer.state_dict())}

    def load_state_dict(self, sd: dict) -> None:
        expect(sd, "sliding")
        seen, recording = field(sd, "seen", "sliding"), field(sd, "recording", "sliding", bool)
        if field(sd, "window", "sliding") != self.window:
            raise CacheError(f"state of a sliding layer: window {sd['window']}, this layer's is {self.window}")
        self.buffer.load_state_dict(part(sd, "buffer."), "sliding")
        self.seen, self.recording = seen, recording

    def ingest(self, key: torch.Tensor, value: torch.Tensor, seen: int) -> None:
        """Hold the last ``window - 1`` of the given tokens (all of them while recording)."""
        spec = check_ingest(key, value, seen, "sliding", whole=False)
        keep = key.shape[2] if self.recording else min(key.shape[2], self.window - 1)
        at = key.shape[2] - keep
        self.buffer.ingest(key.narrow(2, at, keep), value.narrow(2, at, keep), spec, slack=self.slack)
        self.seen = seen

    def _trim(self, always: bool = False) -> None:
        extra = len(self.buffer) - (self.window - 1)
        if (always or not self.recording) and extra > 0:
            self.buffer.drop_front(extra)
