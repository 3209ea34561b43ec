"""tiercache.planner.mixed: the sensitivity file, the knapsack over layers, auto with calibration."""

import itertools
import json

import pytest

import tiercache
from tiercache.errors import PolicyError
from tiercache.models import registry
from tiercache.models.spec import ModelSpec
from tiercache.planner import mixed
from tiercache.policy.schema import Policy

BASE = {"backend": "native", "group_size": 64, "residual_length": 128, "key_axis": "channel",
        "value_axis": "token", "format": "int", "sink_tokens": 0}


def sens(keys=None, values=None, variants=()):
    keys = keys or {0: {8: 0.001, 4: 0.02, 2: 0.5}, 1: {8: 0.0001, 4: 0.001, 2: 0.01},
                    2: {8: 0.0001, 4: 0.002, 2: 0.04}, 3: {8: 0.001, 4: 0.03, 2: 0.9}}
    values = values or {l: {8: 0.0, 4: 0.0005, 2: 0.003} for l in range(4)}
    return mixed.Sensitivity((0, 1, 2, 3), (8, 4, 2), keys, values, dict(BASE), {"model": "tiny"}, list(variants))


@pytest.fixture(scope="module")
def spec():
    return ModelSpec.from_config(registry.config("tiny"))


def test_json_round_trip(tmp_path):
    s = sens(variants=[{"sink_tokens": 4, "residual_length": 128, "scale": {8: 0.5, 4: 0.5, 2: 0.6}}])
    s.save(tmp_path / "s.json")
    back = mixed.Sensitivity.load(tmp_path / "s.json")
    assert back.keys == s.keys and back.values == s.values and back.base == s.base and back.variants == s.variants
    assert len(back.each()) == 2 and back.each()[1].base["sink_tokens"] == 4
    assert back.each()[1].keys[0][2] == pytest.approx(0.5 * 0.6)


@pytest.mark.parametrize("content, match", [("not json", "not JSON"), ("[1]", "JSON object"),
                                            ('{"version": 99}', "version 99"), ('{"version": 1}', "not a sensitivity")])
def test_bad_files(tmp_path, content, match):
    (tmp_path / "s.json").write_text(content)
    with pytest.raises(PolicyError, match=match):
        mixed.Sensitivity.load(tmp_path / "s.json")
    with pytest.raises(PolicyError, match="does not exist"):
        mixed.Sensitivity.load(tmp_path / "missing.json")


def test_knapsack_is_the_brute_force_optimum(spec):
    s = sens()
    base = Policy.from_dict({"name": "b"})
    costs = mixed.layer_costs(s, spec, 1, 2048, base)
    front = mixed.frontier(s, costs, resolution=100000)
    opts = mixed.options(s)
    slack = 4 * front.unit  # costs are rounded up to bins: the table is exact within one bin per layer

    def brute(limit):
        return min(sum(s.part(l, o) for l, o in zip(s.layers, combo)) for combo in itertools.product(opts, repeat=4)
                   if sum(costs[o][i] for i, o in enumerate(combo)) <= limit)

    for budget in (sum(costs[mixed.Option(2, 2)]) + slack, sum(costs[mixed.Option(4, 4)]), sum(costs[mixed.Option(8, 4)])):
        got = front.best_within(budget)
        assert brute(budget) - 1e-12 <= mixed.predicted(s, got) <= brute(budget - slack) + 1e-12
        assert sum(costs[got[l]][i] for i, l in enumerate(s.layers)) <= budget
    assert front.best_within(sum(costs[mixed.Option(2, 2)]) - 1000) is None
    cheap = front.cheapest_under(0.05)
    assert mixed.predicted(s, cheap) <= 0.05


def test_policy_of_reads_back_per_layer_bits(spec):
    s = sens()
    choice = {0: mixed.Option(8, 4), 1: mixed.Option(2, 2), 2: mixed.Option(2, 2), 3: mixed.FP}
    p = mixed.policy_of(Policy.from_dict({"name": "b"}), s, choice, "x")
    layers = Policy.from_dict(p.to_dict()).resolve(spec)
    assert (layers[0].quantize.bits_of("keys"), layers[0].quantize.bits_of("values")) == (8, 4)
    assert (layers[1].quantize.bits_of("keys"), layers[1].quantize.bits_of("values")) == (2, 2)
    assert layers[3].quantize is None


def test_calibration_needs_auto():
    with pytest.raises(PolicyError, match="auto: true only"):
        Policy.from_dict({"calibration": "s.json"})


