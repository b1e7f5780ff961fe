"""The embedded default vision encoder: frames -> timestamped text observations.

No weights, no guessing: it reports what simple frame statistics show and nothing else
(scene cuts, how much moves, the dominant colours, how bright the picture is). It never names
objects or people, and its first line says so, so the text model (and whoever reads its
answers) knows the limits of what it was told.

A line is written for the first frame, at every scene cut, when the description changes,
and at least every `heartbeat_s` of media time; quiet frames in between cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .encoder import Frame, Observation, VisionEncoder
from .errors import MediaTooLarge
from .video import thumbnail

# Named colours by hue (degrees, upper bound) for saturated pixels; greys by lightness.
HUES = [(15, "red"), (40, "orange"), (70, "yellow"), (160, "green"), (200, "cyan"), (255, "blue"),
        (290, "purple"), (335, "pink"), (360, "red")]
MOTION = [(1.0, "none"), (4.0, "low"), (12.0, "moderate"), (float("inf"), "high")]
BRIGHTNESS = [(50, "dark"), (100, "dim"), (160, "moderate"), (256, "bright")]


@dataclass(slots=True)
class DescriberConfig:
    """Thresholds of the frame describer, with their defaults."""

    cut_threshold: float = 0.45  # colour-histogram distance (0..1) that counts as a scene cut
    heartbeat_s: float = 10.0  # write a line at least this often (media time) while frames come
    min_colour_share: float = 0.08  # colours below this share of the picture are not named
    max_colours: int = 3
    max_side: int = 1024  # frames larger than this on a side are refused (the decoder scales down first)


@dataclass(slots=True)
class FrameStats:
    pts: float
    brightness: float  # mean luma, 0..255
    colours: list[tuple[str, float]]  # (name, share), largest first
    histogram: np.ndarray  # 64-bin RGB histogram, sums to 1
    thumb: np.ndarray


def colour_names(image: np.ndarray) -> np.ndarray:
    """Per-pixel colour name index into `PALETTE` (HSV rules; greys by value)."""
    rgb = image.reshape(-1, 3).astype(np.float32) / 255.0
    mx, mn = rgb.max(axis=1), rgb.min(axis=1)
    delta = mx - mn
    r, g, b = rgb[:, 0], rgb[:, 1], rgb[:, 2]
    safe = np.where(delta == 0, 1.0, delta)
    hue = np.where(mx == r, ((g - b) / safe) % 6, np.where(mx == g, (b - r) / safe + 2, (r - g) / safe + 4)) * 60.0
    sat = np.where(mx == 0, 0.0, delta / np.where(mx == 0, 1.0, mx))
    names = np.searchsorted(np.array([h for h, _ in HUES]), hue, side="left")
    grey = (sat < 0.25) | (mx < 0.15)
    out = np.where(grey, len(HUES) + np.digitize(mx, [0.2, 0.75]), names)  # black, grey, white
    brownish = ~grey & (names <= 1) & (mx < 0.55)
    return np.where(brownish, len(HUES) + 3, out)


PALETTE = [name for _, name in HUES] + ["black", "grey", "white", "brown"]


def frame_stats(frame: Frame, config: DescriberConfig) -> FrameStats:
    image = frame.image
    luma = image[..., 0] * 0.299 + image[..., 1] * 0.587 + image[..., 2] * 0.114
    counts = np.bincount(colour_names(image), minlength=len(PALETTE)).astype(np.float64)
    shares: dict[str, float] = {}
    for i, c in enumerate(counts):
        shares[PALETTE[i]] = shares.get(PALETTE[i], 0.0) + c / counts.sum()
    colours = sorted(((n, s) for n, s in shares.items() if s >= config.min_colour_share), key=lambda x: -x[1])
    q = (image // 64).reshape(-1, 3).astype(np.int64)
    hist = np.bincount(q[:, 0] * 16 + q[:, 1] * 4 + q[:, 2], minlength=64).astype(np.float64)
    return FrameStats(frame.pts, float(luma.mean()), colours[: config.max_colours], hist / hist.sum(),
                      thumbnail(image, 24))


def _level(value: float, table) -> str:
    return next(name for bound, name in table if value < bound)


class FrameDescriber(VisionEncoder):
    """Frames -> text lines such as
    `[video 4.0s] scene cut; colours: green 85%, white 3%; brightness moderate; motion low`."""

    name = "describer"
    appends_text = True

    def __init__(self, config: DescriberConfig | None = None, label: str = "video") -> None:
        self.config = config or DescriberConfig()
        self.label = label
        self._prev: FrameStats | None = None
        self._last_line_pts = -float("inf")
        self._last_key: tuple | None = None
        self.frames = 0
        self.lines = 0
        self.cuts = 0

    def encode(self, frames: Sequence[Frame]) -> list[Observation]:
        out = []
        for frame in frames:
            obs = self._one(frame)
            if obs is not None:
                out.append(obs)
        return out

    def _one(self, frame: Frame) -> Observation | None:
        side = self.config.max_side
        if frame.height > side or frame.width > side:
            raise MediaTooLarge(f"frame of {frame.width}x{frame.height} exceeds the describer's limit of "
                                f"{side} pixels a side")
        stats = frame_stats(frame, self.config)
        prev, self._prev = self._prev, stats
        self.frames += 1
        events: list[str] = []
        motion = None  # not measurable across a cut or on the first frame
        if prev is None:
            events.append("start")
        else:
            cut = 0.5 * float(np.abs(stats.histogram - prev.histogram).sum()) >= self.config.cut_threshold
            if cut:
                events.append("scene_cut")
                self.cuts += 1
            else:  # motion between two frames of the same scene, scaled to a half-second gap
                gap = max(stats.pts - prev.pts, 1e-3)
                diff = float(np.abs(stats.thumb - prev.thumb).mean()) * min(1.0, 0.5 / gap)
                motion = _level(diff, MOTION)
        colours = [(name, round(share * 100)) for name, share in stats.colours]
        brightness = _level(stats.brightness, BRIGHTNESS)
        key = (tuple(name for name, _ in colours), brightness, motion)
        due = frame.pts - self._last_line_pts >= self.config.heartbeat_s
        if not events and key == self._last_key and not due:
            return None
        if not events and key != self._last_key:
            events.append("change")
        self._last_key, self._last_line_pts = key, frame.pts
        self.lines += 1
        return Observation(frame.pts, frame.pts, frame.ts, self._line(frame, events, colours, brightness, motion),
                           frames=[frame.index], events=events)

    def _line(self, frame: Frame, events: list[str], colours, brightness: str, motion: str | None) -> str:
        what = ", ".join(f"{name} {share}%" for name, share in colours) or "mixed"
        lead = ""
        if "start" in events:  # a picture is not a video: say which one this is
            lead = (f"{'a picture' if frame.still else 'video starts'} (frame statistics only: colours, brightness, "
                    "motion; no object recognition); ")
        elif "scene_cut" in events:
            lead = "scene cut; "
        moving = f"; motion {motion}" if motion is not None else ""
        label = "image" if frame.still else self.label
        return f"[{label} {frame.pts:.1f}s] {lead}colours: {what}; brightness {brightness}{moving}.\n"

    def state(self) -> dict:
        return {"encoder": self.name, "frames": self.frames, "lines": self.lines, "scene_cuts": self.cuts}
