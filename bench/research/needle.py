"""Where a model reads a hidden key: each layer's and head's attention on the needle, at full precision.

Interface
- ``attention(model, sample) -> Tensor [L, Hq]``: the attention weight the question's last token
  (the step that predicts the answer's first token) puts on the needle's tokens
  (``sample.needle``, a ``retrieval.Sample``), per layer and query head, in one full-precision
  forward of context + question without a cache.
- ``mean_attention(model, samples) -> Tensor [L, Hq]``: averaged over samples.
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

NAME = "tiercache_needle"


def _register(needle: slice, layers: dict) -> None:
    """The recorder for one forward: each layer's ``[Hq]`` weights on ``needle`` into ``layers``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    def record(module, query, key, value, attention_mask, **kwargs):
        eager = sys.modules[type(module).__module__].eager_attention_forward
        out, weights = eager(module, query, key, value, attention_mask, **kwargs)  # weights [B, Hq, Q, K]
        layers[module.layer_idx] = weights[0, :, -1, needle].float().sum(-1)  # [Hq]
        return out, weights

    AttentionInterface.register(NAME, record)
    AttentionMaskInterface.register(NAME, eager_mask)


@torch.no_grad()
def attention(model, sample) -> torch.Tensor:
    layers = {}
    _register(sample.needle, layers)
    before = model.config._attn_implementation
    ids = torch.cat([sample.context, sample.question]).to(model.device)[None]  # [1, T + Q]
    model.set_attn_implementation(NAME)
    try:
        model(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(before)
    n = model.config.num_hidden_layers
    if sorted(layers) != list(range(n)):
        raise RuntimeError(f"recorded attention for layers {sorted(layers)}, expected 0..{n - 1}: the model's "
                           "attention does not run through transformers' attention interface")
    return torch.stack([layers[i] for i in range(n)]).cpu()  # [L, Hq]


def mean_attention(model, samples) -> torch.Tensor:
    if not samples:
        raise ValueError("mean_attention needs at least one sample")
    return torch.stack([attention(model, s) for s in samples]).mean(0)  # [L, Hq]


def table(att: torch.Tensor, threshold: float = 0.4) -> str:
    lines = ["| layer | strongest head | its weight on the needle | mean over heads | reads the needle |",
             "|---|---|---|---|---|"]
    for i, row in enumerate(att):
        top = int(row.argmax())
        lines.append(f"| {i} | {top} | {float(row[top]):.3f} | {float(row.mean()):.3f} | "
                     f"{'yes' if float(row[top]) >= threshold else ''} |")
    return "\n".join(lines)
