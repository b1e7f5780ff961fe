"""Glass to cache from a browser: the /app page in headless Chromium streams a fake camera and
microphone into a session on the embedded defaults (SmolLM2 + the frame describer + Whisper
tiny.en) behind a real server on this machine.

Glass-to-cache lag: from a frame's capture in the page (the media frame header's `ts`, the
page's clock at capture; a WebM frame's capture time is its container's start + its
timestamp) to the `media.observation` event that says it is in the cache, read on the page's
clock (same machine: one clock). The fake camera plays a generated Y4M at 10 fps with a new
colour every 0.5 s, so every frame the server samples (2 per second of media time) becomes an
observation. Warm-up (the first `--warmup` seconds) is excluded. Measured side by side:

- the page, camera as MediaRecorder WebM pieces (100 ms slices, VP8) + microphone as PCM
  s16le 16 kHz from an AudioWorklet, for `--seconds`;
- the page, camera as JPEG snapshots at 2 fps + microphone, for `--jpeg-seconds`;
- baseline, no browser: a Python client sending the same scenes as JPEG pictures at 2 fps
  (capture stamp taken right before encoding) and the same speech as PCM at real time, for
  `--jpeg-seconds`.

Bytes per second are the media frames the page sent (headers included) for camera +
microphone during the measured window.

Run: python bench/browser.py [--seconds 60] [--jpeg-seconds 20] [--model embedded|tiny]
The last line is `RESULT glass_to_cache_p50_s=<x> glass_to_cache_p99_s=<x> bytes_per_s=<x> ...`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from browserutil import Browser, media_flags  # noqa: E402
from fakemedia import scene, write_speech_wav, write_y4m  # noqa: E402
from videogen import encode_image  # noqa: E402

from streamer.server import ServerConfig, StreamerServer  # noqa: E402

SENTENCES = ["turn on the lights in the kitchen", "we need more coffee", "the meeting starts at ten",
             "please open the kitchen window"]
SCENE_S = 0.5
SIZE = (240, 320)

# Installed in the page once the session exists: every observation's lag on the page's clock,
# and the media bytes sent, so the window can be cut after warm-up.
PROBE = """(() => {
  const app = window.streamerApp;
  window.bench = { obs: [] };
  app.session.on("media.observation", (ev) => window.bench.obs.push(
    { at: Date.now() / 1000, lag: Date.now() / 1000 - ev.capture_ts, server_ms: ev.lag_ms }));
  return true;
})()"""
COUNTERS = """JSON.stringify({ t: Date.now() / 1000, video: streamerApp.client.stats.mediaBytes.video,
  audio: streamerApp.client.stats.mediaBytes.audio, dropped: streamerApp.client.stats.mediaDropped,
  transcripts: document.querySelectorAll('#transcripts li').length })"""


def percentiles(values: list[float]) -> tuple[float, float]:
    return float(np.percentile(values, 50)), float(np.percentile(values, 99))


async def browser_phase(base: str, page, mode: str, seconds: float, warmup: float) -> dict:
    """One run of the page: a new session, camera in `mode` + microphone, for warmup + seconds."""
    await page.navigate(base + "/app")
    await page.eval("localStorage.clear()")
    await page.reload()
    await page.eval(f"document.getElementById('camera-mode').value = {json.dumps(mode)}")
    await page.eval("document.getElementById('jpeg-fps').value = '2'")
    await page.eval("document.getElementById('create').click()")
    await page.wait_for("!document.getElementById('camera').disabled", 60)
    await page.eval(PROBE)
    await page.eval("document.getElementById('camera').click()")
    await page.eval("document.getElementById('mic').click()")
    await asyncio.sleep(warmup)
    start = json.loads(await page.eval(COUNTERS))
    await asyncio.sleep(seconds)
    end = json.loads(await page.eval(COUNTERS))
    obs = [o for o in await page.eval("window.bench.obs") if start["t"] <= o["at"] <= end["t"]]
    video_state = await page.eval("JSON.stringify(streamerApp.video)")
    await page.eval("document.getElementById('stop').click()")
    await page.wait_for("document.getElementById('session-note').textContent.includes('closed')", 60)
    took = end["t"] - start["t"]
    lags = [o["lag"] for o in obs]
    p50, p99 = percentiles(lags)
    return {"mode": mode, "seconds": took, "observations": len(obs), "p50": p50, "p99": p99,
            "server_p50_ms": float(np.percentile([o["server_ms"] for o in obs], 50)),
            "video_bps": (end["video"] - start["video"]) / took, "audio_bps": (end["audio"] - start["audio"]) / took,
            "media": json.loads(video_state), "transcripts": end["transcripts"]}


async def speak(session, pcm: bytes, rate: int, seconds: float) -> None:
    """The microphone's file as PCM s16le in 100 ms pieces at real time, looped (as Chromium does)."""
    piece = rate // 10 * 2
    t0 = time.monotonic()
    for i in range(int(seconds * 10)):
        await asyncio.sleep(max(0.0, t0 + (i + 1) / 10 - time.monotonic()))
        at = i * piece % (len(pcm) - piece)
        await session.send_media("audio", "pcm_s16le", pcm[at:at + piece], i, ts=time.time() - 0.1,
                                 sample_rate=rate, channels=1)


