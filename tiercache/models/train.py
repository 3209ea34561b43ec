"""Deterministic training of the tiny byte-level Llama used for the benchmark's quality numbers.

Interface
- ``tiny_config() -> LlamaConfig``: the architecture (byte vocab, hidden 192, 4 layers, 4 heads of
  64 dims, 2 KV heads (GQA), rope, 4096 positions).
- ``train(out_dir, steps=..., progress=True) -> dict``: trains on the stdlib's training files and
  writes ``out_dir/tiny-llama.safetensors`` (fp16 weights) and ``out_dir/tiny-llama.json``
  (config, sha256 of the weights, held-out metrics, recipe). Returns that metadata.
- ``heldout_metrics(model) -> dict``: ``{"nll", "perplexity", "bits_per_byte", "tokens"}`` on a
  fixed set of held-out windows.

Determinism: fixed seeds, ``torch.use_deterministic_algorithms(True)``, a fixed thread count and
a step-count (not time) budget; batches are drawn from a seeded generator. Results are
bit-reproducible on one machine and thread count; other CPUs may differ in the last bits.
Recipe: AdamW, warm-up then cosine decay, a length curriculum (1024-token windows, then
2048-token windows for the last steps so positions up to 2048 are trained).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch

from tiercache.models.corpus import BOS, EOS, PAD, VOCAB_SIZE, load_split

WEIGHTS, META = "tiny-llama.safetensors", "tiny-llama.json"
SEED = 1234
THREADS = 1  # one thread: bit-reproducible whatever the core count, and robust on a shared machine
RECIPE = {
    "steps": 360, "long_steps": 60,          # the last ``long_steps`` use long windows
    "seq_len": 1024, "batch": 4,             # 4096 tokens per step
    "long_seq_len": 2048, "long_batch": 2,   # same tokens per step
    "lr": 3e-3, "min_lr_ratio": 0.1, "warmup": 30, "weight_decay": 0.1, "clip": 1.0,
    "eval_windows": 16, "eval_seq_len": 1024,
}


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=192, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
        rope_theta=10000.0, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )


def _windows(data: torch.Tensor, n: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, data.numel() - seq_len - 1, (n,), generator=gen)  # [n]
    return torch.stack([data[s : s + seq_len] for s in starts.tolist()])  # [n, seq_len]


@torch.no_grad()
def heldout_metrics(model, data: torch.Tensor | None = None) -> dict:
    r = RECIPE
    data = load_split("heldout") if data is None else data
    gen = torch.Generator().manual_seed(SEED + 1)
    x = _windows(data, r["eval_windows"], r["eval_seq_len"], gen)  # [W, T]
    model.eval()
    nll, count = 0.0, 0
    for row in x.split(4):
        logits = model(input_ids=row).logits.float()  # [b, T, V]
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), row[:, 1:].flatten(), reduction="sum")
        nll += loss.item()
        count += row[:, 1:].numel()
    mean = nll / count
    return {"nll": mean, "perplexity": math.exp(mean), "bits_per_byte": mean / math.log(2), "tokens": count}


def _lr(step: int, steps: int) -> float:
    """Linear warm-up then cosine decay to ``min_lr_ratio``; scaled to ``steps`` for short runs."""
    r = RECIPE
    warm = max(1, r["warmup"] * steps // r["steps"])
    if step < warm:
        return r["lr"] * (step + 1) / warm
    frac = (step - warm) / max(1, steps - warm)
    return r["lr"] * (r["min_lr_ratio"] + (1 - r["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * frac)))


def train(out_dir: str | Path, steps: int | None = None, progress: bool = True) -> dict:
    """Train, save weights + metadata into ``out_dir``; returns the metadata dict."""
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    r = dict(RECIPE, steps=steps or RECIPE["steps"])
    r["long_steps"] = min(r["long_steps"], r["steps"] // 4)
    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    data = load_split("train")  # [N]
    model = LlamaForCausalLM(tiny_config())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": r["weight_decay"]},
                             {"params": other, "weight_decay": 0.0}], lr=r["lr"], betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(SEED)
    model.train()
    bar = tqdm(range(r["steps"]), desc="train tiny-llama", disable=not progress)
    for step in bar:
        long = step >= r["steps"] - r["long_steps"]
        x = _windows(data, r["long_batch"] if long else r["batch"], r["long_seq_len"] if long else r["seq_len"], gen)  # [B, T]
        for g in opt.param_groups:
            g["lr"] = _lr(step, r["steps"])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), r["clip"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}", bpb=f"{loss.item() / math.log(2):.2f}")
    train_s = time.time() - t0
    model = model.half()
    metrics = heldout_metrics(model.float())  # the fp16 weights, evaluated in fp32 as in the bench
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.half().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS))
    meta = {
        "config": tiny_config().to_dict(),
        "sha256": hashlib.sha256((out / WEIGHTS).read_bytes()).hexdigest(),
        "dtype": "float16",
        "heldout": metrics,
        "recipe": r,
        "seed": SEED,
        "threads": THREADS,
        "train_seconds": round(train_s, 1),
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
    }
    (out / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta
