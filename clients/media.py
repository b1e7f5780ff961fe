"""`streamer client media ...`: stream a video, audio or image file (or a camera or microphone)
into a session as binary media frames, printing observations and transcripts as they land.

Files are read with PyAV (the `media` extra). Video is remuxed, without re-encoding, into
fragmented MP4 (WebM and MPEG-TS files are sent as they are), so any file streams without the
server ever seeking; audio is decoded to 16-bit PCM at its own rate. `--realtime` paces the
pieces by their media time, like a live source (the server then drops stale frames when it
is behind); otherwise they go as fast as the server takes them, and it drops nothing. Paced,
the remux writes one fragment per frame and sends each when its frame is due: fragments cut at
keyframes held a whole group of pictures back and sent it at once, late, as a burst the
server's newest-frame-wins slot mostly dropped (a cut at 7.0 s seen at 9.5 s). WebM and
MPEG-TS files paced are cut where their video packets start, for the same reason.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from streamer.cliargs import CliError, nonnegative_float, positive_float, positive_int
from streamer.sessions.errors import Code
from streamer.vision.errors import MediaError

from .client import StreamerClient
from .options import answer_arguments, answer_options, url_argument

IMAGE_SUFFIXES = {".jpg": "jpeg", ".jpeg": "jpeg", ".png": "png"}
UNACKED = 16  # media frames sent ahead of their acks
ACK_TIMEOUT_S = 120.0  # how long a frame's ack is waited for before the stream goes on without it
PASSTHROUGH = {".webm": "webm", ".mkv": "webm", ".ts": "mpegts", ".m2ts": "mpegts"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a video, audio or image file; or a device with --device-format "
                                       "(e.g. /dev/video0 with v4l2, 'default' with alsa or pulse)")
    url_argument(parser)
    parser.add_argument("--realtime", action="store_true", help="pace the stream by its media time (live)")
    parser.add_argument("--device-format", default=None, metavar="FORMAT",
                        help="capture from a device through this FFmpeg input format (v4l2, avfoundation, "
                             "dshow, alsa, pulse); video is sent as JPEG pictures, audio as PCM")
    parser.add_argument("--seconds", type=nonnegative_float, default=0.0, help="stop after this much media time (0: all)")
    parser.add_argument("--fps", type=positive_float, default=2.0, help="device video: pictures per second sent")
    parser.add_argument("--piece-bytes", type=positive_int, default=32 * 1024,
                        help="bytes per media frame for container files (default: %(default)s)")
    parser.add_argument("--ask", action="append", default=[], metavar="QUESTION",
                        help="a question to ask when the stream ends (repeatable)")
    parser.add_argument("--max-tokens", type=positive_int, default=64, help="answer token limit (default: %(default)s)")
    parser.add_argument("--window", type=positive_int, default=None, metavar="TOKENS",
                        help="bound the session's cache to this many tokens (sinks + recent inputs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per event")
    answer_arguments(parser)


# ---- sources: (kind, format, payload, media time in seconds, extra header fields) -------------


def _av():
    try:
        import av
    except ImportError as exc:
        raise CliError("streaming media needs the 'media' extra (PyAV is not installed): "
                       "pip install 'streamer[media]' (in a checkout: pip install -e '.[media]')") from exc
    return av


def file_pieces(path: Path, piece_bytes: int, live: bool = False) -> Iterator[tuple[str, str, bytes, float, dict]]:
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        yield "image", IMAGE_SUFFIXES[suffix], path.read_bytes(), 0.0, {}
        return
    av = _av()
    with av.open(str(path)) as probe:
        has_video, has_audio = bool(probe.streams.video), bool(probe.streams.audio)
        duration = float(probe.duration / 1e6) if probe.duration else 0.0
    if has_video:
        if suffix in PASSTHROUGH:
            if live:
                yield from _paced_raw_pieces(path, PASSTHROUGH[suffix], piece_bytes)
            else:
                yield from _raw_pieces(path, PASSTHROUGH[suffix], piece_bytes, duration)
        else:
            yield from _remux_fmp4(path, piece_bytes, live)
    elif has_audio:
        yield from _pcm_pieces(av.open(str(path)), 0.5)
    else:
        raise CliError(f"{path} has no video or audio stream: give a video, audio or image file")


def probe(path: Path) -> None:
    """Check that `path` is a picture, video or audio file that decodes (its first frame), the
    way the service will decode it; raise CliError naming what is wrong otherwise."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CliError(f"cannot read {path}: no such file: check the path") from None
    except OSError as exc:
        raise CliError(f"cannot read {path} ({exc.strerror}): check the path and its permissions") from None
    if path.is_dir():
        raise CliError(f"cannot read {path}: it is a directory: give a video, audio or image file")
    av = _av()
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        from streamer.vision.video import decode_image  # needs av (the media extra)

        try:
            decode_image(IMAGE_SUFFIXES[suffix], path.read_bytes(), 0.0)
        except MediaError as exc:
            raise CliError(f"{path} is not a picture the service can read ({exc}): give a JPEG or PNG "
                           "file") from None
        except OSError as exc:
            raise CliError(f"cannot read {path} ({exc.strerror}): check its permissions") from None
        return
    try:
        with av.open(str(path)) as container:
            streams = [s for s in (container.streams.video[:1] or container.streams.audio[:1])]
            if not streams:
                raise CliError(f"{path} has no video or audio stream: give a video, audio or image file")
            if next(iter(container.decode(streams[0])), None) is None:
                raise CliError(f"{path}: its {streams[0].type} stream has no frame that decodes (truncated or "
                               "corrupt?): give another file")
    except av.error.FFmpegError as exc:
        what = exc.strerror or type(exc).__name__
        raise CliError(f"{path} ({size} bytes) is not a video, audio or image file the service can read "
                       f"({what}): give an MP4, WebM, MPEG-TS, WAV, Ogg, JPEG or PNG file") from None


