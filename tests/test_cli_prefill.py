"""``tiercache generate --prefill-chunk`` / ``--prompt-file``: chunked prefill from the CLI."""

from tiercache.cli import main


def _text(out: str) -> str:
    return out.split("\n---\n")[0]


def test_chunked_prefill_gives_the_one_shot_text(capsys, tmp_path):
    prompt = "import os\nimport sys\n\ndef main():\n    "
    assert main(["generate", "--model", "tiny", "--prompt", prompt, "--max-new-tokens", "12",
                 "--prefill-chunk", "100000"]) == 0
    one_shot = capsys.readouterr().out
    (tmp_path / "p.txt").write_text(prompt)
    assert main(["generate", "--model", "tiny", "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "12",
                 "--prefill-chunk", "5"]) == 0
    chunked = capsys.readouterr().out
    assert _text(chunked) == _text(one_shot)
    assert "prefill chunks of 5" in chunked and "memory: planned total" in chunked and "peak RSS" in chunked


def test_default_chunk_is_the_plans_and_bad_files_are_refused(capsys, tmp_path):
    assert main(["generate", "--model", "tiny", "--prompt", "x = 1", "--max-new-tokens", "2"]) == 0
    assert "prefill chunks of 7" in capsys.readouterr().out  # 2048 capped at prompt + new tokens
    assert main(["generate", "--model", "tiny", "--prompt-file", str(tmp_path / "missing.txt")]) == 1
    assert "--prompt-file" in capsys.readouterr().err
