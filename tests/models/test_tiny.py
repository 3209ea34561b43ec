"""The shipped tiny model: checksum verified at load, byte tokenizer, held-out split."""

import json
import shutil

import pytest
import torch

from tiercache.models import corpus, tiny
from tiercache.models.train import META, WEIGHTS


def test_tiny_loads_and_checksum_matches():
    meta = json.loads((tiny.DATA_DIR / META).read_text())
    assert (tiny.DATA_DIR / WEIGHTS).stat().st_size <= 8 * 2**20
    assert tiny.sha256(tiny.DATA_DIR / WEIGHTS) == meta["sha256"]
    model = tiny.load_tiny(train_if_missing=False, weights_dir=tiny.DATA_DIR)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA
    assert model.config.max_position_embeddings >= 4096
    x = torch.tensor([tiny.ByteTokenizer().encode("def f(x):\n    return x\n")])  # [1, T]
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=x).logits).all()


def test_tampered_weights_are_rejected(tmp_path):
    shutil.copy(tiny.DATA_DIR / META, tmp_path / META)
    data = bytearray((tiny.DATA_DIR / WEIGHTS).read_bytes())
    data[-1] ^= 0xFF
    (tmp_path / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(tiny.ChecksumError, match="sha256"):
        tiny.load_tiny(weights_dir=tmp_path)


def test_byte_tokenizer_round_trips():
    tok = tiny.ByteTokenizer()
    text = "naïve → ok\n"
    assert tok.decode(tok.encode(text)) == text
    assert max(tok.encode(text)) < 256 and tok.vocab_size == corpus.VOCAB_SIZE


def test_heldout_split_is_by_file_and_small():
    files = corpus.stdlib_files()
    held = [f for f in files if corpus.is_heldout(f)]
    assert 0.02 < len(held) / len(files) < 0.10
    ids = tiny.eval_ids(tiny.ByteTokenizer(), 1000)  # [1000]
    assert ids.shape == (1000,) and ids.dtype == torch.int64
    first = held[0].read_bytes()[:1000]
    assert bytes(ids[: len(first)].tolist()) == first
