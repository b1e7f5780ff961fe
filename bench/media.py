"""Media ingest: does a session keep up with live video and audio on this machine?

Measured in one run, on the embedded defaults (SmolLM2 + the frame describer + Whisper tiny.en)
behind a real websocket server:

- video throughput: a synthetic clip (a scene cut every 2 s, a moving square) streamed as
  MPEG-TS as fast as the server takes it. `video_fps`: every frame sampled and no duplicate
  skipping, so every frame goes through decode -> describer -> (a line when something changed)
  engine append: frames per second of wall time, side by side with decode alone and decode +
  describer without the engine. Then the default settings (2 fps of media time, duplicates
  skipped): seconds of video per second of wall time;
- lag: JPEG pictures sent live at 2 and 10 fps, each a new scene (worst case: every picture
  becomes an observation appended to the cache), from the capture timestamp to the
  `media.observation` event that says it is in the cache; newest-frame-wins drops counted;
- the tiny random-weight Qwen2.5-VL on the engine (bench/video.py, with --vlm): frames/s of 16
  sessions batched vs one at a time;
- audio real-time factor (bench/media_audio.py): seconds of speech per second of processing.

Torch runs on one thread by default (--threads): on a machine shared with other work, two
threads that wait on each other were ~8x slower per append than one here.

Run: python bench/media.py [--video-seconds 30] [--lag-seconds 10] [--audio-seconds 20] [--vlm]
The last line is `RESULT video_fps=<x> lag_2fps_s=<x> audio_rtf=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from videogen import encode_image, encode_video  # noqa: E402

from streamer.clients.client import StreamerClient  # noqa: E402
from streamer.media import MediaConfig  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.vision.describe import FrameDescriber  # noqa: E402
from streamer.vision.ingest import VideoConfig  # noqa: E402
from streamer.vision.video import FrameSampler, VideoDecoder  # noqa: E402

SIZE = (240, 320)  # height, width of the synthetic clips


def clip(seconds: float, fps: int = 10) -> bytes:
    scenes = [(float(t), ((t * 67) % 256, (t * 131) % 256, (t * 29) % 256)) for t in range(0, int(seconds) + 2, 2)]
    return encode_video("mpegts", seconds=seconds, fps=fps, scenes=scenes, size=SIZE)


def offline_rates(data: bytes, max_side: int) -> tuple[float, float, int]:
    """Frames/s of decode alone and of decode + sampling + describer (no engine, no socket)."""
    from streamer.vision.video import DecodeLimits

    limits = DecodeLimits(max_side=max_side)
    t = time.perf_counter()
    decoder = VideoDecoder("mpegts", limits=limits)
    frames = decoder.feed(data) + decoder.finish()
    decode_fps = len(frames) / (time.perf_counter() - t)
    t = time.perf_counter()
    decoder = VideoDecoder("mpegts", limits=limits)
    frames = decoder.feed(data) + decoder.finish()
    kept = FrameSampler(fps=1000.0).filter(frames)
    FrameDescriber().encode(kept)
    return decode_fps, len(frames) / (time.perf_counter() - t), len(frames)


async def wait_encoded(session, timeout: float = 600.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        video = (await session.state())["media"]["video"]
        if video["encoded"] + video["dropped"] >= video["sampled"] or time.monotonic() > deadline:
            return video
        await asyncio.sleep(0.05)


async def throughput(url: str, data: bytes, piece: int = 16384) -> tuple[float, dict]:
    async with await StreamerClient.connect(url) as client:
        session = await client.create_session()
        started = time.perf_counter()
        pieces = [data[i:i + piece] for i in range(0, len(data), piece)]
        acks = 0
        for seq, part in enumerate(pieces):
            await session.send_media("video", "mpegts", part, seq, live=False, end=seq == len(pieces) - 1 or None)
        async for event in client.events():
            if event["type"] == "input.ack" and "media_seq" in event:
                acks += 1
                if acks == len(pieces):
                    break
            elif event["type"] == "error":
                raise RuntimeError(event["error"])
        video = await wait_encoded(session)
        took = time.perf_counter() - started
        await session.close()
    return video["decoded"] / took, video


async def live_lag(url: str, fps: float, seconds: float) -> dict:
    """Pictures captured live at `fps`, each a new scene; lag capture -> in the cache."""
    rng = np.random.default_rng(0)
    images = []
    for _ in range(16):
        image = np.empty((*SIZE, 3), np.uint8)
        image[:] = rng.integers(0, 256, 3)
        images.append(encode_image("jpeg", image))
    async with await StreamerClient.connect(url) as client:
        session = await client.create_session()
        lags: list[float] = []
        acked = [0]

        async def collect() -> None:
            async for event in client.events():
                if event["type"] == "media.observation":
                    lags.append(event["lag_ms"] / 1000)
                elif event["type"] == "input.ack":
                    acked[0] += 1

        reader = asyncio.get_running_loop().create_task(collect())
        t0 = time.monotonic()
        n = int(seconds * fps)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / fps - time.monotonic()))
            await session.send_media("image", "jpeg", images[i % len(images)], i, ts=time.time())
        while acked[0] < n:  # every picture decoded and sampled (or not) before counting
            await asyncio.sleep(0.01)
        video = await wait_encoded(session)
        deadline = time.monotonic() + 10
        while len(lags) < video["observations"] and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the last events are on their way
        reader.cancel()
        await session.close()
    return {"offered": n, "in_cache": len(lags), "encoded": video["encoded"], "dropped": video["dropped"],
            "duplicates": video["duplicates"],
            "lag_median_s": statistics.median(lags), "lag_p90_s": float(np.percentile(lags, 90)),
            "lag_max_s": max(lags)}


async def video_bench(engine, args) -> dict:
    data = clip(args.video_seconds)
    every_frame = MediaConfig(video=VideoConfig(sample_fps=1000.0, dup_threshold=0.0), window_tokens=None)
    server = await StreamerServer(engine, ServerConfig(port=0, media=every_frame)).start()
    try:
        url = f"ws://127.0.0.1:{server.port}"
        await throughput(url, clip(2.0))  # warm-up: first-use costs (PyAV, allocations) excluded
        fps, video = await throughput(url, data)
    finally:
        await server.stop()
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    try:
        default_fps, default_video = await throughput(f"ws://127.0.0.1:{server.port}", data)
    finally:
        await server.stop()
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    try:
        url = f"ws://127.0.0.1:{server.port}"
        lag2 = await live_lag(url, 2.0, args.lag_seconds)
        lag10 = await live_lag(url, 10.0, args.lag_seconds)
    finally:
        await server.stop()
    return {"fps": fps, "video": video, "lag2": lag2, "lag10": lag10, "clip_frames": video["decoded"],
            "data": data, "default_fps": default_fps, "default_video": default_video}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--video-seconds", type=float, default=30.0)
    parser.add_argument("--lag-seconds", type=float, default=10.0)
    parser.add_argument("--audio-seconds", type=float, default=20.0)
    parser.add_argument("--vlm", action="store_true", help="also the tiny-vl engine path (bench/video.py)")
    parser.add_argument("--skip-audio", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = parser.parse_args()

    from streamer.app import build_engine

    engine = build_engine("embedded", threads=args.threads)
    try:
        v = asyncio.run(video_bench(engine, args))
    finally:
        engine.stop()
    decode_fps, describe_fps, n = offline_rates(v["data"], VideoConfig().decode.max_side)
    video = v["video"]
    print(f"video: {args.video_seconds:.0f} s synthetic MPEG-TS, {SIZE[1]}x{SIZE[0]} at 10 fps ({n} frames), "
          f"every frame sampled, no duplicate skipping; embedded SmolLM2 + frame describer")
    print(f"  decode alone                {decode_fps:8.1f} frames/s")
    print(f"  decode + describer          {describe_fps:8.1f} frames/s")
    print(f"  session (websocket, engine) {v['fps']:8.1f} frames/s  ({video['observations']} observations "
          f"appended, {video['duplicates']} duplicates skipped, {video['dropped']} dropped)")
    print(f"  session vs decode alone     {v['fps'] / decode_fps:8.2f}x;  vs 2 fps live input {v['fps'] / 2:8.1f}x;"
          f"  vs 10 fps {v['fps'] / 10:6.1f}x")
    d = v["default_video"]
    print(f"  default settings (2 fps sampled, duplicates skipped): {v['default_fps'] / 10:.1f} s of video per "
          f"second ({v['default_fps']:.1f} input frames/s; {d['sampled']} sampled, {d['observations']} observations)")
    for name, lag in (("2 fps", v["lag2"]), ("10 fps", v["lag10"])):
        print(f"  live {name:6s} pictures: capture -> cache median {lag['lag_median_s'] * 1000:7.1f} ms, "
              f"p90 {lag['lag_p90_s'] * 1000:7.1f} ms, max {lag['lag_max_s'] * 1000:7.1f} ms; "
              f"{lag['offered']} sent, {lag['encoded']} described, {lag['in_cache']} lines appended (no line when "
              f"nothing changed), {lag['dropped']} dropped (newest wins)")
    print(f"  lag 10 fps / 2 fps          {v['lag10']['lag_median_s'] / v['lag2']['lag_median_s']:8.2f}x")

    if args.vlm:
        from video import ingest_rate, picture

        from streamer.app import load_tiny_vl
        from streamer.sessions.multimodal import frame_input
        from streamer.sessions.runner import ModelRunner

        loaded = load_tiny_vl()
        runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.name)
        frames = [frame_input(runner.vl, picture(k), 64, runner.tokenize(f"[{k / 2:.1f}s] "), k / 2) for k in range(8)]
        batched, serial = ingest_rate(runner, 16, frames, True), ingest_rate(runner, 16, frames, False)
        print(f"tiny-vl on the engine, 16 sessions: {batched:.1f} frames/s batched vs {serial:.1f} one at a time "
              f"({batched / serial:.2f}x; bench/video.py for the rest)")

    rtf = None
    if not args.skip_audio:
        from media_audio import measure_audio_rtf

        report: dict = {}
        rtf = measure_audio_rtf(args.audio_seconds, "pcm_s16le", report)
        print(f"audio: {report['audio_s']:.1f} s of espeak-ng speech as PCM in 100 ms pieces, Whisper tiny.en "
              f"(faster-whisper): {report['seconds']:.2f} s of processing, real-time factor {rtf:.2f} "
              f"({report['finals']} finals, {report['partials']} partials)")
    keeps_up = v["fps"] >= 2 and v["lag2"]["dropped"] == 0 and (rtf is None or rtf >= 1)
    print(f"keeps up with 2 fps video{' and real-time audio' if rtf is not None else ''}: {'yes' if keeps_up else 'NO'}")
    audio = f"{rtf:.2f}" if rtf is not None else "nan"
    print(f"RESULT video_fps={v['fps']:.2f} lag_2fps_s={v['lag2']['lag_median_s']:.4f} audio_rtf={audio}")


if __name__ == "__main__":
    main()
