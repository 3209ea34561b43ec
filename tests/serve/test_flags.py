"""``tiercache serve`` step flags: defaults, and a step budget that cannot hold a chunk is refused before loading."""

from __future__ import annotations

from tiercache.cli import main, parser


def test_defaults():
    args = parser().parse_args(["serve"])
    assert (args.max_active, args.prefill_chunk, args.step_tokens) == (8, 256, 512)


def test_step_tokens_must_exceed_max_active(capsys):
    assert main(["serve", "--max-active", "8", "--step-tokens", "8", "--model", "no-such-model"]) == 1
    err = capsys.readouterr().err
    assert "--step-tokens (8) must be more than --max-active (8)" in err


def test_shutdown_timeout_is_positive_and_finite(capsys):
    import pytest

    assert parser().parse_args(["serve"]).shutdown_timeout == 30.0
    assert parser().parse_args(["serve", "--shutdown-timeout", "2.5"]).shutdown_timeout == 2.5
    for bad in ("0", "-1", "inf", "nan", "soon"):
        with pytest.raises(SystemExit):
            parser().parse_args(["serve", "--shutdown-timeout", bad])
        assert "--shutdown-timeout" in capsys.readouterr().err
