"""Incremental demux and decode of video that arrives in pieces, with PyAV.

A container (fragmented MP4, WebM, MPEG-TS) comes over the websocket in pieces of any size.
FFmpeg's demuxers pull bytes through a read callback, so each stream runs its demux/decode
loop in a thread of its own that reads from a `BytePipe`. The live path (`write`) puts a piece
in the pipe without waiting and hands each frame on from the decoder's thread as it decodes
it; the piece's `then` runs on that thread once the decoder has used every byte of it that it
could (it is blocked waiting for more, or finished). `feed()` pushes a piece and waits for that
moment instead (tests, benches, files). Either way the frames are a function of the bytes alone,
never of how they were cut: streaming a file in random-sized pieces yields exactly the frames of
the whole file.

Then `FrameSampler` keeps frames at a target rate and skips near-duplicates before they cost
cache. Single JPEG/PNG pictures decode without a container (`decode_image`).

PyAV is an optional dependency (the `media` extra): this module imports it lazily.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .encoder import Frame
from .errors import MediaDecodeError, MediaError, MediaTooLarge, UnsupportedMedia

# Wire format -> FFmpeg demuxer name.
CONTAINERS = {"mp4": "mp4", "webm": "matroska", "mpegts": "mpegts"}
# A stream that states no frame rate (browsers' MediaRecorder WebM; fragmented MP4, whose empty
# moov has no sample table) made FFmpeg's stream probe hold every frame back until it had
# estimated one (20 frames: about 4 s of a live camera, 0.8 s of a 25 fps file sent live), then
# let them out in a burst that newest-frame-wins dropped. Timestamps, not a rate, drive
# sampling here: skip that estimate for every container.
OPEN_OPTIONS = {fmt: {"fpsprobesize": "0"} for fmt in ("mp4", "webm", "mpegts")}
IMAGE_CODECS = {"jpeg": "mjpeg", "png": "png"}


def require_av():
    """Import PyAV, or raise UnsupportedMedia naming the extra to install."""
    try:
        import av
    except ImportError as exc:
        raise UnsupportedMedia("media input needs PyAV: install the 'media' extra "
                               "(pip install 'streamer[media]')") from exc
    return av


class Mp4Boxes:
    """Tracks top-level MP4 boxes in a byte stream (absolute offsets): how far the bytes may be
    handed to the demuxer. Boxes it parses (ftyp, moov, moof...) only when complete; media data
    (mdat) as it arrives, so frames decode while a fragment is still coming."""

    def __init__(self) -> None:
        self.scan = 0  # start of the next box not yet scanned
        self.mdat_end: int | None = None  # end of the mdat being delivered
        self.ready = 0  # bytes before this offset may be read
        self.off = False  # a box size the demuxer must judge itself: hand over everything

    def update(self, buf: bytearray, base: int) -> int:
        end = base + len(buf)
        while not self.off:
            if self.mdat_end is not None:
                if end < self.mdat_end:
                    self.ready = end
                    break
                self.scan = self.ready = self.mdat_end
                self.mdat_end = None
                continue
            i = self.scan - base
            if len(buf) - i < 8:
                break
            size, header = int.from_bytes(buf[i:i + 4], "big"), 8
            if size == 1:
                if len(buf) - i < 16:
                    break
                size, header = int.from_bytes(buf[i + 8:i + 16], "big"), 16
            if size < header:  # 0 (runs to the end of the file) or malformed
                self.off = True
                break
            if bytes(buf[i + 4:i + 8]) == b"mdat":
                self.mdat_end = self.scan + size
                continue
            if len(buf) - i < size:
                break
            self.scan = self.ready = self.scan + size
        return end if self.off else self.ready


class BytePipe:
    """Bytes in from `write`, out through a blocking `read` (the demuxer's read callback).

    `wait_drained()` returns once the reader has taken every byte it may have and is blocked for
    more (or has stopped reading for good), so the writer knows the decoder has caught up; a
    writer that must not block passes `then=` to `write` instead, and the reader's thread calls
    it at that same moment.

    With `whole_boxes` (MP4), boxes the demuxer parses are handed over only when complete:
    FFmpeg's MP4 demuxer on a non-seekable stream seeks back inside the atom it is parsing,
    which fails when an atom is split across two reads, and then reads nothing more. Media
    data (mdat) still flows as it arrives (see Mp4Boxes)."""

    def __init__(self, whole_boxes: bool = False) -> None:
        self._buf = bytearray()
        self._cond = threading.Condition()
        self._eof = False  # no more bytes will come
        self._hungry = False  # the reader is blocked waiting for bytes it may have
        self._stopped = False  # the reader will never read again
        self._boxes = Mp4Boxes() if whole_boxes else None
        self._ready = 0  # bytes at the front of _buf the reader may have
        self._base = 0  # stream offset of _buf[0]
        self._drained: list[Callable[[], None]] = []  # write callbacks: run when the reader is next hungry
        self._stops: list[Callable[[], None]] = []  # close_input callbacks: run when the reader stops
        self._calls: list[Callable[[], None]] = []  # work for the reader's thread (`call`)
        self.total = 0

    def _update_ready(self) -> None:
        if self._eof or self._boxes is None:
            self._ready = len(self._buf)
        else:
            self._ready = self._boxes.update(self._buf, self._base) - self._base

    def write(self, data: bytes, then: Callable[[], None] | None = None) -> None:
        """Add bytes. `then()`, if given, runs once the reader has used every byte it could
        (on the reader's thread, as it is about to block for more), or once it has stopped for
        good (at once, here, when it already has)."""
        with self._cond:
            if self._eof:
                raise MediaDecodeError("media stream already ended")
            self._buf += data
            self.total += len(data)
            self._update_ready()
            self._hungry = False
            now = then is not None and self._stopped
            if then is not None and not now:
                self._drained.append(then)
            self._cond.notify_all()
        if now:
            then()

    def close_input(self, then: Callable[[], None] | None = None) -> None:
        """No more bytes. `then()`, if given, runs once the reader has stopped for good."""
        with self._cond:
            self._eof = True
            self._update_ready()
            now = then is not None and self._stopped
            if then is not None and not now:
                self._stops.append(then)
            self._cond.notify_all()
        if now:
            then()

    def stop(self) -> None:
        """The reader is done (finished or failed): writers stop waiting on it, and what was
        handed to it with `call` runs now (here)."""
        with self._cond:
            self._stopped = True
            waiting = self._calls + self._drained + self._stops
            self._calls, self._drained, self._stops = [], [], []
            self._cond.notify_all()
        for then in waiting:
            then()

    def call(self, fn: Callable[[], None]) -> bool:
        """Have the reader's thread run `fn` at its next read (at once if it is waiting for
        bytes); False if the reader has stopped (then `fn` is not taken)."""
        with self._cond:
            if self._stopped:
                return False
            self._calls.append(fn)
            self._cond.notify_all()
            return True

    def read(self, n: int = -1) -> bytes:
        while True:
            with self._cond:
                calls, self._calls = self._calls, []
                if calls:
                    self._hungry = False  # busy with them, not waiting for bytes
            for fn in calls:  # outside the lock: work handed to this thread (see `call`)
                fn()
            with self._cond:
                if self._calls:
                    continue
                if self._ready or self._eof:
                    self._hungry = False
                    n = self._ready if n is None or n < 0 else min(n, self._ready)
                    out = bytes(self._buf[:n])
                    del self._buf[:n]
                    self._ready -= n
                    self._base += n
                    return out
                drained, self._drained = self._drained, []
                if not drained:
                    self._hungry = True
                    self._cond.notify_all()
                    self._cond.wait()
                    continue
            for then in drained:  # outside the lock: a callback may write the next piece
                then()

    @property
    def hungry(self) -> bool:
        """The reader is blocked waiting for bytes."""
        with self._cond:
            return self._hungry

    def wait_drained(self, timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._stopped or (self._hungry and not self._ready), timeout)


@dataclass(slots=True)
class DecodeLimits:
    """Limits of one decoded video stream, with their defaults."""

    max_pixels: int = 3840 * 2160  # a decoded picture above this is refused (media_too_large)
    max_side: int = 320  # frames are scaled down so their longer side is at most this
    stall_s: float = 30.0  # a decoder that neither asks for bytes nor ends within this has failed
    probe_bytes: int = 65536  # how much FFmpeg may read to identify the streams


class VideoDecoder:
    """One container byte stream -> frames, incrementally. Not thread-safe: one feeder.

    Two ways to use it: `feed()` pushes a piece and waits for the frames it completed; or, with
    `on_frame`, each frame goes to `on_frame(frame)` on the decoder's thread as it is decoded,
    and `write(piece, then)` / `end(then)` never wait: `then()` runs on the decoder's thread once
    the piece is used up (the piece's frames have all been handed on)."""

    def __init__(self, fmt: str, ts0: float = 0.0, limits: DecodeLimits | None = None,
                 on_frame: Callable[[Frame], None] | None = None) -> None:
        if fmt not in CONTAINERS:
            raise UnsupportedMedia(f"video container {fmt!r} is not supported ({', '.join(CONTAINERS)})")
        self.av = require_av()
        self.fmt = fmt
        self.ts0 = ts0  # capture time of the stream's first byte (sender's clock)
        self.limits = limits or DecodeLimits()
        self.pipe = BytePipe(whole_boxes=fmt == "mp4")
        self.decoded = 0
        self._out: list[Frame] = []
        self._lock = threading.Lock()
        self._error: MediaError | None = None
        self._pts0: float | None = None
        self._done = threading.Event()
        self.on_frame = on_frame
        self._progress = time.monotonic()  # when the decoder last asked for bytes or handed on a frame
        self._in_frame = False  # on_frame is running (it may wait on purpose: not a stall)
        self._thread = threading.Thread(target=self._run, name=f"demux-{fmt}", daemon=True)
        self._thread.start()

    # ---- feeder side ---------------------------------------------------------------------

    def feed(self, data: bytes) -> list[Frame]:
        """Push a piece; return the frames it completed (in order). Frames decoded before a
        failure are returned; the failure is raised by `check()` (and by the next feed)."""
        self.check()
        self.pipe.write(data)
        if not self.pipe.wait_drained(self.limits.stall_s):
            self.close()
            self._error = MediaDecodeError(f"the {self.fmt} decoder stalled for {self.limits.stall_s:.0f} s")
        return self._take()

    def write(self, data: bytes, then: Callable[[], None]) -> None:
        """Push a piece without waiting; `then()` runs once the decoder has used it (see the
        class); a failure is raised by `check()` then."""
        self._progress = time.monotonic()
        self.pipe.write(data, then)

    def end(self, data: bytes, then: Callable[[], None]) -> None:
        """Push the last piece and end the stream without waiting; `then()` runs once the
        decoder has finished (its last frames handed on)."""
        self._progress = time.monotonic()
        if data:
            self.pipe.write(data)
        self.pipe.close_input(then)

    def call(self, fn: Callable[[], None]) -> bool:
        """Run `fn` on the decoder's thread, between two reads; False if it has stopped."""
        return self.pipe.call(fn)

    def stalled(self) -> bool:
        """The decoder neither asked for bytes nor handed on a frame for `stall_s`, and has not
        finished."""
        return (not self._done.is_set() and not self._in_frame and not self.pipe.hungry
                and time.monotonic() - self._progress > self.limits.stall_s)

    def watch(self, settled: Callable[[], bool], later: Callable[[float, Callable[[], None]], None]) -> None:
        """Look at the decoder every `stall_s` (through `later(seconds, fn)`) until `settled()`:
        a stalled one fails (`fail`), so the piece waiting on it gets an error."""
        def look() -> None:
            if settled():
                return
            if self.stalled():
                self.fail(MediaDecodeError(f"the {self.fmt} decoder stalled for {self.limits.stall_s:.0f} s"))
            else:
                later(self.limits.stall_s, look)

        later(self.limits.stall_s, look)

    def fail(self, exc: MediaError) -> None:
        """Give up on a stalled decoder: its pending `then` callbacks run now, and see `exc`."""
        self._error = exc
        self.pipe.close_input()
        self.pipe.stop()

    def finish(self) -> list[Frame]:
        """No more bytes: flush the decoder; return the last frames (then `check()`)."""
        self.pipe.close_input()
        if not self._done.wait(self.limits.stall_s):
            self._error = MediaDecodeError(f"the {self.fmt} decoder did not finish in {self.limits.stall_s:.0f} s")
        return self._take()

    def check(self) -> None:
        """Raise the stream's failure, if it failed."""
        if self._error is not None:
            raise self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def close(self) -> None:
        self.pipe.close_input()

    def _take(self) -> list[Frame]:
        with self._lock:
            out, self._out = self._out, []
        return out

    # ---- decoder thread ------------------------------------------------------------------

    def _run(self) -> None:
        av = self.av
        try:
            container = av.open(self.pipe, mode="r", format=CONTAINERS[self.fmt],
                                options={"probesize": str(self.limits.probe_bytes), **OPEN_OPTIONS.get(self.fmt, {})})
            try:
                if not container.streams:
                    raise MediaDecodeError(f"the {self.fmt} stream ended before any track was found "
                                           f"({self.pipe.total} bytes: truncated?)")
                if not container.streams.video:
                    kinds = ", ".join(sorted({s.type for s in container.streams}))
                    raise UnsupportedMedia(f"the {self.fmt} stream has no video track (only: {kinds})")
                stream = container.streams.video[0]
                stream.thread_type = "SLICE"
                stream.codec_context.thread_count = 1
                for packet in container.demux(stream):
                    for frame in packet.decode():
                        self._emit(frame)
            finally:
                container.close()
        except MediaError as exc:
            self._error = exc
        except av.error.DecoderNotFoundError as exc:
            self._error = UnsupportedMedia(f"no decoder for the codec in this {self.fmt} stream: {exc}")
        except (av.error.FFmpegError, ValueError, OSError, EOFError) as exc:
            what = "truncated or corrupt" if self.decoded == 0 else "corrupt after frame " + str(self.decoded)
            self._error = MediaDecodeError(f"{self.fmt} stream {what}: {exc}")
        except Exception as exc:  # never lose the reason; the feeder raises it
            self._error = MediaDecodeError(f"{self.fmt} decoding failed: {type(exc).__name__}: {exc}")
        finally:
            self._done.set()
            self.pipe.stop()

    def _emit(self, frame) -> None:
        if frame.width * frame.height > self.limits.max_pixels:
            raise MediaTooLarge(f"decoded picture of {frame.width}x{frame.height} exceeds the limit of "
                                f"{self.limits.max_pixels} pixels")
        t = frame.time if frame.time is not None else self.decoded / 30.0
        if self._pts0 is None:
            self._pts0 = t
        pts = max(0.0, t - self._pts0)
        out = Frame(to_rgb(frame, self.limits.max_side), pts, self.ts0 + pts, self.decoded)
        self.decoded += 1
        if self.on_frame is None:
            with self._lock:
                self._out.append(out)
            return
        self._in_frame = True
        try:
            self.on_frame(out)
        finally:
            self._in_frame = False
            self._progress = time.monotonic()


def to_rgb(frame, max_side: int) -> np.ndarray:
    """An av.VideoFrame as RGB uint8 [h, w, 3], scaled so its longer side is at most max_side."""
    w, h = frame.width, frame.height
    scale = min(1.0, max_side / max(w, h))
    tw, th = max(2, int(round(w * scale)) // 2 * 2), max(2, int(round(h * scale)) // 2 * 2)
    return frame.to_ndarray(width=tw, height=th, format="rgb24")


def decode_image(fmt: str, data: bytes, ts: float, index: int = 0, limits: DecodeLimits | None = None) -> Frame:
    """One JPEG or PNG picture -> a Frame (pts 0, captured at `ts`)."""
    if fmt not in IMAGE_CODECS:
        raise UnsupportedMedia(f"image format {fmt!r} is not supported ({', '.join(IMAGE_CODECS)})")
    av = require_av()
    limits = limits or DecodeLimits()
    try:
        ctx = av.CodecContext.create(IMAGE_CODECS[fmt], "r")
        frames = ctx.decode(av.Packet(data)) + ctx.decode(None)
    except av.error.FFmpegError as exc:
        raise MediaDecodeError(f"{fmt} image of {len(data)} bytes is corrupt: {exc}") from None
    if not frames:
        raise MediaDecodeError(f"{fmt} image of {len(data)} bytes holds no picture (truncated?)")
    frame = frames[0]
    if frame.width * frame.height > limits.max_pixels:
        raise MediaTooLarge(f"image of {frame.width}x{frame.height} exceeds the limit of {limits.max_pixels} pixels")
    return Frame(to_rgb(frame, limits.max_side), 0.0, ts, index, still=True)


def thumbnail(image: np.ndarray, side: int = 16) -> np.ndarray:
    """Mean colour over a side x side grid (float32 [side, side, 3]): cheap to compare, blind to
    noise, and it sees a change of colour at equal brightness."""
    h, w = image.shape[:2]
    ys = np.linspace(0, h, side + 1).astype(int)
    xs = np.linspace(0, w, side + 1).astype(int)
    pixels = image.astype(np.float32)
    rows = np.add.reduceat(pixels, ys[:-1], axis=0) / np.diff(ys)[:, None, None]
    return np.add.reduceat(rows, xs[:-1], axis=1) / np.diff(xs)[None, :, None]


@dataclass(slots=True)
class SamplerStats:
    seen: int = 0
    sampled: int = 0
    duplicates: int = 0


class FrameSampler:
    """Keeps the first frame of every 1/fps slot of media time, then skips near-duplicates of
    the last frame kept (mean absolute difference of 16x16 colour thumbnails below
    `dup_threshold`, in 0-255 levels), so a still camera costs nothing after its first frame.

    A frame may open its slot early by up to half the gap since the previous frame (at most a
    quarter slot): a live source sending at about the sample rate, with its timestamps
    jittering around the slot boundaries, keeps every frame, while a steady source still has
    its slot opened by the frame on the boundary (a scene cut at 2.0 s is seen at 2.0 s).

    `heartbeat_s`: a duplicate is still kept when the last kept frame is this old, so a still
    scene is confirmed now and then (0: never)."""

    def __init__(self, fps: float = 2.0, dup_threshold: float = 1.5, heartbeat_s: float = 10.0) -> None:
        if not (fps > 0 and math.isfinite(fps)):
            raise ValueError(f"sample rate must be a positive number of frames per second, got {fps!r}")
        self.fps = fps
        self.dup_threshold = dup_threshold
        self.heartbeat_s = heartbeat_s
        self.stats = SamplerStats()
        self._slot = -1
        self._last: np.ndarray | None = None
        self._last_pts = -math.inf
        self._prev_pts: float | None = None  # the previous frame offered

    def offer(self, frame: Frame) -> bool:
        """True if the frame is kept."""
        self.stats.seen += 1
        gap = frame.pts - self._prev_pts if self._prev_pts is not None else 0.0
        self._prev_pts = frame.pts
        early = min(0.25 / self.fps, max(0.0, gap) / 2)
        slot = math.floor((frame.pts + early) * self.fps + 1e-6)
        if slot <= self._slot:
            return False
        self._slot = slot
        thumb = thumbnail(frame.image)
        if self._last is not None and float(np.abs(thumb - self._last).mean()) < self.dup_threshold:
            if not (self.heartbeat_s and frame.pts - self._last_pts >= self.heartbeat_s):
                self.stats.duplicates += 1
                return False
        self._last, self._last_pts = thumb, frame.pts
        self.stats.sampled += 1
        return True

    def filter(self, frames: list[Frame]) -> list[Frame]:
        return [f for f in frames if self.offer(f)]


class LatestSlot:
    """A queue of one between decoding and encoding: when the encoder (or the engine behind
    it) is busy, a newer frame replaces the waiting one, and the replaced frame counts as
    dropped (DESIGN 7: the newest frame wins)."""

    def __init__(self, on_drop: Callable[[Frame], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._item: Frame | None = None
        self._closed = False
        self.dropped = 0
        self.on_drop = on_drop

    def put(self, frame: Frame) -> None:
        with self._cond:
            if self._item is not None:
                self.dropped += 1
                if self.on_drop is not None:
                    self.on_drop(self._item)
            self._item = frame
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def get(self, timeout: float | None = None) -> Frame | None:
        """The waiting frame; None once closed and empty (or on timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._item is not None or self._closed, timeout)
            item, self._item = self._item, None
            return item

    @property
    def pending(self) -> bool:
        with self._cond:
            return self._item is not None
