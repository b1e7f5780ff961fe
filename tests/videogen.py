"""Generated test media: videos with known scene cuts, encoded with PyAV (no files needed)."""

from __future__ import annotations

import io

import numpy as np

# (start second, colour RGB) of each scene; each scene moves a bright square so frames differ.
SCENES = [(0.0, (200, 30, 30)), (2.0, (30, 60, 200)), (4.0, (40, 170, 60))]


def picture(seed: int, height: int, width: int) -> np.ndarray:
    """A frame with structure (gradients, a block) plus noise, so patches differ."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    np.full_like(x, 40 * seed % 256)], -1).astype(np.int16)
    img[height // 4: height // 2, width // 3: width // 2] = rng.integers(0, 256, 3)
    img += rng.integers(-20, 21, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def scene_frame(t: float, scenes=SCENES, size=(96, 128)) -> np.ndarray:
    h, w = size
    colour = [c for start, c in scenes if start <= t + 1e-9][-1]
    img = np.empty((h, w, 3), np.uint8)
    img[:] = colour
    x = int((t * 40) % (w - 16))
    img[h // 2 - 8:h // 2 + 8, x:x + 16] = 255
    return img


CODECS = {"mp4": ("mp4", "libx264", {"movflags": "frag_keyframe+empty_moov+default_base_moof"}),
          "webm": ("webm", "libvpx", {}), "mpegts": ("mpegts", "mpeg2video", {})}


def encode_video(fmt: str = "mp4", seconds: float = 6.0, fps: int = 10, scenes=SCENES, size=(96, 128)) -> bytes:
    """A video in `fmt` (mp4 fragmented, webm, mpegts) with the given scenes."""
    import av

    container_fmt, codec, options = CODECS[fmt]
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_fmt, options=options) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = size[1], size[0]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"preset": "ultrafast", "tune": "zerolatency"}
        stream.gop_size = fps
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_ndarray(scene_frame(i / fps, scenes, size), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def encode_image(fmt: str, image: np.ndarray) -> bytes:
    import av

    codec = {"jpeg": "mjpeg", "png": "png"}[fmt]
    ctx = av.CodecContext.create(codec, "w")
    ctx.width, ctx.height = image.shape[1], image.shape[0]
    ctx.pix_fmt = "yuvj420p" if codec == "mjpeg" else "rgb24"
    ctx.time_base = __import__("fractions").Fraction(1, 1)
    frame = av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format=ctx.pix_fmt)
    return b"".join(bytes(p) for p in ctx.encode(frame) + ctx.encode(None))


def encode_audio_only(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """An MPEG-TS stream with one MP2 audio track and no video."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mpegts") as out:
        stream = out.add_stream("mp2", rate=rate, layout="mono")
        t = np.arange(int(seconds * rate)) / rate
        samples = (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()
