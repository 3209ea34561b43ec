"""``research.needle``: each layer's and head's attention on the needle, against the
attention weights transformers' own eager attention returns (``output_attentions=True``), on the
built-in tiny model and on a sliding-window model (Mistral, window shorter than the context)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig

from research import needle, retrieval
from tiercache.models.tiny import ByteTokenizer
from tiercache.models.load import load_model


def reference(model, sample) -> torch.Tensor:
    ids = torch.cat([sample.context, sample.question])[None]  # [1, T + Q]
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            weights = model(input_ids=ids, use_cache=False, output_attentions=True).attentions  # L x [1, Hq, S, S]
    finally:
        model.set_attn_implementation(before)
    return torch.stack([w[0, :, -1, sample.needle].sum(-1) for w in weights])  # [L, Hq]


def sliding_model():
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=96, max_position_embeddings=1024)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("which", ["tiny", "sliding"])
@pytest.mark.parametrize("fmt", sorted(retrieval.FORMATS))
def test_attention_on_the_needle_is_the_eager_weights_last_row(which, fmt):
    model = load_model("tiny")[0] if which == "tiny" else sliding_model()
    tok = ByteTokenizer()
    before = model.config._attn_implementation
    samples = retrieval.samples(tok, [400], [0.2, 0.8], seed=1, fmt=fmt)
    got = []
    for s in samples:
        att = needle.attention(model, s)  # [L, Hq]
        assert att.shape == (model.config.num_hidden_layers, model.config.num_attention_heads)
        torch.testing.assert_close(att, reference(model, s), rtol=1e-4, atol=1e-5)
        assert model.config._attn_implementation == before  # restored
        got.append(att)
    torch.testing.assert_close(needle.mean_attention(model, samples), torch.stack(got).mean(0))
    if which == "sliding":  # the window hides the needle from the last token: no weight, as the eager mask says
        far = [s for s in samples if s.length - s.needle.stop > 96]
        assert far and all(float(needle.attention(model, s).max()) == 0 for s in far)


def test_no_samples_is_refused():
    with pytest.raises(ValueError, match="at least one sample"):
        needle.mean_attention(load_model("tiny")[0], [])


def test_table_marks_the_layers_whose_strongest_head_reads_the_needle():
    att = torch.tensor([[0.1, 0.05], [0.2, 0.6], [0.4, 0.0]])  # [L, Hq]
    rows = needle.table(att, threshold=0.4).splitlines()[2:]
    assert [r.split("|")[2].strip() for r in rows] == ["0", "1", "0"]  # strongest head
    assert [r.rstrip(" |").endswith("yes") for r in rows] == [False, True, True]
    assert "0.075" in rows[0] and "0.400" in rows[1]
