"""Video sessions on the engine (tiny-vl: a seeded random Qwen2.5-VL) and the describer's live pacing.

Measured in one process:
  - batched vs serial: N sessions (1, 4, 16) each take F frames into their reading caches
    through the engine's job path (`append_frame`: a prefill of vision embeddings). Batched:
    one frame per session is queued, then the engine runs (their prefills share steps); serial:
    one session at a time, one frame at a time. Frames/s counts the engine's part (the frames'
    vision-tower embeddings are computed once beforehand; that cost is per frame either way and
    is printed on its own). Then at 16 sessions again with the vision tower inside the frame
    job, as the media path runs it (frames handed over patched; the engine runs the tower once
    per step for every session's frame).
  - live at 2 fps: the engine thread serves N sessions; each session's camera thread captures a
    frame every 0.5 s, patches it and hands it to the engine, whose frame job runs the vision
    tower (newest frame wins: a camera whose previous frame is not in yet drops the new one). Each session has a
    flash question. Lag: capture -> frame in the cache (p50/p99); flash staleness: frame
    in the cache -> the flash answer over it evaluated (p50).
  - the describer path with `--realtime` (bench/video_pacing.py's measurement: the real CLI
    streaming a 10 s clip with cuts at 4 and 7 s to a real server on the embedded model):
    frames dropped and cut-time error at 2 fps.

The weights are random and tiny: the numbers are the path's overhead (patching, vision tower,
prefill, batching), not a real model's cost.

Run: python bench/video.py [--frames 8] [--seconds 6] [--frame-tokens 64] [--threads 1] [--step-tokens 512]
     [--repeat 3] [--no-pacing]
The last line is `RESULT vl_batched16_vs_serial=<x> drop_2fps=<n> cut_error_s=<x> vl_flash_staleness_p50_s=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from streamer.app import load_tiny_vl  # noqa: E402
from streamer.sessions import jobs  # noqa: E402
from streamer.sessions.engine import Engine, EngineCore, EngineLimits  # noqa: E402
from streamer.sessions.multimodal import frame_input, frame_patches  # noqa: E402
from streamer.sessions.runner import ModelRunner  # noqa: E402


def picture(seed: int, height: int = 240, width: int = 320) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // (width - 1), y * 255 // (height - 1), np.full_like(x, 40 * seed % 256)], -1)
    img = img.astype(np.int16) + rng.integers(-20, 21, (height, width, 3))
    return img.clip(0, 255).astype(np.uint8)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def open_sessions(core: EngineCore, n: int) -> list[str]:
    sids = []
    for _ in range(n):
        out = core.create_session("You watch a video.", window=None)
        core.run_until_idle()
        sids.append((out if isinstance(out, dict) else out.result())["session_id"])
    return sids


def ingest_rate(runner: ModelRunner, sessions: int, frames: list, batched: bool, step_tokens: int = 512) -> float:
    """Frames/s through the engine for `sessions` sessions taking `frames` each. Frames without
    embeddings (`frame_patches`) get the vision tower in their job: each session its own copy."""
    core = EngineCore(runner, EngineLimits(kv_budget_bytes=256 << 20, step_tokens=step_tokens))
    sids = open_sessions(core, sessions)
    own = {(sid, k): replace(f) if f.embeds is None else f for sid in sids for k, f in enumerate(frames)}
    started = time.perf_counter()
    if batched:
        for k in range(len(frames)):
            for sid in sids:
                jobs.append_frame(core, sid, own[sid, k], "frame")
            core.run_until_idle()
    else:
        for sid in sids:
            for k in range(len(frames)):
                jobs.append_frame(core, sid, own[sid, k], "frame")
                core.run_until_idle()
    elapsed = time.perf_counter() - started
    for sid in sids:
        core.close_session(sid)
    return sessions * len(frames) / elapsed


def live(runner: ModelRunner, sessions: int, seconds: float, frame_tokens: int, fps: float = 2.0) -> dict:
    """N cameras at `fps` into N sessions on the engine thread, each with a flash question."""
    engine = Engine(runner, EngineLimits(kv_budget_bytes=256 << 20)).start()
    try:
        sids = [engine.create_session("You watch a video.", window=None).result(60)["session_id"]
                for _ in range(sessions)]
        in_cache: dict[tuple[str, int], float] = {}  # (session, data_version) -> when the frame was in
        staleness: list[float] = []
        lags: list[float] = []
        dropped, captures = [0], [0]
        lock = threading.Lock()

        def on_flash(sid: str):
            def listener(event: str, payload: dict) -> None:
                if event in ("flash.updated", "flash.evaluated"):
                    at = in_cache.get((sid, payload["data_version"]))
                    if at is not None:
                        with lock:
                            staleness.append(time.time() - at)
            return listener

        for sid in sids:
            engine.add_listener(sid, on_flash(sid)).result(10)
            engine.register_flash(sid, "What is in view?", max_tokens=4).result(10)

        def camera(k: int, sid: str) -> None:
            busy = threading.Event()
            t0 = time.time()
            n = 0
            while time.time() - t0 < seconds:
                due = t0 + n / fps
                time.sleep(max(0.0, due - time.time()))
                captured = time.time()
                n += 1
                with lock:
                    captures[0] += 1
                if busy.is_set():
                    with lock:
                        dropped[0] += 1
                    continue
                busy.set()
                frame = frame_patches(runner.vl, picture(k * 1000 + n), frame_tokens,
                                      runner.tokenize(f"[{n / fps:.1f}s] "), n / fps)

                def done(f, captured=captured) -> None:
                    if f.exception() is None:
                        now = time.time()
                        in_cache[(sid, f.result().data_version)] = now
                        with lock:
                            lags.append(now - captured)
                    busy.clear()

                engine.append_frame(sid, frame, "frame").add_done_callback(done)

        threads = [threading.Thread(target=camera, args=(k, sid)) for k, sid in enumerate(sids)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(1.0)  # the last frames and their flash evaluations
        return {"lag_p50": pct(lags, 0.5), "lag_p99": pct(lags, 0.99), "staleness_p50": pct(staleness, 0.5),
                "frames": len(lags), "captured": captures[0], "dropped": dropped[0]}
    finally:
        engine.stop()


def log_size_per_minute(frame_tokens: int, fps: float = 2.0) -> tuple[float, float]:
    """MB per minute of video the event log's frame blobs take at `fps` (records are ~300 B
    more each): for flat synthetic scenes and for camera-like pictures (gradients plus noise)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from videogen import SCENES, scene_frame

    from streamer.sessions.multimodal import frame_blob
    from streamer.vision.vlm_patches import fit_frame

    flat = [len(frame_blob(fit_frame(scene_frame(k * 0.5, SCENES, (480, 640)), frame_tokens))) for k in range(12)]
    noisy = [len(frame_blob(fit_frame(picture(k, 480, 640), frame_tokens))) for k in range(12)]
    per_minute = 60 * fps / 1e6
    return sum(flat) / len(flat) * per_minute, sum(noisy) / len(noisy) * per_minute