def test_auto_with_calibration_picks_per_layer_formats(tmp_path, spec, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = sens()
    s.save("s.json")
    uniform4 = tiercache.plan({"quantize": {"bits": 4}}, spec, 1, 2048)
    budget = uniform4.bytes["device"]
    p = tiercache.plan({"auto": True, "calibration": "s.json", "quantize": {"bits": 4},
                        "budget": {"device": budget}}, spec, 1, 2048)
    assert p.fits and p.bytes["device"] <= budget
    assert p.policy.name.endswith("/calibrated")
    names = [r.name for r in p.rungs]
    assert names.index("calibrated-resident") == 2
    bits = {lp.index: (lp.quantize.bits_of("keys"), lp.quantize.bits_of("values")) for lp in p.policy.resolve(spec)}
    assert len(set(bits.values())) > 1  # not a uniform format
    chosen = {l: mixed.Option(*bits[l]) for l in bits}
    assert mixed.predicted(s, chosen) < mixed.predicted(s, {l: mixed.Option(4, 4) for l in range(4)})
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**s.to_json(), "layers": [0, 1, 2, 3, 9]}))
    with pytest.raises(PolicyError):
        tiercache.plan({"auto": True, "calibration": str(bad), "budget": {"device": budget}}, spec, 1, 2048)


def test_a_budget_of_exactly_the_smallest_choice_fits_it(spec):
    s = sens()
    base = Policy.from_dict({"name": "b"})
    smallest = mixed.policy_of(base, s, {l: mixed.Option(2, 2) for l in s.layers})
    limit = sum(tiercache.plan(smallest, spec, 1, 2048).bytes.values())
    choice, pred, _ = mixed.fit(s, base, spec, 1, 2048, limit)
    assert set(choice.values()) == {mixed.Option(2, 2)}
    assert mixed.fit(s, base, spec, 1, 2048, limit - 1) is None


def test_variants_of_metadata_and_group_size_round_trip_and_cost_fewer_bytes(tmp_path, spec):
    v = {"sink_tokens": 0, "residual_length": 128, "meta_bits": 8, "group_size": 128, "scale": {8: 1.5, 4: 1.5, 2: 1.2}}
    s = sens(variants=[v])
    s.save(tmp_path / "s.json")
    back = mixed.Sensitivity.load(tmp_path / "s.json")
    assert back.variants == s.variants
    plain, packed = back.each()
    assert packed.base["meta_bits"] == 8 and packed.base["group_size"] == 128
    assert packed.values[2][2] == pytest.approx(1.2 * 0.003)
    base = Policy.from_dict({"name": "b"})
    small = {l: mixed.Option(2, 2) for l in s.layers}
    # one-byte metadata in groups of 128: the same bits in fewer bytes, which the knapsack can spend
    assert sum(mixed.layer_costs(packed, spec, 1, 2048, base)[mixed.Option(2, 2)]) < \
        sum(mixed.layer_costs(plain, spec, 1, 2048, base)[mixed.Option(2, 2)])
    p = mixed.policy_of(base, packed, small)
    assert p.quantize.meta_bits == 8 and p.quantize.group_size == 128


def test_a_variant_of_an_unknown_field_is_refused(tmp_path):
    s = sens(variants=[{"sink_tokens": 0, "residual_length": 128, "scale": {8: 1, 4: 1, 2: 1}}])
    data = s.to_json()
    data["variants"][0]["bits"] = 3
    (tmp_path / "s.json").write_text(json.dumps(data))
    with pytest.raises(PolicyError, match="allowed"):
        mixed.Sensitivity.load(tmp_path / "s.json")


def test_policy_wide_choices_keep_the_residual_at_least_a_group():
    from tiercache.tune import calibrate

    combos = calibrate.policy_wide(dict(calibrate.DEFAULT_BASE))
    assert all(c["residual_length"] >= c["group_size"] for c in combos)
    assert {c["meta_bits"] for c in combos} == {None, 8} and {c["group_size"] for c in combos} == {64, 128}
    assert len(calibrate.policy_wide(dict(calibrate.DEFAULT_BASE), sinks=4, residual=128)) == 4


def test_an_older_base_with_clip_at_the_top_level_writes_it_under_experimental(spec):
    import warnings

    s = sens()
    s.base = {**BASE, "clip": "minmax"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        p = mixed.policy_of(Policy.from_dict({"name": "b"}), s, {l: mixed.Option(4, 2) for l in s.layers})
    assert p.quantize.clip == "minmax" and p.quantize.value_bits == 2
