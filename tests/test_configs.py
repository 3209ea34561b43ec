"""Deployment configs: each validates, says who it is for, and fits its budget on its target."""

from pathlib import Path

import pytest
import yaml

import tiercache
from tiercache.planner.api import plan

CONFIGS = Path(__file__).parent.parent / "configs"

# config -> (preset model, context, batch) it is written for; each must fit its own budget there
TARGETS = {
    "laptop-cpu": ("Llama-3-8B", 32768, 1),
    "gpu-8gb": ("Llama-3-8B", 65536, 1),
    "gpu-24gb-128k": ("Llama-3-8B", 131072, 1),
    "gpu-80gb-1m": ("Llama-3-8B", 1048576, 1),
    "quality-first": ("Llama-3-8B", 131072, 1),
}
ALL = sorted(p.stem for p in CONFIGS.glob("*.yaml"))  # policies; serve store budgets live in configs/serve/


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_deployment_config_exists(name):
    assert name in ALL


@pytest.mark.parametrize("name", ALL)
def test_config_validates_and_describes_itself(name):
    policy = tiercache.load_policy(CONFIGS / f"{name}.yaml")
    assert policy.name == name
    assert policy.description and "\n" not in policy.description.strip()
    raw = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    assert tiercache.Policy.from_dict(policy.to_dict()) == policy and raw["name"] == name


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_config_fits_its_target(name):
    model, context, batch = TARGETS[name]
    p = plan(CONFIGS / f"{name}.yaml", model, batch, context)
    assert p.budget is not None and p.fits, p.table()
    assert "verdict: fits" in p.table()


def test_the_24gb_config_would_not_fit_in_full_precision():
    p = plan({"name": "fp", "budget": {"device": "6GiB"}}, "Llama-3-8B", 1, 131072)
    assert not p.fits


def test_quality_first_stays_lossless_when_it_can():
    short = plan(CONFIGS / "quality-first.yaml", "Llama-3-8B", 1, 32768)
    assert short.policy.name == "quality-first/fp-resident" and short.policy.quantize is None
    long = plan(CONFIGS / "quality-first.yaml", "Llama-3-8B", 1, 131072)
    assert long.policy.quantize is None and long.policy.offload is not None


MODEL_CONFIGS = sorted(p for p in CONFIGS.glob("*/*.yaml") if p.parent.name != "serve")  # configs/<model>/


@pytest.mark.parametrize("path", MODEL_CONFIGS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_model_configs_load_and_plan_for_their_model(path):
    """A measured config (``configs/<model>/``, written by ``bench_real.py --sensitivity`` /
    ``--upgrade-search``) loads, and plans for the model it was measured on, every layer quantized."""
    from tiercache.planner.api import resolve_model

    policy = tiercache.load_policy(path)
    assert policy.name == path.stem and policy.description
    spec = resolve_model(path.parent.name)
    layers = policy.resolve(spec)
    assert all(lp.quantize is not None for lp in layers)
    p = plan(policy, spec, 1, 4096)
    assert p.bytes["device"] > 0
