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
