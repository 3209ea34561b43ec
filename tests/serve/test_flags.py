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
