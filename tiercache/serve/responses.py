"""OpenAI response objects for one request: ``Shape(req, rid, model, fingerprint)``.

    shape.full(choices, usage) -> dict        a whole ``chat.completion`` / ``text_completion``;
                                              choices: [Choice] (text, finish_reason, logprobs)
    shape.chunk(index, delta, finish_reason=None, logprobs=None) -> dict   one streamed chunk
    shape.usage_chunk(usage) -> dict; Shape.sse(obj) -> "data: ...\\n\\n"
    summed_usage([usage of each choice]) -> usage   prompt counted once, completions added up
    fingerprint(model_name, policy_name) -> "fp_..."   ``system_fingerprint``: the same for the
                                              same tiercache version, model and serving policy

Log-probabilities come from ``sampling.Sampler`` entries (``{"token", "logprob", "bytes", "top":
[(id, token, logprob, bytes)]}``) and are shaped per route: chat ``{"content": [{"token",
"logprob", "bytes", "top_logprobs": [...]}], "refusal": null}``; completions ``{"tokens",
"token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, the offsets counted in
characters of the choice's text from its first token (``Choice.offset`` carries on across chunks).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field

from tiercache import __version__


def fingerprint(model_name: str, policy_name: str) -> str:
    digest = hashlib.sha256(f"tiercache {__version__}|{model_name}|{policy_name}".encode()).hexdigest()
    return "fp_" + digest[:10]


@dataclass
class Choice:
    index: int
    parts: list = field(default_factory=list)  # text deltas
    entries: list = field(default_factory=list)  # sampler log-probability entries
    finish_reason: str | None = None
    usage: dict | None = None
    offset: int = 0  # completions' text_offset so far

    @property
    def text(self) -> str:
        return "".join(self.parts)


def summed_usage(usages: list[dict]) -> dict:
    first = usages[0]
    completion = sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": first["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": first["prompt_tokens"] + completion,
            "prompt_tokens_details": dict(first["prompt_tokens_details"])}


class Shape:
    def __init__(self, req, rid: str, model: str, fingerprint: str):
        self.req, self.rid, self.model, self.fp, self.created = req, rid, model, fingerprint, int(time.time())
        self.chat = req.kind == "chat"
        self.object = "chat.completion" if self.chat else "text_completion"
        self.chunk_object = "chat.completion.chunk" if self.chat else "text_completion"

    def _head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fp}

    def logprobs(self, entries: list, choice: Choice):
        """The ``logprobs`` of a choice (or of one chunk's entries); ``None`` when not asked for."""
        if self.req.logprobs is None:
            return None
        if self.chat:
            return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                                 "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for _, t, lp, b in e["top"]]}
                                for e in entries], "refusal": None}
        offsets = []
        for e in entries:
            offsets.append(choice.offset)
            choice.offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t: lp for _, t, lp, _ in e["top"]} for e in entries], "text_offset": offsets}

    def full(self, choices: list[Choice], usage: dict) -> dict:
        out = []
        for c in sorted(choices, key=lambda c: c.index):
            body = {"message": {"role": "assistant", "content": c.text, "refusal": None}} if self.chat else {"text": c.text}
            out.append({"index": c.index, **body, "finish_reason": c.finish_reason,
                        "logprobs": self.logprobs(c.entries, c)})
        return {**self._head(self.object), "choices": out, "usage": usage}

    def chunk(self, index: int, delta, finish_reason=None, logprobs=None) -> dict:
        key = "delta" if self.chat else "text"
        out = {**self._head(self.chunk_object),
               "choices": [{"index": index, key: delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: dict) -> dict:
        return {**self._head(self.chunk_object), "choices": [], "usage": usage}

    @staticmethod
    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"
