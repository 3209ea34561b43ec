"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a page missing from the
nav or an API page naming a module that is gone fails it), and the README stays short."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines, at most {README_MAX_LINES} allowed"


def test_readme_links_to_docs_pages_that_exist():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert links, "README.md links to no docs page"
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_mkdocs_build_strict(tmp_path):
    missing = [m for m in ("mkdocs", "material", "mkdocstrings_handlers.python") if importlib.util.find_spec(m) is None]
    assert not missing, f"the docs extra is not installed (missing {missing}): pip install -e '.[docs]' (make does)"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "api" / "cache" / "index.html").exists()


class _Tokenizer:
    """The built-in byte tokenizer behind the ``tok(text, return_tensors="pt")`` call the README makes."""

    def __init__(self, byte_tokenizer):
        self.byte = byte_tokenizer

    def __call__(self, text, return_tensors="pt"):
        import torch

        ids = torch.tensor([self.byte.encode(text)])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode(self, ids):
        return self.byte.decode(ids)


def test_the_readme_python_example_runs(tmp_path, monkeypatch):
    """The README's example, with the hub model it names swapped for the built-in tiny one (no network)."""
    import transformers

    from tiercache.models import registry

    text = (ROOT / "README.md").read_text()
    code = re.search(r"## Use\n.*?```python\n(.*?)```", text, re.S).group(1)
    model, byte_tokenizer = registry.load("tiny")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: _Tokenizer(byte_tokenizer))
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "README.md (Use)", "exec"), scope)
    prompt = scope["inputs"]["input_ids"].shape[1]
    assert scope["out"].shape[1] > prompt
    assert scope["cache"].get_seq_length() >= prompt and sum(scope["cache"].nbytes().values()) > 0
