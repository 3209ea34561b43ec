"""``tiercache serve`` step flags: what a server started without them runs with, and bad values refused
before anything is loaded."""

from __future__ import annotations

import inspect

import pytest

from tiercache.cli import main, parser
from tiercache.errors import PolicyError


def _built_with(monkeypatch, argv: list[str]) -> dict:
    """The worker options ``tiercache serve argv`` builds its server with (the build stops there)."""
    from tiercache.serve import server

    seen: dict = {}

    def build(*args, **options):
        seen.update(options)
        raise PolicyError("stopped by the test before loading a model")

    monkeypatch.setattr(server, "build", build)
    assert main(["serve", *argv]) == 1
    return seen


def test_a_server_without_step_flags_runs_the_workers_own_defaults(monkeypatch):
    """One source of the defaults: the CLI hands the worker what the library's ``Worker`` uses alone."""
    from tiercache.serve.worker import Worker

    seen = _built_with(monkeypatch, [])
    library = {name: p.default for name, p in inspect.signature(Worker).parameters.items()}
    for name in ("max_active", "queue_size", "timeout", "prefill_chunk", "step_tokens"):
        assert seen[name] == library[name], name
    assert seen["step_tokens"] > seen["max_active"]  # the defaults make a valid step budget


def test_step_flags_reach_the_worker(monkeypatch):
    seen = _built_with(monkeypatch, ["--max-active", "3", "--prefill-chunk", "64", "--step-tokens", "80"])
    assert (seen["max_active"], seen["prefill_chunk"], seen["step_tokens"]) == (3, 64, 80)


def test_step_tokens_must_exceed_max_active(capsys):
    assert main(["serve", "--max-active", "8", "--step-tokens", "8", "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "--step-tokens (8) must be more than --max-active (8)" in err


def test_shutdown_timeout_is_positive_and_finite(capsys):
    assert parser().parse_args(["serve", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--shutdown-timeout", bad])
        assert "--shutdown-timeout" in capsys.readouterr().err
