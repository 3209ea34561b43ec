"""Peak activation bytes of one prefill chunk (and of a decode step) of a transformers decoder.

Interface
    prefill_peak(arch, batch, chunk, context, kernel, mask, sliding) -> dict[str, int]
        the parts of the peak of one forward of ``chunk`` tokens over ``context`` tokens (the last
        chunk of a prefill is the largest): ``hidden``, ``attention``, ``mlp``, ``mask``,
        ``logits`` and ``peak`` (what they add up to at the worst moment).
    decode_peak(arch, batch, context) -> int     the same for a one-token step
    kernel_for(device, attn_implementation) -> str     ``flash`` | ``math``
    CHUNKS                                       prefill chunk sizes ``auto`` tries, largest first

What a transformers 5 decoder layer holds (``no_grad``, the model's dtype ``d`` bytes), B batch,
C chunk tokens, S = context tokens attended, H hidden, I MLP width, h/kv query/KV heads of D:
- residual stream: the embeddings output stays referenced through the forward, plus the stream
  itself and one normed copy: ``3 B C H d``;
- attention: q, k, v of the chunk ``B C (h + 2 kv) D d``, rotary temporaries (about two more q),
  then *either* the GQA expansion of the whole K/V when a mask is passed (transformers'
  ``repeat_kv``: SDPA takes ``enable_gqa`` only without a mask, and a chunk after the first always
  has one): ``2 B h S D d`` *or* nothing (``kv == h``), plus the kernel's workspace: ``flash``
  (CPU flash kernel, CUDA flash / memory-efficient) keeps only per-row statistics ``B h C 4``,
  but SDPA first turns the boolean mask into an additive one in ``d`` (``B C S d``, for the call);
  ``math`` / ``eager`` materialise the scores ``B h C S`` in ``d`` and once more in fp32 for the
  softmax; plus the attention output and its transposed copy ``2 B C h D d``;
- MLP: gate activation, up projection and their product ``3 B C I d`` (``2`` when not gated),
  times the experts a token runs through;
- mask: a boolean ``B C S`` for SDPA (a ``d``-byte float mask for eager), one per attention kind
  (full and sliding);
- logits: generate keeps the last position only (``logits_to_keep=1``): ``B V d`` plus its fp32
  copy ``B V 4``.
The peak is the residual stream, the mask and the logits plus the larger of the attention and
MLP phases. ``tiercache.generate`` runs the chunks with ``logits_to_keep=1``.
"""

from __future__ import annotations

CHUNKS = (8192, 4096, 2048, 1024, 512, 256, 128)
DEFAULT_CHUNK = 2048


def kernel_for(device: str = "cuda", attn_implementation: str | None = "sdpa") -> str:
    """The attention kernel a chunk runs: ``math`` for eager attention, ``flash`` for SDPA (torch
    picks its CPU flash kernel for masked fp32/bf16 inputs on the CPU, flash or memory-efficient
    on CUDA; both keep O(C) statistics, not the scores)."""
    return "math" if attn_implementation == "eager" else "flash"


def prefill_peak(arch, batch: int, chunk: int, context: int, kernel: str = "flash", mask: str = "bool",
                 sliding: bool = False) -> dict[str, int]:
    b, c, s, d = batch, min(chunk, context), context, arch.dtype_bytes
    h, kv, hd = arch.heads, arch.kv_heads, arch.head_dim
    hidden = 3 * b * c * arch.hidden * d
    qkv = b * c * (h + 2 * kv) * hd * d
    rope = 2 * b * c * h * hd * d
    repeat = 2 * b * h * s * hd * d if (kv < h and c > 1) else 0
    if kernel == "math":
        work = b * h * c * s * (d + 4)
    else:  # SDPA turns a boolean mask into an additive one in the query's dtype for the call
        work = b * h * c * 4 + (b * c * s * d if c > 1 else 0)
    out = 2 * b * c * h * hd * d
    attention = qkv + max(rope, repeat + work + out)
    mlp = (3 if arch.gated else 2) * b * c * arch.intermediate * d * max(1, arch.active_experts)
    masks = (2 if sliding else 1) * b * c * s * (1 if mask == "bool" else d)
    logits = b * arch.vocab * (d + 4)
    peak = hidden + masks + logits + max(attention, mlp)
    return {"hidden": hidden, "attention": attention, "mlp": mlp, "mask": masks, "logits": logits, "peak": peak}


def decode_peak(arch, batch: int, context: int) -> int:
    """A one-token step: no GQA expansion (transformers packs the query heads instead), flash
    statistics, a ``B S`` mask, the logits of the token."""
    return prefill_peak(arch, batch, 1, context)["peak"]