def _raw_pieces(path: Path, fmt: str, piece_bytes: int, duration: float):
    """A streamable container sent as is; media time spread evenly over the bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        sent = 0
        while piece := f.read(piece_bytes):
            sent += len(piece)
            yield "video", fmt, piece, duration * (sent - len(piece)) / max(size, 1), {}


def _paced_raw_pieces(path: Path, fmt: str, piece_bytes: int):
    """A streamable container sent as is, for pacing: cut where each video packet starts, so a
    piece holds the packets before that point whole and goes at their latest media time (bytes
    spread evenly over time sent a low-rate file's frames early, many per piece, in bursts)."""
    av = _av()
    with av.open(str(path)) as container, path.open("rb") as f:
        sent, first, t = 0, None, 0.0
        for packet in container.demux(container.streams.video[0]):
            if packet.pos is not None and packet.pos > sent:
                yield from _cut(fmt, f.read(packet.pos - sent), piece_bytes, t)
                sent = packet.pos
            if packet.pts is not None and packet.time_base is not None:
                pts = float(packet.pts * packet.time_base)
                first = pts if first is None else first
                t = max(t, pts - first)
        yield from _cut(fmt, f.read(), piece_bytes, t)


def _cut(fmt: str, data: bytes, piece_bytes: int, t: float):
    for i in range(0, len(data), piece_bytes):
        yield "video", fmt, data[i:i + piece_bytes], t, {}


class _Collector:
    """A write-only file for PyAV's muxer: collects what it writes."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


def _remux_fmp4(path: Path, piece_bytes: int, live: bool = False):
    """Remux the first video track into fragmented MP4 (no re-encoding) as it is read. Each
    piece's media time is the latest pts muxed so far, so a paced piece never goes before its
    frames could have been captured. `live`: a fragment per frame (the muxer writes one when
    the next frame comes), so every frame goes when it is due; otherwise a fragment per
    keyframe (fewer, larger pieces)."""
    av = _av()
    sink = _Collector()
    with av.open(str(path)) as src:
        vin = src.streams.video[0]
        cut = "frag_every_frame" if live else "frag_keyframe"
        out = av.open(sink, "w", format="mp4", options={"movflags": f"{cut}+empty_moov+default_base_moof"})
        vout = out.add_stream_from_template(vin)
        t = 0.0
        for packet in src.demux(vin):
            if packet.dts is None:
                continue
            if packet.pts is not None and packet.time_base is not None:
                t = max(t, float(packet.pts * packet.time_base))
            packet.stream = vout
            out.mux(packet)
            data = sink.take()
            while data:
                yield "video", "mp4", data[:piece_bytes], t, {}
                data = data[piece_bytes:]
        out.close()
        data = sink.take()
        if data:
            yield "video", "mp4", data, t, {}


def _pcm_pieces(container, piece_s: float):
    """Decode the first audio track to interleaved s16le at its own rate, in pieces."""
    av = _av()
    with container:
        ain = container.streams.audio[0]
        rate, channels = ain.rate, ain.channels
        resampler = av.AudioResampler(format="s16", layout="mono" if channels == 1 else "stereo", rate=rate)
        channels = min(channels, 2)
        buf, sent = b"", 0
        step = int(piece_s * rate) * 2 * channels
        for frame in container.decode(ain):
            for out in resampler.resample(frame):
                buf += bytes(out.planes[0])[: out.samples * 2 * channels]
            while len(buf) >= step:
                yield "audio", "pcm_s16le", buf[:step], sent / (2 * channels * rate), \
                    {"sample_rate": rate, "channels": channels}
                sent += step
                buf = buf[step:]
        if buf:
            yield "audio", "pcm_s16le", buf, sent / (2 * channels * rate), {"sample_rate": rate, "channels": channels}


def device_pieces(device: str, fmt: str, fps: float):
    """Capture from a camera (as JPEG pictures at `fps`) or a microphone (as PCM). The device is
    opened here, before anything is sent, so a missing one is reported at once."""
    av = _av()
    if fmt not in av.formats_available:
        have = [f for f in ("v4l2", "avfoundation", "dshow", "alsa", "pulse") if f in av.formats_available]
        raise CliError(f"this PyAV build has no '{fmt}' input format (capture formats it has: "
                       f"{', '.join(have) or 'none'}): pick one of those with --device-format")
    try:
        container = av.open(device, format=fmt)
    except (av.error.FFmpegError, OSError) as exc:
        raise CliError(f"cannot open {fmt} device {device!r} ({exc}): check the device name") from None
    if container.streams.video:
        return _camera(container, fps)
    return _pcm_pieces(container, 0.25)


def _camera(container, fps: float):
    av = _av()
    from fractions import Fraction

    started, last = None, -1.0
    with container:
        for frame in container.decode(video=0):
            t = frame.time if frame.time is not None else time.monotonic()
            started = t if started is None else started
            if t - last < 1.0 / fps:
                continue
            last = t
            ctx = av.CodecContext.create("mjpeg", "w")
            ctx.width, ctx.height, ctx.pix_fmt, ctx.time_base = frame.width, frame.height, "yuvj420p", Fraction(1, 1)
            picture = frame.reformat(format="yuvj420p")
            payload = b"".join(bytes(p) for p in ctx.encode(picture) + ctx.encode(None))
            yield "image", "jpeg", payload, t - started, {}


# ---- the streaming loop -------------------------------------------------------------------


async def stream_media(args: argparse.Namespace) -> int:
    emit = (lambda **kv: print(json.dumps(kv), flush=True)) if args.json else None
    if args.device_format:
        pieces = device_pieces(args.source, args.device_format, args.fps)
        live = True
    else:
        path = Path(args.source)
        probe(path)  # before connecting: a file the service cannot read costs no session
        live = args.realtime
        pieces = file_pieces(path, args.piece_bytes, live)
    async with await StreamerClient.connect(args.url, args.api_key) as client:
        window = {"max_tokens": args.window} if args.window else None
        session = await client.create_session(window=window)
        _say(emit, f"session {session.id} on {session.model}", event="session", session_id=session.id)
        acks = _Acks()
        printer = asyncio.get_running_loop().create_task(_print_events(client, emit, acks))
        try:
            sent = await _send_all(session, pieces, args, live, acks)
            await acks.wait(0)
        except MediaRefused as exc:
            printer.cancel()
            await session.close()
            raise CliError(f"{args.url} takes no media ({exc}): start `streamer serve` there without --no-media, "
                           "or stream text with `streamer client stream`", exit_code=3) from None
        state = await _settle(session)
        media = state.get("media", {})
        _say(emit, f"sent {sent} media frames; media state: {json.dumps(media)}", event="done", sent=sent,
             media=media, tokens=state["tokens"])
        for question in args.ask:
            answer = await session.ask(question, max_tokens=args.max_tokens, **answer_options(args))
            _say(emit, f"Q: {question}\nA: {answer.text.strip()}", event="answer", question=question,
                 text=answer.text, tokens=answer.tokens, finish_reason=answer.finish_reason)
        await session.close()
        printer.cancel()
    errors = sum(s.get("errors", 0) for s in media.values() if isinstance(s, dict))
    if errors:  # the stream went on, but not all of it was used: say so, and exit non-zero
        raise CliError(f"the service could not use all of {args.source}: {errors} media error(s), each printed "
                       "above after '!'; check the file (or device) and try again", exit_code=1)
    return 0


class MediaRefused(Exception):
    """The service refused a media frame as a whole because it takes no media (`--no-media`)."""


class _Acks:
    """Media frames sent and not yet acknowledged, and whether the service refused media
    altogether (its `unexpected_binary` error names no frame, so no ack would ever come)."""

    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future] = {}
        self.refused: asyncio.Future[dict] = asyncio.get_running_loop().create_future()

    def sent(self, seq: int) -> None:
        self.pending[seq] = asyncio.get_running_loop().create_future()

    def settle(self, seq: int | None, event: dict) -> None:
        """Frame `seq` got its ack (or an error for the whole frame)."""
        fut = self.pending.pop(seq, None)
        if fut is not None and not fut.done():
            fut.set_result(event)

    def refuse(self, error: dict) -> None:
        if not self.refused.done():
            self.refused.set_result(error)

    async def wait(self, unacked: int) -> None:
        """Until at most `unacked` frames wait for their ack (one that takes ACK_TIMEOUT_S is
        given up on); raises MediaRefused as soon as the service refuses media."""
        while len(self.pending) > unacked and not self.refused.done():
            oldest = min(self.pending)
            await asyncio.wait([self.pending[oldest], self.refused], timeout=ACK_TIMEOUT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            self.pending.pop(oldest, None)
        if self.refused.done():
            error = self.refused.result()
            raise MediaRefused(f"{error['code']}: {error['message']}")


async def _send_all(session, pieces, args, live: bool, acks: _Acks) -> int:
    started, t0, seq = time.monotonic(), time.time(), 0
    last = None
    async for kind, fmt, payload, media_t, extra in _aiter(pieces):
        if args.seconds and media_t > args.seconds:
            break
        if args.realtime or args.device_format:
            delay = started + media_t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        await _send(session, (kind, fmt, payload, seq, t0 + media_t, extra), acks, live)
        await acks.wait(0 if seq == 0 else UNACKED)  # the first frame's ack (or refusal) before more go
        last = (kind, fmt, t0 + media_t, extra)
        seq += 1
    if last is not None and last[0] != "image":  # the stream is finished: flush the decoder
        kind, fmt, ts, extra = last
        await _send(session, (kind, fmt, b"", seq, ts, {**extra, "end": True}), acks, live)
        seq += 1
    return seq


async def _send(session, item, acks: _Acks, live: bool) -> None:
    kind, fmt, payload, seq, ts, extra = item
    acks.sent(seq)
    await session.send_media(kind, fmt, payload, seq, ts, live=live if kind != "audio" else None, **extra)


async def _aiter(pieces) -> AsyncIterator:
    """Run the (blocking) source in a thread, one piece at a time."""
    loop = asyncio.get_running_loop()
    it = iter(pieces)
    done = object()
    while (item := await loop.run_in_executor(None, next, it, done)) is not done:
        yield item


async def _settle(session, limit: float = 120.0) -> dict:
    """Wait until every sampled frame is encoded (or dropped): the observations are in."""
    deadline = time.monotonic() + limit
    while True:
        state = await session.state()
        video = state.get("media", {}).get("video")
        if video is None or video["encoded"] + video["dropped"] >= video["sampled"] or time.monotonic() > deadline:
            await asyncio.sleep(0.3)
            return await session.state()
        await asyncio.sleep(0.1)


async def _print_events(client, emit, acks: _Acks) -> None:
    async for event in client.events():
        kind = event["type"]
        if kind == "input.ack" and "media_seq" in event:
            acks.settle(event["media_seq"], event)
        elif kind == "media.observation":
            what = (event.get("text") or "").strip() or f"a frame of {event.get('visual_tokens')} visual tokens " \
                f"in the cache ({event.get('encoder')})"
            _say(emit, f"  [{event['start_s']:.1f}s +{event['lag_ms']:.0f} ms] {what}",
                 event="observation", **{k: event.get(k) for k in ("start_s", "text", "lag_ms", "seq", "events")})
        elif kind == "media.transcript":
            mark = "final" if event["final"] else "partial"
            _say(emit, f"  [{event['start_s']:.1f}-{event['end_s']:.1f}s {mark}] {event['text']}",
                 event="transcript", **{k: event.get(k) for k in ("start_s", "end_s", "text", "final", "segment")})
        elif kind == "error" and event["error"]["code"] == Code.UNEXPECTED_BINARY:
            acks.refuse(event["error"])  # the stream stops with one line, not one per frame
        elif kind == "error":
            acks.settle(event.get("media_seq"), event)  # a frame that failed as a whole
            err = event["error"]
            _say(emit, f"  ! {err['code']}: {err['message']}", event="error", **err)


def _say(emit, line: str, /, **fields) -> None:
    """Print `line`, or with --json the fields as one JSON object (`fields` may hold a
    `message`, as error events do: `line` is positional-only)."""
    if emit:
        emit(**fields)
    else:
        print(line, flush=True)
