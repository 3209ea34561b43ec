"""The ``experimental:`` mapping of a quantize section: key_gain and clip, read there and written
there; the old top-level spelling read with a DeprecationWarning."""

import warnings

import pytest

from tiercache.errors import PolicyError
from tiercache.policy.schema import Policy, load_policy


def strict(data):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return Policy.from_dict(data)


def test_experimental_fields_are_read_and_written_under_their_mapping():
    p = strict({"quantize": {"bits": 2, "experimental": {"key_gain": 1.2, "clip": "mse"}}})
    assert p.quantize.key_gain == 1.2 and p.quantize.clip == "mse"
    d = p.to_dict()
    assert d["quantize"]["experimental"] == {"key_gain": 1.2, "clip": "mse"}
    assert "key_gain" not in d["quantize"] and "clip" not in d["quantize"]
    assert strict(d) == p
    assert "experimental" not in strict({"quantize": {"bits": 2}}).to_dict()["quantize"]  # defaults are not written


def test_the_top_level_spelling_still_reads_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=r"quantize\.key_gain.*experimental"):
        p = Policy.from_dict({"quantize": {"bits": 2, "key_gain": 1.2}})
    new = strict({"quantize": {"bits": 2, "experimental": {"key_gain": 1.2}}})
    assert p == new


def test_override_experimental_mappings_merge_key_by_key():
    p = strict({"quantize": {"bits": 2, "experimental": {"key_gain": 1.2}},
                "overrides": [{"layers": [1], "quantize": {"experimental": {"clip": "mse"}}},
                              {"layers": [2], "quantize": {"bits": 4}}]})
    a, b = p.overrides[0].quantize, p.overrides[1].quantize
    assert (a.key_gain, a.clip) == (1.2, "mse") and (b.key_gain, b.clip, b.bits) == (1.2, "minmax", 4)
    with pytest.warns(DeprecationWarning):  # the old spelling in an override replaces the base's experimental one
        q = Policy.from_dict({"quantize": {"bits": 2, "experimental": {"key_gain": 1.2}},
                              "overrides": [{"layers": [1], "quantize": {"key_gain": 1.0}}]})
    assert q.overrides[0].quantize.key_gain == 1.0 and q.quantize.key_gain == 1.2


@pytest.mark.parametrize("quantize, match", [
    ({"experimental": {"bits": 2}}, r"experimental\.bits: unknown field; allowed: clip, key_gain"),
    ({"experimental": 3}, r"experimental: expected a mapping"),
    ({"key_gain": 1.1, "experimental": {"key_gain": 1.2}}, "given both"),
    ({"experimental": {"key_gain": 9}}, r"key_gain: allowed values"),
    ({"clipping": "mse"}, r"unknown field; allowed: .*experimental \(clip, key_gain\)"),
])
def test_bad_experimental_sections(quantize, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(PolicyError, match=match):
            load_policy({"quantize": {"bits": 2, **quantize}})
