"""Prompt rendering: a question as the user message (after the chat turns of `data.chat_prefix`, if any) through the
tokenizer's chat template, and the
longest text one token can stand for (to skip a too-long question before tokenising it)."""

from __future__ import annotations

from typing import Sequence


def render_prompt(tokenizer, question: str, prefix: Sequence[dict[str, str]] = ()) -> list[int]:
    """Token ids of `question` as the user message after the chat turns `prefix` (`data.chat_prefix`: a system
    message, few-shot user/assistant pairs; none: the question is the single message), through the tokenizer's
    chat template."""
    messages = [*prefix, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def max_chars_per_token(tokenizer) -> int:
    """The most characters one token can stand for: the longest vocabulary entry (a raw entry is at
    least as long as its text: byte-level entries spell each byte with one character, sentencepiece
    ones each character with one, byte-fallback `<0xNN>` ones one byte with six)."""
    return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
