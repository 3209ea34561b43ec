"""``tiercache tune`` and ``tiercache check`` on the built-in tiny model at a short context."""

import json

import pytest

import tiercache
from tiercache import cli
from tiercache.models.load import load_model
from tiercache.tune import text
from tiercache.tune.verify import Verifier

CONTEXT, STRETCH = 512, 32
FAST = ["--model", "tiny", "--context", str(CONTEXT), "--stretch", str(STRETCH), "--no-progress"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    code = cli.main(["tune", *FAST, "--budget", "int4", "--no-passkey", "--out", str(d / "t.yaml")])
    return code, d


def frontier(path):
    return {r["name"]: r for r in json.loads(path.read_text())["rows"]}


@pytest.mark.slow
def test_tune_writes_a_policy_that_fits_and_beats_uniform(tuned):
    code, d = tuned
    assert code == 0
    policy = tiercache.load_policy(d / "t.yaml")
    header = (d / "t.yaml").read_text().splitlines()[0]
    assert header.startswith("# written by tiercache tune for model tiny, context 512")
    rows = frontier(d / "t.frontier.json")
    budget = rows["uniform-int4"]["bytes"]
    plan = tiercache.plan(policy, "tiny", 1, CONTEXT)
    assert sum(plan.bytes.values()) <= budget
    assert (d / "t.frontier.png").stat().st_size > 1000 and (d / "t.sensitivity.json").is_file()
    # measured again here, apart from tune: at no more bytes, no more KLD than uniform int4
    model, tok = load_model("tiny")
    wins, _ = text.windows(tok, None, CONTEXT, 2)
    v = Verifier(model, tok, wins[-1], STRETCH, passkey=False)
    mine = v.measure(policy)
    uniform = v.measure(tiercache.load_policy("configs/int4-kivi.yaml"))
    assert mine.kld <= uniform.kld * 1.0001


@pytest.mark.slow
def test_second_tune_reads_the_calibration(tuned, capsys):
    _, d = tuned
    before = (d / "t.sensitivity.json").read_text()
    code = cli.main(["tune", *FAST, "--budget", "int2", "--no-passkey", "--out", str(d / "t2.yaml"),
                     "--calibration", str(d / "t.sensitivity.json")])
    out = capsys.readouterr().out
    assert code == 0 and "read from file" in out
    assert (d / "t.sensitivity.json").read_text() == before
    rows = frontier(d / "t2.frontier.json")
    chosen = tiercache.load_policy(d / "t2.yaml")
    assert sum(tiercache.plan(chosen, "tiny", 1, CONTEXT).bytes.values()) <= rows["uniform-int2"]["bytes"]


@pytest.mark.slow
def test_calibration_of_another_model_is_refused(tuned, tmp_path, capsys):
    _, d = tuned
    data = json.loads((d / "t.sensitivity.json").read_text())
    data["meta"]["model"] = "smollm2-135m"
    (tmp_path / "s.json").write_text(json.dumps(data))
    code = cli.main(["tune", *FAST, "--budget", "int4", "--out", str(tmp_path / "x.yaml"), "--calibration",
                     str(tmp_path / "s.json")])
    assert code == 1 and "measured on model 'smollm2-135m'" in capsys.readouterr().err


@pytest.mark.slow
def test_check_exits_by_threshold(capsys):
    args = ["check", "configs/int2-kivi.yaml", "--model", "tiny", "--context", str(CONTEXT), "--stretch", str(STRETCH)]
    assert cli.main(args + ["--max-kld", "1e-9"]) == 1
    out = capsys.readouterr().out
    assert "FAIL: KLD" in out and "pass key" in out
    assert cli.main(args + ["--max-kld", "10", "--no-passkey"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (["--budget", "10"], "below what any candidate needs"),
    (["--budget", "int4", "--text", "/nonexistent/file.txt"], "cannot be read"),
    (["--budget", "int4", "--stretch", "600"], "must be below --context"),
    (["--budget", "int4", "--out", "policy.txt"], "give a .yaml path"),
    (["--budget", "int4", "--time-budget", "0.001"], "--time-budget"),
])
def test_tune_bad_inputs(extra, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["tune", "--model", "tiny", "--context", str(CONTEXT), "--no-progress", "--out", "p.yaml", *extra]
    assert cli.main(args) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--budget", "1MiB", "--max-kld", "0.1"], [], ["--budget", "12 parsecs"],
                                   ["--max-kld", "-1"]])
def test_tune_bad_flags_are_usage_errors(extra, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--model", "tiny", "--context", "512", *extra])
    assert e.value.code == 2


def test_check_bad_policy(capsys):
    assert cli.main(["check", "/nonexistent.yaml", "--model", "tiny"]) == 1
    assert "does not exist" in capsys.readouterr().err