async def python_baseline(url: str, seconds: float, warmup: float, audio: Path) -> dict:
    """JPEG pictures of the same scenes at 2 fps from Python (capture stamp, encode, send), and
    the same speech as PCM at real time: the page's load without the page."""
    import wave

    with wave.open(str(audio)) as w:
        rate, pcm = w.getframerate(), w.readframes(w.getnframes())
    from streamer.clients.client import StreamerClient

    async with await StreamerClient.connect(url) as client:
        session = await client.create_session()
        obs: list[tuple[float, float]] = []

        async def collect() -> None:
            async for event in client.events():
                if event["type"] == "media.observation":
                    obs.append((time.time(), time.time() - event["capture_ts"]))

        reader = asyncio.get_running_loop().create_task(collect())
        speaker = asyncio.get_running_loop().create_task(speak(session, pcm, rate, seconds + warmup))
        t0 = time.monotonic()
        n = int((seconds + warmup) * 2)
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / 2 - time.monotonic()))
            ts = time.time()
            await session.send_media("image", "jpeg", encode_image("jpeg", scene(i * SCENE_S, SCENE_S, SIZE)), i, ts=ts)
        await speaker
        await asyncio.sleep(2.0)  # the last observations are on their way
        reader.cancel()
        await session.close()
    cut = time.time() - 2.0 - seconds
    lags = [lag for at, lag in obs if at >= cut]
    p50, p99 = percentiles(lags)
    return {"observations": len(lags), "p50": p50, "p99": p99}


def report(name: str, r: dict) -> None:
    media = r.get("media", {})
    extra = (f", video {r['video_bps']:.0f} B/s + audio {r['audio_bps']:.0f} B/s, "
             f"server lag p50 {r['server_p50_ms']:.0f} ms, dropped {media.get('dropped', 0)}, "
             f"{r['transcripts']} transcripts") if "video_bps" in r else ""
    print(f"{name}: {r['observations']} observations, glass-to-cache p50 {r['p50']:.3f} s, "
          f"p99 {r['p99']:.3f} s{extra}", flush=True)


async def run(args) -> None:
    from streamer.app import build_engine

    engine = build_engine(args.model, threads=args.threads)
    workdir = Path(tempfile.mkdtemp(prefix="bench-browser-"))
    video = write_y4m(workdir / "camera.y4m", seconds=4.0, fps=10, scene_s=SCENE_S, size=SIZE)
    audio = write_speech_wav(workdir / "speech.wav", SENTENCES, pause_s=0.8)
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    base = f"http://127.0.0.1:{server.port}"
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start "
          "(the page, Chromium, Whisper and the model share them)", flush=True)
    try:  # the baseline first: a closed session's media threads may still be winding down after a run
        baseline = await python_baseline(f"ws://127.0.0.1:{server.port}", args.jpeg_seconds, args.warmup, audio)
        report("baseline, Python client, JPEG at 2 fps + PCM speech (no browser)", baseline)
        async with Browser(*media_flags(video, audio)) as page:
            webm = await browser_phase(base, page, "webm", args.seconds, args.warmup)
            report("page, WebM camera + PCM microphone", webm)
            jpeg = await browser_phase(base, page, "jpeg", args.jpeg_seconds, args.warmup)
            report("page, JPEG camera at 2 fps + PCM microphone", jpeg)
        await asyncio.sleep(2.0)  # the closed sessions' last media work drains before the engine stops
    finally:
        await server.stop()
        engine.stop()
    print(f"RESULT glass_to_cache_p50_s={webm['p50']:.3f} glass_to_cache_p99_s={webm['p99']:.3f} "
          f"bytes_per_s={webm['video_bps'] + webm['audio_bps']:.0f} jpeg_p50_s={jpeg['p50']:.3f} "
          f"jpeg_bytes_per_s={jpeg['video_bps'] + jpeg['audio_bps']:.0f} baseline_p50_s={baseline['p50']:.3f} "
          f"webm_vs_baseline_p50={webm['p50'] / baseline['p50']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="measured seconds of WebM camera + microphone")
    parser.add_argument("--jpeg-seconds", type=float, default=20.0, help="measured seconds of the JPEG and baseline runs")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds excluded at the start of each run")
    parser.add_argument("--model", default="embedded", help="embedded (default) or tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