def pacing() -> tuple[int, float]:
    """bench/video_pacing.py's `--realtime` 2 fps run of the describer path: (dropped, cut error)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import video_pacing

    from streamer.app import build_engine

    engine = build_engine("embedded", threads=1)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "clip.mp4"
            video_pacing.write_clip(path, 10.0, [4.0, 7.0])
            r = asyncio.run(video_pacing.stream(engine, path, 2.0, True))
    finally:
        engine.stop()
    return r["video"]["dropped"], video_pacing.cut_error([4.0, 7.0], r["cuts"], 10.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=8, help="frames per session, batched vs serial")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each live run")
    parser.add_argument("--frame-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--step-tokens", type=int, default=512, help="engine step budget (default: the engine's)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each rate measurement; the best counts")
    parser.add_argument("--no-pacing", action="store_true", help="skip the describer's pacing run")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_tiny_vl()
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.name)
    started = time.perf_counter()
    frames = [frame_input(runner.vl, picture(k), args.frame_tokens, runner.tokenize(f"[{k / 2:.1f}s] "), k / 2)
              for k in range(args.frames)]
    tower_ms = (time.perf_counter() - started) / len(frames) * 1000
    print(f"tiny-vl ({loaded.name}), {frames[0].visual_tokens} visual tokens per frame "
          f"({len(frames[0].ids)} tokens with label and markers); patching + vision tower {tower_ms:.1f} ms per frame; "
          f"step budget {args.step_tokens} tokens; best of {args.repeat}")
    ratio16 = float("nan")
    for n in (1, 4, 16):
        serial = max(ingest_rate(runner, n, frames, False, args.step_tokens) for _ in range(args.repeat))
        batched = max(ingest_rate(runner, n, frames, True, args.step_tokens) for _ in range(args.repeat))
        print(f"  {n:2d} sessions: {batched:7.1f} frames/s batched, {serial:7.1f} one at a time "
              f"({batched / serial:.2f}x)")
        if n == 16:
            ratio16 = batched / serial
    patched = [frame_patches(runner.vl, picture(k), args.frame_tokens, runner.tokenize(f"[{k / 2:.1f}s] "), k / 2)
               for k in range(args.frames)]
    serial = max(ingest_rate(runner, 16, patched, False, args.step_tokens) for _ in range(args.repeat))
    batched = max(ingest_rate(runner, 16, patched, True, args.step_tokens) for _ in range(args.repeat))
    print(f"  16 sessions, vision tower in the frame job: {batched:7.1f} frames/s batched, {serial:7.1f} one at a "
          f"time ({batched / serial:.2f}x)")
    staleness16 = float("nan")
    for n in (1, 4, 16):
        r = live(runner, n, args.seconds, args.frame_tokens)
        print(f"  live 2 fps, {n:2d} sessions: {r['frames']}/{r['captured']} frames in (dropped {r['dropped']}), "
              f"capture -> cache p50 {r['lag_p50'] * 1000:.0f} ms p99 {r['lag_p99'] * 1000:.0f} ms, "
              f"flash staleness p50 {r['staleness_p50'] * 1000:.0f} ms")
        if n == 16:
            staleness16 = r["staleness_p50"]
    for tokens in (64, 256):
        flat, noisy = log_size_per_minute(tokens)
        print(f"  event log at 2 fps, {tokens} visual tokens per frame: {flat:.1f} MB/min (flat synthetic scenes), "
              f"{noisy:.1f} MB/min (camera-like noise)")
    drop, cut = (-1, float("nan")) if args.no_pacing else pacing()
    if not args.no_pacing:
        print(f"  describer --realtime 2 fps (bench/video_pacing.py): dropped {drop}, cut error {cut:.2f} s")
    print(f"RESULT vl_batched16_vs_serial={ratio16:.2f} drop_2fps={drop} cut_error_s={cut:.3f} "
          f"vl_flash_staleness_p50_s={staleness16:.3f}")


if __name__ == "__main__":
    main()
