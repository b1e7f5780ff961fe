"""How data and questions are framed for an instruct model.

The session's reading cache holds `prefix + data`: the system prompt, then an open user turn
that the streamed data fills. A question closes that turn and adds its own user turn and the
assistant header; it lives only in the fork, so the data turn stays open for more input.
The pieces come from the tokenizer's own chat template, rendered once with sentinels, so
special tokens are never hard-coded.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. The user streams a document to you piece by piece. "
    "Answer questions about it briefly and accurately, using only what you have read."
)
DATA_HEADER = "Document:\n"

_DATA = "\x00STREAMER-DATA\x00"
_QUESTION = "\x00STREAMER-QUESTION\x00"


@dataclass(frozen=True, slots=True)
class Framing:
    """Text around the data and around each question."""

    prefix: str  # everything before the first data token
    between: str  # closes the data turn, opens the question turn
    suffix: str  # closes the question turn, opens the assistant turn

    @classmethod
    def for_tokenizer(cls, tokenizer, system_prompt: str | None = None) -> "Framing":
        system = DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
        if getattr(tokenizer, "chat_template", None):
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": DATA_HEADER + _DATA},
                        {"role": "user", "content": _QUESTION}]
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            head, rest = rendered.split(_DATA, 1)
            between, suffix = rest.split(_QUESTION, 1)
            return cls(prefix=head, between=between, suffix=suffix)
        return cls(prefix=f"{system}\n\n{DATA_HEADER}", between="\n\nQuestion: ", suffix="\nAnswer:")

    def question_text(self, question: str) -> str:
        return self.between + question + self.suffix
