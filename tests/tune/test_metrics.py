"""tiercache.tune.metrics against hand-computed references."""

import math

import pytest
import torch

from tiercache.models.tiny import ByteTokenizer
from tiercache.tune import metrics


def logp(rows):
    return torch.tensor(rows, dtype=torch.float32).log()


def test_kld_of_identical_distributions_is_zero():
    p = torch.softmax(torch.randn(5, 11), -1).log()
    assert torch.allclose(metrics.kld(p, p), torch.zeros(5), atol=1e-7)


def test_kld_known_example_reference_first():
    p, q = logp([[0.5, 0.5]]), logp([[0.25, 0.75]])
    want = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(P || Q) = 0.1438...
    assert metrics.kld(p, q).item() == pytest.approx(want, rel=1e-5)
    other = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # KL(Q || P), not what is measured
    assert metrics.kld(p, q).item() != pytest.approx(other, rel=1e-3)


def test_kld_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes differ"):
        metrics.kld(torch.zeros(2, 3), torch.zeros(2, 4))


def test_figures_by_hand():
    ref = logp([[0.5, 0.5], [0.9, 0.1]])
    cand = logp([[0.25, 0.75], [0.9, 0.1]])
    targets = torch.tensor([1, 0])
    f = metrics.figures(ref, cand, targets, (1, 3), (2, 3))
    kl0 = 0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75)
    assert f.kld == pytest.approx(kl0 / 2, rel=1e-5)
    ppl = math.exp(-(math.log(0.75) + math.log(0.9)) / 2)
    ppl_ref = math.exp(-(math.log(0.5) + math.log(0.9)) / 2)
    assert f.ppl == pytest.approx(ppl, rel=1e-6) and f.ppl_ref == pytest.approx(ppl_ref, rel=1e-6)
    assert f.ppl_change == pytest.approx(ppl / ppl_ref - 1, rel=1e-6)
    assert f.top1 == 0.5  # first row: argmax 0 (tie, first) vs 1; second agrees
    assert f.passkey_text() == "1/3 (fp 2/3)"


def test_passkey_samples_place_the_key_at_each_depth():
    tok = ByteTokenizer()
    filler = torch.tensor(tok.encode("x = 1\n" * 200))
    samples = metrics.passkey_samples(tok, filler, 600, depths=(0.1, 0.9), seed=3)
    assert len(samples) == 2
    for (ids, key), depth in zip(samples, (0.1, 0.9)):
        assert ids.numel() == 600
        text = tok.decode(ids.tolist())
        at = text.index(f"PASS_KEY = {key}")
        assert abs(at / 600 - depth) < 0.1
        assert text.endswith("assert PASS_KEY == ")
    with pytest.raises(ValueError, match="too short"):
        metrics.passkey_samples(tok, filler, 40)


class _Scripted:
    """A stand-in model: call ``c`` (the prefill is call 0) puts the most weight on ``answer[c]``."""

    def __init__(self, answer: list[int], vocab: int = 300):
        self.answer, self.vocab, self.calls = answer, vocab, 0
        self.device = torch.device("cpu")

    def __call__(self, input_ids, **kw):
        import types

        logits = torch.zeros(1, input_ids.shape[1], self.vocab)  # [1, T, V]
        logits[0, -1, self.answer[min(self.calls, len(self.answer) - 1)]] = 1.0
        self.calls += 1
        return types.SimpleNamespace(logits=logits)


@pytest.mark.parametrize("answer, found, calls", [
    ("48213\n", True, 6),   # the prefill, then one call per digit: the newline decides
    ("48219\n", False, 5),  # the last digit is wrong: no call after it
    ("7", False, 1),        # the first digit is wrong: decided by the prefill's answer
    ("482130", False, 6),   # more digits than the key: not the key
])
def test_passkey_answer_stops_once_decided(answer, found, calls):
    tok = ByteTokenizer()
    model = _Scripted(tok.encode(answer))
    ids = torch.tensor(tok.encode("x = 1\n"), dtype=torch.long)
    assert metrics.passkey_found(model, tok, None, ids, "48213") is found
    assert model.calls == calls


def test_passkey_text_when_full_precision_found_none():
    f = metrics.Figures(0.0, 0.0, 1.0, 1.0, 0.0, 1.0, None, (0, 3))
    assert f.passkey_text() == "- (fp 0/3)"


def test_verifier_skips_the_probe_where_full_precision_finds_no_key():
    from tiercache.models.load import load_model
    from tiercache.policy.schema import Policy
    from tiercache.tune.text import windows
    from tiercache.tune.verify import Verifier

    model, tok = load_model("tiny")
    wins, _ = windows(tok, None, 384, 2)
    v = Verifier(model, tok, wins[-1], 16)
    assert v.passkey_ref == (0, 3)  # the tiny model retrieves none at full precision
    assert v.samples == [] and v.forwards() == 16
    f = v.measure(Policy.from_dict({"quantize": {"bits": 2, "group_size": 32, "residual_length": 32}}))
    assert f.passkey is None and f.passkey_ref == (0, 3) and f.kld > 0
