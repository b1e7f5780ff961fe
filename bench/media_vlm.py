"""The Qwen2.5-VL path on a tiny seeded random-weight model: how fast a session ingests frames.

Measured side by side in one process:
  - incremental: each frame is resized to its visual-token budget, encoded by the vision tower
    and prefilled onto the stream's bounded cache (sinks + recent frames + text window), as
    `VLMStream` does for a live session;
  - stateless: per frame, one stock forward over what the same window holds (the sink text and
    the frames still in the vision window, every frame re-encoded), which is what a
    request-driven engine pays to look at the same context;
  - lag: frames captured in real time at 2 and 10 fps go through a newest-frame-wins slot to
    an encoder thread; lag is capture timestamp -> frame in the cache, dropped frames counted.

The weights are random and tiny, so these numbers are the path's overhead (resize, patching,
vision tower, prefill, eviction and re-anchoring), not a real model's cost.

Run: python bench/media_vlm.py [--frames 40] [--frame-tokens 64] [--seconds 6]
The last line is `RESULT vlm_fps=<x> lag_2fps_s=<x> lag_10fps_s=<x> speedup_vs_stateless=<x>`.
bench/media.py imports `measure_vlm_fps()`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from streamer.vision.encoder import Frame  # noqa: E402
from streamer.vision.video import LatestSlot  # noqa: E402
from streamer.vision.vlm import (  # noqa: E402
    QwenVLEncoder,
    TinyVLMConfig,
    VLMStream,
    Window,
    build_tiny_vlm,
    patchify,
)

SINK = list(range(1, 17))  # a 16-token "system prompt" held as attention sinks


def synthetic_frames(count: int, height: int = 240, width: int = 320, seed: int = 0) -> list[np.ndarray]:
    """A moving gradient with a bright square: every frame differs."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for i in range(count):
        img = np.stack([(x + 7 * i) % 256, (y + 3 * i) % 256, np.full_like(x, (11 * i) % 256)], -1)
        top, left = (5 * i) % (height - 40), (9 * i) % (width - 40)
        img[top:top + 40, left:left + 40] = rng.integers(0, 256, 3)
        out.append(img.astype(np.uint8))
    return out


def _window(frame_tokens: int) -> Window:
    return Window(sink_tokens=len(SINK), vision_tokens=8 * (frame_tokens + 2), text_tokens=256)


def incremental_fps(model, frames: list[np.ndarray], frame_tokens: int) -> tuple[float, VLMStream]:
    stream = VLMStream(model, frame_tokens=frame_tokens, window=_window(frame_tokens))
    stream.append_tokens(SINK)
    for img in frames[:3]:  # warm-up
        stream.append_image(img)
    started = time.perf_counter()
    for img in frames:
        stream.append_image(img)
    return len(frames) / (time.perf_counter() - started), stream


