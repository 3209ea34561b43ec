"""The documentation: the site builds with ``mkdocs build --strict`` (a broken link, a page missing from the
nav or an API page naming a module that is gone fails it), and the README stays short."""

from __future__ import annotations

import functools
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


def _layout_sections(text: str) -> dict[str, str]:
    """The tree of ``docs/layout.md`` as {folder path: the text of its lines} (``tiercache/cache/`` ...)."""
    block = text.split("```")[1]
    out: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in block.splitlines():
        head = re.match(r"( *)(\S+/)(\s|$)", line)
        if head:
            indent = len(head.group(1))
            stack = [(i, name) for i, name in stack if i < indent] + [(indent, head.group(2))]
        key = "".join(name for _, name in stack)
        out[key] = out.get(key, "") + " " + line
    return out


def test_layout_names_every_module_in_its_folder():
    sections = _layout_sections((ROOT / "docs" / "layout.md").read_text())
    missing = []
    for path in sorted((ROOT / "tiercache").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        folder = path.parent.relative_to(ROOT).as_posix() + "/"
        if not re.search(rf"(?<![\w/]){re.escape(path.name)}\b", sections.get(folder, "")):
            missing.append(path.relative_to(ROOT).as_posix())
    assert missing == [], f"docs/layout.md does not name these modules under their folder: {missing}"


def test_the_layout_reader_finds_nested_folders():
    sections = _layout_sections("```\ntiercache/  a.py\n  cache/  b.py\n          c.py\n    deep/  d.py\nbench/  e.py\n```")
    assert "c.py" in sections["tiercache/cache/"] and "d.py" in sections["tiercache/cache/deep/"]
    assert "d.py" not in sections["tiercache/cache/"] and "e.py" in sections["bench/"]


def _docs_texts() -> dict[str, str]:
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in pages}


@functools.lru_cache(maxsize=None)
def _cli_flags() -> dict[str, set[str]]:
    """Every ``tiercache`` subcommand's flags, from the parsers themselves (``bench`` has its own)."""
    import argparse

    from tiercache.bench.command import parser as bench_parser
    from tiercache.cli import parser

    subs = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {name: {o for a in sub._actions for o in a.option_strings} for name, sub in subs.choices.items()}
    flags["bench"] |= {o for a in bench_parser()._actions for o in a.option_strings}
    return flags


def test_every_cli_flag_the_docs_give_a_command_exists():
    """``tiercache SUB ... --flag`` in a page (code block or inline, continuation lines included): SUB takes --flag."""
    flags = _cli_flags()
    command = re.compile(r"tiercache (" + "|".join(map(re.escape, flags)) + r")\b([^`|;#\n]*(?:\\\n[^`|;#\n]*)*)")
    bad = [(page, m.group(1), flag) for page, text in _docs_texts().items() for m in command.finditer(text)
           for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(2)) if flag not in flags[m.group(1)]]
    assert bad == [], f"the docs give commands flags they do not take (page, command, flag): {bad}"


def _policy_table() -> dict[str, set[str]]:
    """docs/policies.md's table of fields as {section: field names} (an empty section cell: the one above)."""
    text = (ROOT / "docs" / "policies.md").read_text()
    rows = re.search(r"^\| section \| field \|.*?\n((?:\|.*\n)+)", text, re.M).group(1).splitlines()[1:]
    out: dict[str, set[str]] = {}
    section = None
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0]:
            section = "top level" if cells[0] == "top level" else cells[0].strip("`").removesuffix("[]")
        out.setdefault(section, set()).update(re.findall(r"`([a-z_.]+)`", cells[1]))
    return out


def test_the_policy_docs_name_every_field_and_only_fields():
    import dataclasses

    from tiercache.policy import fields as policy_fields
    from tiercache.policy import schema

    classes = {"top level": schema.Policy, "quantize": schema.QuantizePolicy, "offload": schema.OffloadPolicy,
               "overrides": schema.Override, "budget": schema.Budget, "cross_attention": schema.CrossAttentionPolicy}
    documented = _policy_table()
    assert documented.keys() == classes.keys(), documented.keys()
    for section, cls in classes.items():
        experimental = set(policy_fields.experimental_fields(cls))
        fields = {f.name for f in dataclasses.fields(cls)} - experimental | {f"experimental.{n}" for n in experimental}
        if section == "top level":  # the sections are documented as sections of their own
            fields -= classes.keys()
        assert documented[section] == fields, (f"docs/policies.md, {section}: not documented "
                                               f"{sorted(fields - documented[section])}, not fields "
                                               f"{sorted(documented[section] - fields)}")


# flags of other programs the docs show (redis-server, compute-sanitizer), not tiercache's nor a benchmark's
EXTERNAL_FLAGS = {"--appendonly", "--requirepass", "--save", "--tool"}


def test_every_flag_the_docs_name_exists_somewhere():
    """A flag in a code span or block is a ``tiercache`` flag, a flag of a script under ``bench/`` or
    the Makefile, or one of the few external programs' flags above: no flag the code has dropped."""
    known = set().union(*_cli_flags().values()) | EXTERNAL_FLAGS
    scripts = "\n".join(p.read_text() for p in [*ROOT.glob("bench/**/*.py"), *ROOT.glob("bench/*.sh"), ROOT / "Makefile"])
    bad = set()
    for page, text in _docs_texts().items():
        for code in re.findall(r"`([^`\n]+)`", text) + re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code):
                if flag not in known and not re.search(rf"[\"' ]{re.escape(flag)}\b", scripts):
                    bad.add((page, flag))
    assert not bad, f"the docs name flags that nothing takes (page, flag): {sorted(bad)}"
