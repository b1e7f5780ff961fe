"""An answer's text as its tokens arrive, at a cost that does not grow with the answer.

Decoding the whole answer after every token (what `tokenizer.decode(generated)` does) costs
time linear in the answer, so a long answer's text costs quadratic time in all: ~0.3-1.2 ms a
token at 2,048 tokens on a 2-core machine, as much as a decode step's forward. `TextStream`
decodes a short window instead: the tokens since the last point where the text was complete
(`read`), with the tokens of the window before it in front (`prefix`), and takes the text the
new tokens add after the prefix's own text. Decoding the prefix too keeps what a tokenizer does
at the start of a decode (a SentencePiece tokenizer drops the first token's leading space) the
same on both sides of the difference, and a window that ends inside a UTF-8 character (byte
tokens) waits for the next token, as the whole decode's trailing U+FFFD did.

`finish()` decodes the whole answer once and takes it where it differs from the streamed text
(a tokenizer whose clean-up rewrites text across a window's edge), so the final text is always
the whole decode's, and `tests/sessions/test_detok.py` holds the streamed text equal to the
whole decode after every token for byte-level BPE and SentencePiece-style tokenizers.
"""
from __future__ import annotations

from typing import Callable

INCOMPLETE = "\ufffd"  # what a decode ends with when its last bytes are part of a character


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """The tokenizer's decode with special tokens skipped: its Rust backend's directly where the
    Python wrapper would only call it (a fast tokenizer with no clean-up and no `_decode` of its
    own; ~1 us for a few tokens instead of ~6-25 us), otherwise the tokenizer's own `decode`."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """The text of a growing list of token ids; `push(token)` returns the text it adds."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = fast_decode(tokenizer)
        self.ids: list[int] = []
        self.text = ""
        self.prefix = 0  # the window's first token: the text from here to `read` is in `text`
        self.read = 0  # tokens before this are in `text`

    def push(self, token: int) -> str:
        """Add one token; return the text it completes ("" while a character is incomplete or
        the token adds no text, such as a skipped special token). `text` is the whole text."""
        self.ids.append(token)
        ids = self.ids
        before = self._decode(ids[self.prefix:self.read]) if self.read > self.prefix else ""
        now = self._decode(ids[self.prefix:])
        if len(now) <= len(before) or now.endswith(INCOMPLETE):
            return ""
        if not now.startswith(before):  # the window rewrote text before it: take the whole decode
            whole = self.tokenizer.decode(ids, skip_special_tokens=True)
            delta = whole[len(self.text):] if whole.startswith(self.text) else ""
            self.text, self.prefix, self.read = whole, len(ids) - 1, len(ids)
            return delta
        delta = now[len(before):]
        self.text += delta
        self.prefix, self.read = self.read, len(ids)
        return delta

    def finish(self) -> str:
        """The whole decode (once): the final text. Where the streamed text differs from it (a
        clean-up across a window's edge), the whole decode wins; a trailing incomplete character
        is left out, as it was while streaming."""
        whole = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not whole.endswith(INCOMPLETE):
            self.text = whole
        return self.text
