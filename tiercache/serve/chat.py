"""Text <-> token ids for the served model: ``Codec(tokenizer, eos_ids)``.

    codec.chat(messages) -> list[int]     the prompt of a chat request
    codec.encode(text) -> list[int]; codec.decode(ids) -> str; codec.eos_ids: set[int]
    codec.vocab_size

Chat template: the tokenizer's own (``apply_chat_template`` with the generation prompt) when it
has one. Otherwise (the built-in byte-level tiny model, base models) the plain fallback

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

one block per message with its role's name, ending with the assistant's header. A template that
refuses the messages (e.g. a role it does not know) is a 400 naming ``messages``.
"""

from __future__ import annotations

from tiercache.serve.errors import APIError

SLICE = 1 << 16  # characters tokenized per call of the byte-level tokenizer


def fallback_template(messages) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


class Codec:
    def __init__(self, tokenizer, eos_ids=()):
        self.tok = tokenizer
        self.byte_level = not hasattr(tokenizer, "apply_chat_template")
        own = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = {int(i) for i in eos_ids} | ({int(own)} if isinstance(own, int) else set())
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.vocab_size = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.vocab_size

    def encode(self, text: str) -> list[int]:
        if self.byte_level:
            return self._bytes(text)
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def _bytes(self, text: str) -> list[int]:
        """The byte-level ids, a slice at a time: a long text never holds the GIL for long (the
        server prepares requests in a thread while its event loop answers)."""
        if len(text) <= SLICE:
            return self.tok.encode(text)
        ids: list[int] = []
        for at in range(0, len(text), SLICE):
            ids += self.tok.encode(text[at:at + SLICE])
        return ids

    def decode(self, ids) -> str:
        if self.byte_level:
            return self.tok.decode(ids)
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, messages) -> list[int]:
        if not self.has_template:
            text = fallback_template(messages)
            return self._bytes(text) if self.byte_level else list(self.tok(text)["input_ids"])
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja raises whatever the template says
            raise APIError(400, f"the model's chat template refused these messages: {e}", param="messages") from None
        return list(self.tok(text, add_special_tokens=False)["input_ids"])
