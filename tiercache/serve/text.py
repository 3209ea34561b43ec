"""Incremental detokenization: ``TextStream(decode, stops)``.

    stream.push(token_id) -> str   text that is now safe to send (may be "")
    stream.finish() -> str         what was held back, at the end (nothing after a stop)
    stream.stopped                 a stop string was generated; ``stream.text`` ends before it

Text is held back while it might still become a stop string (its tail is a prefix of one) or
ends in an incomplete UTF-8 character (U+FFFD from a partial byte sequence), so a streamed
answer never shows a stop string and always equals the non-streamed one.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, decode, stops=()):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""  # sent so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        full = self.decode(self.ids)
        cut = self._stop_at(full)
        if cut is not None:
            self.stopped = True
            return self._send(full[:cut])
        return self._send(full[: len(full) - self._held(full)])

    def finish(self) -> str:
        return "" if self.stopped else self._send(self.decode(self.ids))

    def _send(self, upto: str) -> str:
        delta = upto[len(self.text):] if len(upto) > len(self.text) else ""
        self.text += delta
        return delta

    def _stop_at(self, full: str):
        start = max(0, len(self.text) - max((len(s) for s in self.stops), default=0))
        hits = [i for i in (full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held(self, full: str) -> int:
        held = len(full) - len(full.rstrip("\ufffd"))
        for s in self.stops:
            for k in range(min(len(s) - 1, len(full)), 0, -1):
                if full.endswith(s[:k]):
                    held = max(held, k)
                    break
        return held
