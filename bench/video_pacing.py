"""Live pacing of the describer path: does `streamer client media clip.mp4 --realtime` keep every
sampled frame, and are scene cuts reported at their media time?

A 10 s clip (25 fps, x264 defaults: B-frames; keyframes at the start and at the cuts, as an
encoder puts them, or with --one-keyframe only at the start) with cuts at 4.0 s and 7.0 s,
written as an ordinary MP4, is streamed through the real CLI (in this process) to a
real websocket server on the embedded model (SmolLM2 + the frame describer), three ways side by
side: as fast as the server takes it (the baseline: nothing may drop there), and paced by media
time (`--realtime`) with the server sampling at 2 and at 10 frames per second of media time.
For each it prints frames decoded, sampled, dropped (newest frame wins), the reported cut times
and the cut-time error: the largest distance between a true cut and the nearest reported one
(a missed cut counts as the clip's length). The target: 0 dropped at 2 fps and an error within
one sample interval (0.5 s).

Run: python bench/video_pacing.py [--seconds 10] [--cuts 4,7] [--threads 1] [--one-keyframe]
The last line is `RESULT drop_2fps=<n> drop_10fps=<n> cut_error_s=<x>` (the error at 2 fps).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import streamer.cli  # noqa: E402  (before tests/ joins the path: tests/streamer must not shadow it)
from streamer.media import MediaConfig  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.vision.ingest import VideoConfig  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1] / "tests"))

from videogen import scene_frame  # noqa: E402

COLOURS = [(200, 30, 30), (30, 60, 200), (40, 170, 60), (220, 200, 40), (150, 40, 160)]


def write_clip(path: Path, seconds: float, cuts: list[float], fps: int = 25, keyframes_at_cuts: bool = True) -> None:
    """x264's defaults (B-frames); a keyframe at the start and, as a camera's or an editor's
    encoder puts them, at each cut (`keyframes_at_cuts`; else the start's only)."""
    import av
    from av.video.frame import PictureType

    scenes = [(start, COLOURS[i % len(COLOURS)]) for i, start in enumerate([0.0, *cuts])]
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(scene_frame(i / fps, scenes), format="rgb24")
            frame.pts = i
            if keyframes_at_cuts and any(abs(i / fps - c) < 0.5 / fps for c in cuts):
                frame.pict_type = PictureType.I
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)


def run_cli(url: str, path: Path, realtime: bool) -> list[dict]:
    out = io.StringIO()
    argv = ["client", "media", str(path), "--url", url, "--json", *(["--realtime"] if realtime else [])]
    with redirect_stdout(out):
        rc = streamer.cli.main(argv)
    if rc != 0:
        raise SystemExit(f"the CLI exited with {rc}")
    return [json.loads(line) for line in out.getvalue().splitlines() if line.startswith("{")]


async def stream(engine, path: Path, sample_fps: float, realtime: bool) -> dict:
    media = MediaConfig(video=VideoConfig(sample_fps=sample_fps))
    server = await StreamerServer(engine, ServerConfig(port=0, media=media)).start()
    try:
        url = f"ws://127.0.0.1:{server.port}"
        events = await asyncio.get_running_loop().run_in_executor(None, run_cli, url, path, realtime)
    finally:
        await server.stop()
    video = next(e for e in events if e["event"] == "done")["media"]["video"]
    observations = [e for e in events if e["event"] == "observation"]
    cuts = [e["start_s"] for e in observations if "scene_cut" in (e["events"] or [])]
    lags = sorted(e["lag_ms"] for e in observations if e.get("lag_ms") is not None)
    return {"video": video, "cuts": cuts, "lag_p50_ms": lags[len(lags) // 2] if lags else float("nan")}


def cut_error(true_cuts: list[float], reported: list[float], seconds: float) -> float:
    return max((min((abs(r - t) for r in reported), default=seconds) for t in true_cuts), default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cuts", default="4,7", help="scene cut times in seconds (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--one-keyframe", action="store_true", help="no keyframes at the cuts: one at the start")
    args = parser.parse_args()
    cuts = [float(c) for c in args.cuts.split(",") if c]

    from streamer.app import build_engine

    engine = build_engine("embedded", threads=args.threads)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        write_clip(path, args.seconds, cuts, keyframes_at_cuts=not args.one_keyframe)
        try:
            for name, fps, realtime in (("as fast as taken, 2 fps", 2.0, False), ("--realtime, 2 fps", 2.0, True),
                                        ("--realtime, 10 fps", 10.0, True)):
                runs[name] = r = asyncio.run(stream(engine, path, fps, realtime))
                r["error"] = cut_error(cuts, r["cuts"], args.seconds)
        finally:
            engine.stop()
    keys = "one keyframe" if args.one_keyframe else "keyframes at the start and the cuts"
    print(f"clip: {args.seconds:.0f} s, 128x96 at 25 fps (x264 defaults, {keys}), cuts at "
          f"{', '.join(f'{c:.1f}' for c in cuts)} s; embedded SmolLM2 + frame describer over a real websocket")
    for name, r in runs.items():
        v = r["video"]
        print(f"  {name:24s} decoded {v['decoded']:4d}  sampled {v['sampled']:3d}  dropped {v['dropped']:3d}  "
              f"duplicates {v['duplicates']:3d}  cuts at {r['cuts']}  cut error {r['error']:.2f} s"
              + (f"  capture -> cache p50 {r['lag_p50_ms']:.0f} ms" if "realtime" in name else ""))
    base, live2, live10 = runs.values()
    print(f"  --realtime 2 fps vs as fast as taken: dropped {live2['video']['dropped']} vs {base['video']['dropped']}, "
          f"cut error {live2['error']:.2f} s vs {base['error']:.2f} s (target: 0 dropped, <= 0.5 s)")
    print(f"RESULT drop_2fps={live2['video']['dropped']} drop_10fps={live10['video']['dropped']} "
          f"cut_error_s={live2['error']:.3f}")


if __name__ == "__main__":
    main()
