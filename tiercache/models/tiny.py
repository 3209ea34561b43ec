"""The built-in models of the benchmark, their byte tokenizer and the held-out evaluation text.

Interface
- ``load_model`` (a built-in name or a path / hub id) lives in ``tiercache.models.load``.
- ``TINY_MODELS``: the built-in names; ``model_config(name)``: the transformers config of one,
  without loading or training weights (what ``plan`` / ``validate`` need).
- ``load_tiny(train_if_missing=True) -> model``: checks the weights' sha256 against
  ``tiny-llama.json`` (``ChecksumError`` on a mismatch); trains them first (progress bar, cached in
  ``~/.cache/tiercache``) when the shipped file is missing.
- ``ByteTokenizer``: ``encode(text) -> list[int]``, ``decode(ids) -> str``, ids 0..255 are bytes.
- ``eval_ids(tokenizer, n) -> torch.Tensor``: ``[n]`` ids of held-out stdlib text (files never
  trained on), the same for every run; ``HeldoutTooShort`` (a ``ValueError``, with ``.available``)
  when the text gives fewer than ``n`` tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from tiercache.models.corpus import BOS, EOS, PAD, VOCAB_SIZE, load_split
from tiercache.models.train import META, WEIGHTS, tiny_config, train

DATA_DIR = Path(__file__).resolve().parent / "data"
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tiercache" / "tiny"


TINY_MODELS = ("tiny", "tiny-random")


class ChecksumError(RuntimeError):
    """The weights file does not match the sha256 recorded next to it."""



class HeldoutTooShort(ValueError):
    """The held-out text gives fewer tokens than asked; ``available`` is how many it gives."""

    def __init__(self, available: int, asked: int):
        super().__init__(f"held-out text has only {available} tokens, {asked} asked")
        self.available, self.asked = available, asked


class ByteTokenizer:
    """Bytes are their own ids; ``bos``/``eos``/``pad`` are 256/257/258."""

    vocab_size = VOCAB_SIZE
    bos_token_id, eos_token_id, pad_token_id = BOS, EOS, PAD

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _found_weights_dir() -> Path | None:
    for d in (DATA_DIR, CACHE_DIR):
        if (d / WEIGHTS).is_file() and (d / META).is_file():
            return d
    return None


def _weights_dir(train_if_missing: bool, progress: bool) -> Path:
    found = _found_weights_dir()
    if found is not None:
        return found
    if not train_if_missing:
        raise FileNotFoundError(f"tiny model weights not found in {DATA_DIR} or {CACHE_DIR}; run bench/train_tiny.py")
    train(CACHE_DIR, progress=progress)
    return CACHE_DIR


def load_tiny(train_if_missing: bool = True, progress: bool = True, weights_dir: Path | None = None):
    """The trained tiny Llama (fp32, eval mode), its checksum verified."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    d = Path(weights_dir) if weights_dir is not None else _weights_dir(train_if_missing, progress)
    meta = json.loads((d / META).read_text())
    got = sha256(d / WEIGHTS)
    if got != meta["sha256"]:
        raise ChecksumError(f"{d / WEIGHTS}: sha256 {got} does not match {meta['sha256']} recorded in {d / META}")
    config = LlamaConfig.from_dict(meta["config"])
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    state = {k: v.float() for k, v in load_file(str(d / WEIGHTS)).items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def tiny_random(seed: int = 0):
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config()).eval()


def model_config(name: str):
    """The config of a built-in model (``TINY_MODELS``), read without loading or training weights."""
    from transformers import LlamaConfig

    if name not in TINY_MODELS:
        raise ModelLoadError(f"{name!r} is not a built-in model; built-in: {', '.join(TINY_MODELS)}")
    found = _found_weights_dir() if name == "tiny" else None
    return LlamaConfig.from_dict(json.loads((found / META).read_text())["config"]) if found else tiny_config()


def eval_ids(tokenizer, n: int) -> torch.Tensor:
    """``[n]`` ids of held-out text; raises if the held-out files are too short."""
    if isinstance(tokenizer, ByteTokenizer):
        ids = load_split("heldout", max_bytes=n)  # [<=n]
    else:
        raw = load_split("heldout", max_bytes=8 * n + 1024)
        text = bytes(int(i) if i < 256 else 10 for i in raw.tolist()).decode("utf-8", errors="replace")
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:n])
    if ids.numel() < n:
        raise HeldoutTooShort(ids.numel(), n)
    return ids
