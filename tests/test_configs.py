"""Deployment configs: each validates, says who it is for, and fits its budget on its target."""

import re
from pathlib import Path

import pytest
import yaml

import tiercache
from tiercache.planner.api import plan

CONFIGS = Path(__file__).parent.parent / "configs"

# config -> (preset model, context, batch) it is written for; each must fit its own budget there
# (the gpu-* card policies are read from their own name and description: test_card_policy_fits_its_card)
TARGETS = {
    "laptop-cpu": ("Llama-3-8B", 32768, 1),
    "quality-first": ("Llama-3-8B", 131072, 1),
}
ALL = sorted(p.stem for p in CONFIGS.glob("*.yaml"))  # policies; serve store budgets live in configs/serve/
CARDS = sorted(p for p in CONFIGS.glob("gpu-*.yaml"))


def card_target(policy) -> dict:
    """What a ``gpu-*`` policy promises, read from its name and description: the card
    (``gpu-24gb`` -> 24e9 bytes, as cards are sold), the model (the one preset the description
    names), the context (``-128k`` / ``-1m`` in the name, else ``up to 32k`` / ``1M tokens`` in the
    description) and the weights (``int4 weights`` in the description, else the model's dtype)."""
    from tiercache.models.spec import PRESETS

    m = re.fullmatch(r"gpu-(\d+)gb(?:-(\d+)([km]))?", policy.name)
    assert m, f"{policy.name}: a card policy's name is gpu-<N>gb[-<context>k|m]"
    text = policy.description
    models = [spec.name for spec in PRESETS.values() if re.search(rf"\b{re.escape(spec.name)}\b", text)]
    assert len(models) == 1, f"{policy.name}: the description must name one preset model, names {models}"
    if m.group(2):
        context = int(m.group(2)) * (1024 if m.group(3) == "k" else 2**20)
    else:
        c = re.search(r"(\d+)([kKmM]) \((\d+)\) tokens", text)
        assert c, f"{policy.name}: the description must give its context as '<N>k (<tokens>) tokens'"
        context = int(c.group(3))
        assert context == int(c.group(1)) * (1024 if c.group(2) in "kK" else 2**20), text
    weights = "int4" if "int4 weights" in text else None
    return {"card": int(m.group(1)) * 10**9, "model": models[0], "context": context, "weights": weights}


@pytest.mark.parametrize("path", CARDS, ids=lambda p: p.stem)
def test_card_policy_fits_its_card(path):
    """Every shipped gpu-* policy fits the card its name promises, for the model and context its
    description names, by the whole footprint (weights, cache, growth, activations of the prefill
    chunk the plan picks, runtime, margin), states that card, and the plan's verdict agrees."""
    from tiercache.planner.api import fits_card

    policy = tiercache.load_policy(path)
    target = card_target(policy)
    assert policy.budget is not None and policy.budget.gpu_memory == target["card"], (
        f"{path.name}: budget.gpu_memory should state the card its name promises ({target['card']} bytes)")
    p = plan(policy, target["model"], 1, target["context"], weights=target["weights"])
    card = p.card_verdict()
    assert card is not None and card.card == target["card"]
    assert card.used == p.whole.total["device"] <= target["card"], p.table()
    assert p.fits and "verdict: fits" in p.table() and "card: whole footprint" in p.table()
    assert fits_card(policy, target["model"], 1, target["context"], target["card"],
                     weights=target["weights"]) == (True, card.used)
    # the header says what it fits, with the plan's figures
    header = path.read_text().split("\nname:")[0]
    assert f"{card.used / 2**30:.1f} GiB" in header or f"{card.used / 2**30:.2f} GiB" in header, header


def test_card_target_reads_what_the_files_promise():
    """The reader of the promises is itself right on the shipped files (a wrong parse would make
    the card test check the wrong thing)."""
    got = {p.stem: card_target(tiercache.load_policy(p)) for p in CARDS}
    assert got["gpu-24gb-128k"] == {"card": 24 * 10**9, "model": "Llama-3-8B", "context": 131072, "weights": None}
    assert got["gpu-80gb-1m"] == {"card": 80 * 10**9, "model": "Llama-3-8B", "context": 2**20, "weights": None}
    assert got["gpu-8gb"] == {"card": 8 * 10**9, "model": "Llama-3-8B", "context": 32768, "weights": "int4"}


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
    """A measured config (``configs/<model>/``, written by ``tiercache tune``) loads, says how it was
    made in its header, and plans for the model it was measured on, its layers quantized (tune may
    keep a layer exact where that is where the bytes matter least)."""
    from tiercache.planner.api import resolve_model

    policy = tiercache.load_policy(path)
    assert policy.name == path.stem and policy.description
    spec = resolve_model(path.parent.name)
    layers = policy.resolve(spec)
    assert sum(lp.quantize is not None for lp in layers) > len(layers) // 2
    assert "written by tiercache tune" in path.read_text().splitlines()[0]
    p = plan(policy, spec, 1, 4096)
    assert p.bytes["device"] > 0