def stateless_fps(ref, frames: list[np.ndarray], frame_tokens: int, held: int) -> float:
    """Per frame, one stock forward over the sink text and the last `held` frames."""
    cfg = ref.config
    patched = [patchify(img, frame_tokens) for img in frames]
    started = time.perf_counter()
    with torch.no_grad():
        for i in range(len(frames)):
            window = patched[max(0, i - held + 1): i + 1]
            ids = list(SINK)
            for _, grid in window:
                ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (grid[1] * grid[2] // 4)
                ids += [cfg.vision_end_token_id]
            input_ids = torch.tensor([ids])
            ref(input_ids=input_ids, pixel_values=torch.cat([p for p, _ in window]),
                image_grid_thw=torch.tensor([g for _, g in window]),
                mm_token_type_ids=(input_ids == cfg.image_token_id).int(), logits_to_keep=1)
    return len(frames) / (time.perf_counter() - started)


def realtime_lag(model, frames: list[np.ndarray], frame_tokens: int, fps: float, seconds: float) -> dict:
    """Frames captured at `fps` for `seconds`, newest frame wins, one encoder thread."""
    stream = VLMStream(model, frame_tokens=frame_tokens, window=_window(frame_tokens))
    stream.append_tokens(SINK)
    encoder = QwenVLEncoder(stream)
    slot = LatestSlot()
    lags: list[float] = []

    def encode_loop() -> None:
        while (frame := slot.get()) is not None:
            encoder.encode([frame])
            lags.append(time.monotonic() - frame.ts)

    worker = threading.Thread(target=encode_loop, name="bench-vlm-encoder")
    worker.start()
    t0 = time.monotonic()
    offered = int(seconds * fps)
    for i in range(offered):
        time.sleep(max(0.0, t0 + i / fps - time.monotonic()))
        slot.put(Frame(frames[i % len(frames)], pts=i / fps, ts=time.monotonic(), index=i))
    slot.close()
    worker.join()
    return {"offered": offered, "encoded": len(lags), "dropped": slot.dropped,
            "lag_median_s": statistics.median(lags), "lag_max_s": max(lags)}


def measure_vlm_fps(frames: int = 40, frame_tokens: int = 64, seconds: float = 6.0,
                    threads: int | None = 1, seed: int = 0) -> dict:
    """Frames per second the tiny-VLM path ingests, side by side with stateless re-reading of
    the same window, and the capture -> cache lag at 2 and 10 fps input. `threads` sets
    torch's intra-op threads for the run (restored after): one is fastest for a model this
    small. Returns plain numbers (see the keys)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        config = TinyVLMConfig(seed=seed, max_positions=4096)
        model, ref = build_tiny_vlm(config), build_tiny_vlm(config)
        images = synthetic_frames(frames, seed=seed)
        fps, stream = incremental_fps(model, images, frame_tokens)
        held = sum(1 for s in stream.spans if s.kind == "frame" and not s.pinned)
        base = stateless_fps(ref, images, frame_tokens, held)
        lag2 = realtime_lag(model, images, frame_tokens, 2.0, seconds)
        lag10 = realtime_lag(model, images, frame_tokens, 10.0, seconds)
    finally:
        torch.set_num_threads(previous)
    return {
        "vlm_fps": fps, "stateless_fps": base, "speedup_vs_stateless": fps / base,
        "tokens_per_frame": stream.stats.visual_tokens / stream.stats.frames,
        "frames_in_window": held, "cache_tokens": stream.cache.length, "cache_bound": stream.bound,
        "max_position": stream.stats.max_position,
        "lag_2fps_s": lag2["lag_median_s"], "lag_2fps_max_s": lag2["lag_max_s"], "dropped_2fps": lag2["dropped"],
        "lag_10fps_s": lag10["lag_median_s"], "lag_10fps_max_s": lag10["lag_max_s"],
        "dropped_10fps": lag10["dropped"], "offered_10fps": lag10["offered"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--frames", type=int, default=40)
    parser.add_argument("--frame-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    r = measure_vlm_fps(args.frames, args.frame_tokens, args.seconds, args.threads or None)
    print(f"tiny Qwen2.5-VL, 320x240 frames at {r['tokens_per_frame']:.0f} visual tokens each, "
          f"window of {r['frames_in_window']} frames ({r['cache_tokens']}/{r['cache_bound']} cache tokens, "
          f"max position {r['max_position']})")
    print(f"incremental  {r['vlm_fps']:8.1f} frames/s")
    print(f"stateless    {r['stateless_fps']:8.1f} frames/s   (re-reading the window per frame)")
    print(f"ratio        {r['speedup_vs_stateless']:8.2f}x")
    print(f"2 fps input:  lag median {r['lag_2fps_s'] * 1000:.1f} ms, max {r['lag_2fps_max_s'] * 1000:.1f} ms, "
          f"dropped {r['dropped_2fps']}")
    print(f"10 fps input: lag median {r['lag_10fps_s'] * 1000:.1f} ms, max {r['lag_10fps_max_s'] * 1000:.1f} ms, "
          f"dropped {r['dropped_10fps']} of {r['offered_10fps']}")
    print(f"RESULT vlm_fps={r['vlm_fps']:.2f} lag_2fps_s={r['lag_2fps_s']:.4f} lag_10fps_s={r['lag_10fps_s']:.4f} "
          f"speedup_vs_stateless={r['speedup_vs_stateless']:.2f}")


if __name__ == "__main__":
    main()
