"""The auto ladder: least lossy rung that fits, every rung reported, smallest footprint otherwise."""

import pytest

from tiercache.errors import PolicyError
from tiercache.planner.ladder import RUNGS, candidates
from tiercache.models.spec import PRESETS
from tiercache.planner.api import choose, plan
from tiercache.policy.schema import Policy

LLAMA8B = PRESETS["llama-3-8b"]


def _auto(device: str, host: str | None = None, **extra) -> dict:
    budget = {"device": device, **({"host": host} if host else {})}
    return {"name": "a", "auto": True, "budget": budget, **extra}


# budget -> rung chosen for Llama-3-8B at 128k (fp16 history: 16 GiB)
CASES = [
    (("20GiB", None), "fp-resident"),
    (("6GiB", "32GiB"), "fp-host"),
    (("10GiB", "4GiB"), "int8-resident"),
    (("6GiB", "4GiB"), "int4-kivi-resident"),
    (("1GiB", "4.6GiB"), "int4-kivi-host"),
    (("3.2GiB", "1GiB"), "int2-kivi-resident"),
    (("1GiB", "3GiB"), "int2-kivi-host"),
]


@pytest.mark.parametrize("budget,rung", CASES, ids=[r for _, r in CASES])
def test_picks_the_least_lossy_rung_that_fits(budget, rung):
    p = plan(_auto(*budget), LLAMA8B, 1, 131072)
    assert p.fits and p.policy.name == f"a/{rung}" and not p.policy.auto
    names = [r.name for r in p.rungs]
    assert names == [name for name, _, _ in RUNGS]
    chosen = names.index(rung)
    assert all(not r.plan.fits for r in p.rungs[:chosen]) and "CHOSEN" in p.rungs[chosen].verdict
    text = p.table()
    assert all(name in text for name in names)
    assert chosen == 0 or "rejected" in text


def test_disk_rungs_when_host_is_tiny():
    p = plan(_auto("1GiB", "1GiB"), LLAMA8B, 1, 131072)
    assert p.policy.name == "a/int4-kivi-disk" and p.bytes["disk"] > 4 * 2**30


def test_nothing_fits_reports_the_smallest_footprint():
    p = plan(_auto("100MiB", "1GiB"), LLAMA8B, 1, 131072)
    assert not p.fits
    assert "smallest reachable" in p.table() and "verdict: does not fit" in p.table()
    assert p.policy.name.endswith("int2-kivi-host") or p.policy.name.endswith("int2-kivi-disk")
    with pytest.raises(PolicyError, match="smallest reachable"):
        choose(_auto("100MiB", "1GiB"), LLAMA8B, 1, 131072)


def test_choose_returns_a_concrete_policy_that_keeps_templates():
    auto = _auto("6GiB", "4GiB", quantize={"group_size": 32, "residual_length": 64},
                 overrides=[{"layers": [0], "quantize": None}])
    chosen = choose(Policy.from_dict(auto), LLAMA8B, 1, 131072)
    assert isinstance(chosen, Policy) and not chosen.auto
    assert chosen.quantize.bits == 4 and chosen.quantize.group_size == 32 and chosen.quantize.residual_length == 64
    assert chosen.resolve(LLAMA8B)[0].quantize is None and chosen.budget == Policy.from_dict(auto).budget


def test_a_rung_the_backend_cannot_do_is_rejected_with_a_reason(monkeypatch):
    import tiercache.policy.schema as schema

    def only_4_bits(q, where):
        if q.bits != 4:
            raise PolicyError(f"{where}.bits: backend {q.backend} supports 4, got {q.bits}")

    monkeypatch.setattr(schema, "validate", only_4_bits)  # the check a policy's quantize section goes through
    rows = dict(candidates(Policy.from_dict(_auto("1GiB"))))
    assert isinstance(rows["int8-resident"], PolicyError) and isinstance(rows["int4-kivi-host"], Policy)
    p = plan(_auto("6GiB", "4GiB"), LLAMA8B, 1, 131072)
    assert "supports 4" in p.table() and p.policy.name == "a/int4-kivi-resident"


def test_from_policy_auto_without_a_context_says_what_it_plans_for():
    """An auto policy built without ``context_length`` (and no ``max_length``) warns that its rung was
    chosen for 4096 tokens; with a context it chooses for that context, silently."""
    import warnings

    from tiercache import TieredCache

    auto = _auto("1GiB")
    with pytest.warns(UserWarning, match=r"auto: true and no context_length was given: its rung is chosen for "
                                         r"4096 tokens; pass context_length="):
        short = TieredCache.from_policy(auto, LLAMA8B)
    assert short.policy.name == choose(auto, LLAMA8B, 1, 4096).name == "a/fp-resident"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        long = TieredCache.from_policy(auto, LLAMA8B, context_length=131072)
    # 1 GiB holds 4096 tokens in full precision on the device, not 128k: the context changes the rung
    assert long.policy.name == choose(auto, LLAMA8B, 1, 131072).name != "a/fp-resident"


def test_choose_takes_plans_keywords_and_the_old_ones_with_a_warning():
    auto = Policy.from_dict(_auto("6GiB", "4GiB"))
    new = choose(auto, LLAMA8B, batch_size=2, context_length=65536)
    assert new.name == plan(auto, LLAMA8B, batch_size=2, context_length=65536).policy.name
    with pytest.warns(DeprecationWarning, match="batch_size= and context_length="):
        old = choose(auto, LLAMA8B, batch=2, context=65536)
    assert old == new
    with pytest.warns(DeprecationWarning):  # the old keyword wins over the default, never silently dropped
        assert choose(auto, LLAMA8B, context=4096) == choose(auto, LLAMA8B, context_length=4096) != new
