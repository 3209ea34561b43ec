"""Backend validation: unsupported bits / format and missing packages give a PolicyError naming the backend."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tiercache.errors import PolicyError
from tiercache.policy.schema import Policy, QuantizePolicy
from tiercache.quantize import backends

OK = [("native", 2, "int"), ("native", 4, "int"), ("native", 8, "int"), ("native", 8, "fp8"),
      ("quanto", 2, "int"), ("quanto", 4, "int"),
      ("hqq", 1, "int"), ("hqq", 2, "int"), ("hqq", 3, "int"), ("hqq", 4, "int"), ("hqq", 8, "int")]
BAD = [("native", 3, "int", "supports bits 2, 4, 8"), ("native", 1, "int", "supports bits"),
       ("native", 4, "fp8", "set bits: 8"), ("quanto", 8, "int", "supports bits 2, 4"),
       ("quanto", 4, "fp8", "only format 'int'"), ("hqq", 5, "int", "supports bits 1, 2, 3, 4, 8"),
       ("hqq", 8, "fp8", "only format 'int'")]


@pytest.mark.parametrize("backend,bits,fmt", OK, ids=lambda x: str(x))
def test_supported(backend, bits, fmt):
    backends.validate(QuantizePolicy(backend=backend, bits=bits, format=fmt), "policy.quantize")


@pytest.mark.parametrize("backend,bits,fmt,says", BAD, ids=lambda x: str(x))
def test_unsupported_names_backend_and_what_it_supports(backend, bits, fmt, says):
    with pytest.raises(PolicyError, match=says) as e:
        Policy.from_dict({"quantize": {"backend": backend, "bits": bits, "format": fmt}})
    assert f"'{backend}'" in str(e.value) and "policy.quantize" in str(e.value)


def test_override_section_is_checked():
    with pytest.raises(PolicyError, match=r"policy.overrides\[0\].quantize: backend 'quanto'"):
        Policy.from_dict({"quantize": {"backend": "quanto", "bits": 4}, "overrides": [{"layers": [0], "quantize": {"bits": 3}}]})


def test_missing_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    with pytest.raises(PolicyError, match="backend 'hqq' needs the package 'hqq'.*pip install hqq"):
        backends.validate(QuantizePolicy(backend="hqq", bits=4), "policy.quantize")


def test_validation_imports_no_heavy_package():
    code = ("import sys; from tiercache.policy.schema import Policy; "
            "[Policy.from_dict({'quantize': {'backend': b, 'bits': 4}}) for b in ('native', 'quanto', 'hqq')]; "
            "print(any(m.startswith(('optimum.quanto', 'hqq')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
