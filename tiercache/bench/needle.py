"""Where a model reads a hidden key: each layer's and head's attention on the needle, at full precision.

Interface
- ``span(sample, tokenizer, fmt="passkey") -> slice``: the needle's token positions in
  ``sample.context`` (a ``retrieval.Sample``).
- ``attention(model, sample, needle) -> Tensor [L, Hq]``: the attention weight the question's
  last token (the step that predicts the answer's first token) puts on the tokens of ``needle``
  (a slice of the context), per layer and query head, in one full-precision forward of context +
  question without a cache.
- ``mean_attention(model, tokenizer, samples, fmt="passkey") -> Tensor [L, Hq]``: averaged over samples.
- ``table(att, threshold=0.4) -> str``: per layer, its strongest head and the mean over heads,
  marking the layers whose strongest head reaches ``threshold``.

How: for the one forward, the model's attention runs as its own eager attention (the
``eager_attention_forward`` of the model's modeling module: its masking, scaling, soft-capping
and sliding windows, not a copy) behind a recorder registered with transformers'
``AttentionInterface``, with the eager mask; the model's implementation is restored after.

Why: the layers whose heads read the needle are where the quantized context has to keep its
share of attention for a pass key to be found; a ``key_gain`` given to those layers only (a
per-layer override) buys retrieval there without the text cost of a gain everywhere (README,
"A gain where the retrieval heads read").
"""

from __future__ import annotations

import sys

import torch

from tiercache.bench import retrieval
from tiercache.bench.texts import encode

NAME = "tiercache_needle"
_RECORD: dict = {}


def span(sample, tokenizer, fmt: str = "passkey") -> slice:
    form = retrieval.FORMATS[fmt]
    needle = encode(tokenizer, form.needle.format(key=sample.key, name=sample.name))
    ids = sample.context.tolist()
    for i in range(len(ids) - len(needle) + 1):
        if ids[i : i + len(needle)] == needle:
            return slice(i, i + len(needle))
    raise ValueError(f"the needle for key {sample.key} is not in the sample's context (format {fmt!r})")


def _recorder(module, query, key, value, attention_mask, **kwargs):
    eager = sys.modules[type(module).__module__].eager_attention_forward
    out, weights = eager(module, query, key, value, attention_mask, **kwargs)  # weights [B, Hq, Q, K]
    needle = _RECORD["needle"]
    _RECORD["layers"][module.layer_idx] = weights[0, :, -1, needle].float().sum(-1)  # [Hq]
    return out, weights


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(NAME, _recorder)
    AttentionMaskInterface.register(NAME, eager_mask)


@torch.no_grad()
def attention(model, sample, needle: slice) -> torch.Tensor:
    _register()
    before = model.config._attn_implementation
    _RECORD.clear()
    _RECORD.update(needle=needle, layers={})
    ids = torch.cat([sample.context, sample.question]).to(model.device)[None]  # [1, T + Q]
    model.set_attn_implementation(NAME)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    layers = _RECORD.pop("layers")
    n = model.config.num_hidden_layers
    if sorted(layers) != list(range(n)):
        raise RuntimeError(f"recorded attention for layers {sorted(layers)}, expected 0..{n - 1}: the model's "
                           "attention does not run through transformers' attention interface")
    return torch.stack([layers[i] for i in range(n)]).cpu()  # [L, Hq]


def mean_attention(model, tokenizer, samples, fmt: str = "passkey") -> torch.Tensor:
    if not samples:
        raise ValueError("mean_attention needs at least one sample")
    return torch.stack([attention(model, s, span(s, tokenizer, fmt)) for s in samples]).mean(0)  # [L, Hq]


def table(att: torch.Tensor, threshold: float = 0.4) -> str:
    lines = ["| layer | strongest head | its weight on the needle | mean over heads | reads the needle |",
             "|---|---|---|---|---|"]
    for i, row in enumerate(att):
        top = int(row.argmax())
        lines.append(f"| {i} | {top} | {float(row[top]):.3f} | {float(row.mean()):.3f} | "
                     f"{'yes' if float(row[top]) >= threshold else ''} |")
    return "\n".join(lines)
