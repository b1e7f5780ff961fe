"""Generated files for Chromium's fake camera and microphone (see browserutil.py): a Y4M video
with a scene change at every `scene_s` (a new solid colour, with a white square moving across
it so no two frames are equal) and a WAV of espeak-ng speech with pauses between sentences."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np

COLOURS = [(200, 30, 30), (30, 60, 200), (40, 170, 60), (230, 200, 40), (150, 40, 160), (40, 190, 200)]
SENTENCES = ["turn on the lights in the kitchen", "we need more coffee"]


def scene(t: float, scene_s: float, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    img = np.empty((h, w, 3), np.uint8)
    img[:] = COLOURS[int(t / scene_s + 1e-9) % len(COLOURS)]
    side = max(8, h // 8)
    x = int((t * w / 2) % (w - side))
    img[h // 2 - side // 2:h // 2 + side // 2, x:x + side] = 255
    return img


def yuv420(rgb: np.ndarray) -> bytes:
    """RGB uint8 [h, w, 3] -> planar Y, U, V (BT.601, full range, chroma averaged over 2x2)."""
    f = rgb.astype(np.float32)
    r, g, b = f[..., 0], f[..., 1], f[..., 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    u = -0.168736 * r - 0.331264 * g + 0.5 * b + 128
    v = 0.5 * r - 0.418688 * g - 0.081312 * b + 128
    sub = lambda p: p.reshape(p.shape[0] // 2, 2, p.shape[1] // 2, 2).mean(axis=(1, 3))  # noqa: E731
    planes = [y, sub(u), sub(v)]
    return b"".join(np.clip(p + 0.5, 0, 255).astype(np.uint8).tobytes() for p in planes)


def write_y4m(path: Path, seconds: float = 6.0, fps: int = 10, scene_s: float = 1.0,
              size: tuple[int, int] = (120, 160)) -> Path:
    h, w = size
    with open(path, "wb") as out:
        out.write(f"YUV4MPEG2 W{w} H{h} F{fps}:1 Ip A1:1 C420jpeg\n".encode())
        for i in range(int(seconds * fps)):
            out.write(b"FRAME\n" + yuv420(scene(i / fps, scene_s, size)))
    return path


def speech(text: str) -> tuple[np.ndarray, int]:
    """espeak-ng speech as int16 samples and their rate."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is missing: apt-get install espeak-ng (.ci/run installs it)")
    wav = subprocess.run(["espeak-ng", "-s", "130", "--stdout", text], check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").copy(), w.getframerate()


def write_speech_wav(path: Path, sentences=SENTENCES, pause_s: float = 1.2) -> Path:
    """Sentences with `pause_s` of silence before each and after the last, as a mono WAV."""
    parts, rate = [], 22050
    for text in sentences:
        samples, rate = speech(text)
        parts += [np.zeros(int(pause_s * rate), np.int16), samples]
    parts.append(np.zeros(int(pause_s * rate), np.int16))
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.concatenate(parts).tobytes())
    return path
