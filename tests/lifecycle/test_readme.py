"""The lifecycle page's example runs as written (fork, retier, save / load): docs/lifecycle.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


# The README's example still passes `past_key_values=` (README.md is being rewritten to `cache=`, issue 31):
# until then its deprecation warning is shown here, not an error. Remove this mark with that rewrite.
@pytest.mark.filterwarnings("default:`past_key_values` is deprecated:FutureWarning")
def test_the_readme_lifecycle_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "docs" / "lifecycle.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    torch.manual_seed(2)  # weights whose greedy continuation hits EOS at once: the example must not depend on it
    exec(compile(code, "docs/lifecycle.md", "exec"), scope)
    assert scope["resumed"].policy.name == "default" and scope["resumed"].get_seq_length() == 312
    assert set(scope["cache"].tier_nbytes()) == {"host", "device"}
