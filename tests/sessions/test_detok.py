"""The streamed text of an answer equals the whole decode after every token."""
import random

import pytest

from streamer.sessions.detok import INCOMPLETE, TextStream, fast_decode

TEXTS = [
    "Hello world, this is a test. The robot arm moved 3.5 cm to the left!",
    "Ünïcödé text: café, naïve, Straße; emoji 🌍🚀✓ and CJK 漢字かな, mixed with code `x = y[0]`.",
    "  leading spaces,\ttabs\nand new lines\n\n- a list\n- of items\n",
    "Numbers 1234567890 and symbols @#$%^&*() ... the end.",
]


def whole(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


def check_stream(tokenizer, ids):
    """After every token the stream's text is the whole decode (or, while the whole decode ends
    inside a character, the last whole decode that did not); the deltas add up to the text."""
    stream, expected, deltas = TextStream(tokenizer), "", []
    for i, token in enumerate(ids):
        deltas.append(stream.push(token))
        full = whole(tokenizer, ids[:i + 1])
        if not full.endswith(INCOMPLETE):
            expected = full
        assert stream.text == expected, (i, ids[:i + 1])
    assert "".join(deltas) == stream.text
    assert stream.finish() == expected
    return stream


def llama_style_tokenizer():
    """A SentencePiece-style tokenizer (Metaspace words, byte fallback, a decoder that drops the
    first token's leading space), trained here on the texts above."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + bytes_,
                                  initial_alphabet=[])
    tk.train_from_iterator(TEXTS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", TEXTS)
def test_the_embedded_tokenizer_streams_the_whole_decode(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 10
    check_stream(tokenizer, ids)


def test_special_tokens_and_split_characters_stream_as_the_whole_decode(tokenizer):
    """Skipped special tokens between words, and characters whose bytes come one token each."""
    rng = random.Random(5)
    special = [tokenizer.eos_token_id, tokenizer.bos_token_id or tokenizer.eos_token_id]
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        for _ in range(6):
            spliced = list(ids)
            for _ in range(3):
                spliced.insert(rng.randrange(len(spliced) + 1), rng.choice(special))
            check_stream(tokenizer, spliced)
    # one byte token at a time: a 4-byte emoji as four tokens, three of them ending inside it
    chars = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("🌍")[0][0]
    byte_ids = [tokenizer.convert_tokens_to_ids(c) for c in chars]
    assert len(byte_ids) == 4 and tokenizer.unk_token_id not in byte_ids
    stream = check_stream(tokenizer, byte_ids + tokenizer(" ok")["input_ids"])
    assert stream.text == "🌍 ok"


def test_random_ids_stream_as_the_whole_decode(tokenizer):
    """Any ids a sampler might pick, valid text or not."""
    rng = random.Random(7)
    for _ in range(20):
        check_stream(tokenizer, [rng.randrange(len(tokenizer)) for _ in range(40)])


def test_a_sentencepiece_style_tokenizer_streams_the_whole_decode():
    tok = llama_style_tokenizer()
    rng = random.Random(3)
    for text in TEXTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids
        check_stream(tok, ids)
        spliced = list(ids)
        spliced.insert(rng.randrange(len(spliced)), tok.eos_token_id)
        check_stream(tok, spliced)
    # characters the training never saw: byte tokens, three to a character
    ids = tok("\u03a9mega \u2603 snow", add_special_tokens=False)["input_ids"]
    assert "<0xE2>" in tok.convert_ids_to_tokens(ids)
    check_stream(tok, ids)
    # the first token's leading space is dropped by the whole decode and by the stream alike
    stream = check_stream(tok, tok(" spaced out", add_special_tokens=False)["input_ids"])
    assert stream.text == "spaced out"


def test_a_tokenizer_with_its_own_decode_streams_through_it(tokenizer):
    """The backend is called directly only where the wrapper adds nothing; a tokenizer class with
    its own `_decode` is decoded through it."""
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, *args, **kwargs):
            return super()._decode(*args, **kwargs).upper()

    ids = tokenizer(TEXTS[1])["input_ids"]
    assert fast_decode(tokenizer)(ids) == whole(tokenizer, ids)
    loud = Shouting(tokenizer_object=tokenizer.backend_tokenizer, clean_up_tokenization_spaces=False)
    assert fast_decode(loud)(ids) == whole(tokenizer, ids).upper()
    assert check_stream(loud, ids).text == whole(tokenizer, ids).upper()


def test_the_stream_costs_the_same_per_token_however_long_the_answer(tokenizer):
    """Counted, not timed: each token decodes a window of a few tokens, not the answer so far."""
    seen = []
    stream = TextStream(tokenizer)
    decode = stream._decode
    stream._decode = lambda ids: seen.append(len(ids)) or decode(ids)
    ids = tokenizer(" ".join(TEXTS) * 8)["input_ids"]
    for token in ids:
        stream.push(token)
    assert len(ids) > 500 and max(seen) <= 8
    assert stream.finish() == whole(tokenizer, ids)
