"""Detokenization with stop strings, sampling, the fallback chat template: small pieces, exact answers."""

from __future__ import annotations

import pytest
import torch

from tiercache.models.tiny import ByteTokenizer
from tiercache.serve.chat import Codec, fallback_template
from tiercache.serve.protocol import parse_completion
from tiercache.serve.sampling import Sampler
from tiercache.serve.text import TextStream

TOK = ByteTokenizer()


def feed(text: str, stops) -> tuple[list[str], TextStream]:
    stream = TextStream(TOK.decode, stops)
    deltas = [stream.push(b) for b in text.encode("utf-8")]
    return deltas + [stream.finish()], stream


@pytest.mark.parametrize("text, stops, sent, stopped", [
    ("hello world", [], "hello world", False),
    ("hello\n\nworld", ["\n\n"], "hello", True),
    ("a <stop> b", ["<stop>", "zz"], "a ", True),
    ("almost <sto", ["<stop>"], "almost <sto", False),  # a partial stop is sent at the end
    ("héllo ✓", [], "héllo ✓", False),  # multi-byte characters are never split
])
def test_text_stream_never_shows_a_stop_string(text, stops, sent, stopped):
    deltas, stream = feed(text, stops)
    assert "".join(deltas) == sent == stream.text and stream.stopped == stopped
    assert all("\ufffd" not in d for d in deltas)
    for s in stops:
        assert all(s not in "".join(deltas[: i + 1]) for i in range(len(deltas)))


def pick(logits, temperature, top_p, seed=None) -> int:
    req = parse_completion({"model": "m", "prompt": "x", "temperature": temperature, "top_p": top_p, "seed": seed})
    return Sampler(req, Codec(TOK), "cpu").pick(logits)


def test_pick_greedy_top_p_and_seed():
    logits = torch.tensor([0.0, 3.0, 2.9, -5.0])
    assert pick(logits, 0.0, 1.0) == 1
    # top_p just above p(top) keeps the first two: the others are never drawn
    p = torch.softmax(logits, -1)
    draws = {pick(logits, 1.0, float(p[1]) + 0.01, s) for s in range(200)}
    assert draws == {1, 2}
    same = [pick(logits, 1.0, 1.0, 7) for _ in range(3)]
    assert len(set(same)) == 1


def test_fallback_template_is_plain_and_byte_exact():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = fallback_template(messages)
    assert text == "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert Codec(TOK).chat(messages) == list(text.encode())


class TemplateTokenizer:
    """A stand-in for a transformers tokenizer with a chat template (ids: one per character)."""

    chat_template = "{% for m in messages %}...{% endfor %}"
    eos_token_id = 3

    def __len__(self):
        return 1000

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and not tokenize
        if any(m["role"] == "system" for m in messages):
            raise ValueError("System role not supported")
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": ([1] if add_special_tokens else []) + [ord(c) for c in text]}


def test_the_tokenizers_own_template_is_used_and_its_refusal_is_a_400():
    from tiercache.serve.errors import APIError

    codec = Codec(TemplateTokenizer(), eos_ids=[7])
    assert codec.chat([{"role": "user", "content": "hi"}]) == [ord(c) for c in "[user]hi[assistant]"]
    assert codec.eos_ids == {3, 7} and codec.vocab_size == 1000
    with pytest.raises(APIError, match="System role not supported") as e:
        codec.chat([{"role": "system", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages"
