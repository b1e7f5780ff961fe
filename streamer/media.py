"""Media input at the edge: binary frames of one connection -> per-session media streams.

Each session has at most one video stream (containers and still images share it, so the
describer compares consecutive pictures) and one audio stream. A stream's pieces are handled
in order on a thread of its own (decoding never runs on the event loop); the receive loop only
waits when a stream has `max_backlog` pieces queued, which pushes back on a sender that is
faster than decoding. PyAV and the ASR packages are optional (`media` extra) and imported only
when the first media frame arrives; without them a media frame gets `unsupported_media`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from streamer.sessions.errors import EngineError

from .protocol import Command

log = logging.getLogger(__name__)


@dataclass(slots=True)
class MediaConfig:
    """Media settings of the server, with their defaults."""

    video: Any = None  # streamer.vision.ingest.VideoConfig; None: its defaults
    video_encoder: Callable[[], Any] | None = None  # a VisionEncoder factory; None: the frame describer
    audio: dict = field(default_factory=dict)  # keyword arguments for streamer.vision.audio.AudioStream
    max_backlog: int = 8  # pieces of one stream queued before the receive loop waits for them
    window_tokens: int | None = 4096  # media sessions without a window get one of this many tokens
    #   (at most the context window; sinks + recent inputs, see sessions/window.py); None: leave unbounded


class MediaStream:
    """One session's video or audio input and the single thread that feeds it in order."""

    def __init__(self, ingest: Any, name: str) -> None:
        self.ingest = ingest
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.backlog: list[asyncio.Future] = []

    def close(self) -> None:
        self.executor.submit(self.ingest.close)
        self.executor.shutdown(wait=False)


class MediaHub:
    """The media streams of one connection's sessions."""

    def __init__(self, engine, config: MediaConfig, send_event: Callable[[str, str | None, dict], None],
                 send_error: Callable[[Command, EngineError], None]) -> None:
        self.engine = engine
        self.config = config
        self.send_event = send_event  # (type, session_id, fields), thread-safe
        self.send_error = send_error  # on the loop
        self.streams: dict[tuple[str, str], MediaStream] = {}

    def submit(self, cmd: Command, loop: asyncio.AbstractEventLoop, on_done: Callable[[dict], None]) -> None:
        """Queue a media frame on its stream; `on_done(counters)` runs on the loop when it is in."""
        sid, kind = cmd.session_id, cmd["kind"]
        group = "audio" if kind == "audio" else "video"
        stream = self.streams.get((sid, group))
        if stream is None:
            try:
                stream = self.streams[(sid, group)] = MediaStream(self._open(sid, group, cmd), f"{group}-{sid}")
            except EngineError as exc:
                self.send_error(cmd, exc)
                return
            except ImportError as exc:  # the media extra is not installed
                self.send_error(cmd, EngineError(f"{group} input needs the 'media' extra "
                                                 f"(pip install 'streamer[media]'): {exc}", code="unsupported_media"))
                return
            if self.config.window_tokens:
                stream.executor.submit(self._bound, sid)
        fields = cmd.fields
        if group == "audio":
            job = lambda: stream.ingest.feed(fields["format"], fields["payload"], fields["seq"], fields["ts"],  # noqa: E731
                                             fields.get("sample_rate"), fields.get("channels"), bool(fields.get("end")))
        else:
            job = lambda: stream.ingest.feed(kind, fields["format"], fields["payload"], fields["seq"],  # noqa: E731
                                             fields["ts"], bool(fields.get("end")), fields.get("live", True))
        fut = asyncio.wrap_future(stream.executor.submit(job), loop=loop)
        stream.backlog.append(fut)

        def done(f: asyncio.Future) -> None:
            stream.backlog.remove(f)
            if f.cancelled():
                return
            exc = f.exception()
            if exc is None:
                on_done(f.result())
            elif self.streams.get((sid, group)) is not stream:  # the session closed behind this frame
                return
            elif isinstance(exc, EngineError):
                self.send_error(cmd, exc)
            else:
                log.error("media frame on session %s failed", sid, exc_info=exc)
                self.send_error(cmd, EngineError(f"media frame failed: {type(exc).__name__}: {exc}",
                                                 code="internal_error"))

        fut.add_done_callback(done)

    async def throttle(self, cmd: Command) -> None:
        """Wait while the frame's stream has more than `max_backlog` pieces queued."""
        group = "audio" if cmd["kind"] == "audio" else "video"
        stream = self.streams.get((cmd.session_id, group))
        while stream is not None and len(stream.backlog) > self.config.max_backlog:
            await asyncio.wait([stream.backlog[0]])

    def _open(self, sid: str, group: str, cmd: Command):
        def emit(event: str, payload: dict) -> None:
            if event == "error" and (sid, group) not in self.streams:
                return  # the session closed behind this work: its failure is expected, not news
            self.send_event(event, sid, payload)

        if group == "video":
            from streamer.vision.ingest import VideoConfig, VideoIngest
            from streamer.vision.video import require_av

            require_av()
            if self.config.video_encoder is not None:
                encoder = self.config.video_encoder()
            else:
                from streamer.vision.describe import FrameDescriber

                encoder = FrameDescriber()
            return VideoIngest(self.engine, sid, encoder, emit, self.config.video or VideoConfig())
        from streamer.vision.ingest import AudioIngest

        return AudioIngest(self.engine, sid, emit, self.config.audio)

    def _bound(self, sid: str) -> None:
        """Give an unbounded session a text window before its media (an endless stream) lands."""
        try:
            state = self.engine.session_state(sid).result(30)
            if state.get("window") or state["thinking"].get("mode", "off") != "off":
                return
            size = min(self.config.window_tokens, state["context_window"])
            self.engine.configure_window(sid, size).result(30)
        except Exception as exc:  # the media still flows; the context window stays the bound
            log.warning("no text window for session %s: %s", sid, exc)

    def state(self, sid: str) -> dict | None:
        out = {}
        for group in ("video", "audio"):
            stream = self.streams.get((sid, group))
            if stream is not None:
                out[group] = stream.ingest.state()
        return out or None

    def close_session(self, sid: str) -> None:
        for group in ("video", "audio"):
            stream = self.streams.pop((sid, group), None)
            if stream is not None:
                stream.close()

    def close(self) -> None:
        for sid, _ in list(self.streams):
            self.close_session(sid)
