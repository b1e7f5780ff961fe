"""Media input at the edge: binary frames of one connection -> per-session media streams.

Each session has at most one video stream (containers and still images share it, so the
describer compares consecutive pictures) and one audio stream. Decoding never runs on the event
loop: a container's piece goes from the loop straight into its decoder's pipe (the decoder's
thread decodes, samples and encodes), a picture and an audio piece go to the stream's own
thread; a stream's pieces are taken in order. The receive loop only waits when a stream has
`max_backlog` pieces not yet taken, which pushes back on a sender that is faster than decoding.
PyAV and the ASR packages are optional (`media` extra) and imported only when the first media
frame arrives; without them a media frame gets `unsupported_media`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from streamer.sessions.errors import Code, EngineError
from streamer.sessions.futures import chain, settle

from .loopbridge import bridge
from .protocol import Command
from .records import Append, Frame, Revise, Update

log = logging.getLogger(__name__)

BLOB_TIMEOUT_S = 10.0  # how long a frame's blob may take to be stored before the frame is refused


@dataclass(slots=True)
class MediaConfig:
    """Media settings of the server, with their defaults."""

    video: Any = None  # streamer.vision.ingest.VideoConfig; None: its defaults
    video_encoder: Callable[[], Any] | None = None  # a VisionEncoder factory (text model); None: the frame describer
    audio: dict = field(default_factory=dict)  # keyword arguments for streamer.vision.audio.AudioStream
    max_backlog: int = 8  # pieces of one stream queued before the receive loop waits for them
    frame_tokens: int = 256  # visual tokens per frame when the engine's model is a VLM (frames go into its cache)
    window_tokens: int | None = 4096  # media sessions without a window get one of this many tokens
    #   (at most the context window; sinks + recent inputs, see sessions/window.py); None: leave unbounded


class MediaStream:
    """One session's video or audio input and its own thread (audio pieces, pictures, the
    newest frame when no container is open, closing)."""

    def __init__(self, name: str) -> None:
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.backlog: list[asyncio.Future] = []
        self.ingest: Any = None

    def close(self) -> None:
        if self.ingest is not None:
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

    @classmethod
    def for_peer(cls, engine, events, config: MediaConfig, peer,
                 note_lag: Callable[[str, float], None] | None = None) -> "MediaHub":
        """The hub of one connection (`peer`): what its media streams write is logged by
        `events` like a client's input, and their events and errors go to the peer. `note_lag`
        gets each observation's capture-to-cache lag (the snapshot's `ingest_lag_ms`)."""

        def send_event(event: str, sid: str, payload: dict) -> None:  # from stream threads
            def send() -> None:
                if event == "error":
                    err = payload["error"]
                    peer.send(peer.proto.error(err["code"], err["message"], recoverable=err["recoverable"],
                                               session_id=sid))
                else:
                    if note_lag is not None and event == "media.observation" and payload.get("lag_ms") is not None:
                        note_lag(sid, payload["lag_ms"] / 1000)
                    peer.send(peer.proto.event(event, session_id=sid, **payload))

            if not peer.closed:
                peer.post(send)  # in order with the engine's replies; dropped once the loop is gone

        def send_error(cmd: Command, exc: EngineError) -> None:
            param = "payload" if exc.code in ("media_decode_error", "media_too_large") else None
            peer.send(peer.proto.error(exc.code, exc.message, recoverable=exc.recoverable, session_id=cmd.session_id,
                                       param=param, media_seq=cmd["seq"]))

        return cls(LoggedEngine(engine, events, peer.loop), config, send_event, send_error)

    def submit(self, cmd: Command, loop: asyncio.AbstractEventLoop, on_done: Callable[[dict], None]) -> None:
        """Queue a media frame on its stream; `on_done(counters)` runs on the loop when it is in
        (a video piece: once its decoder has used it up)."""
        sid, kind = cmd.session_id, cmd["kind"]
        group = "audio" if kind == "audio" else "video"
        stream = self.streams.get((sid, group))
        if stream is None:
            stream = MediaStream(f"{group}-{sid}")
            try:
                stream.ingest = self._open(sid, group, stream, loop)
            except (EngineError, ImportError) as exc:
                stream.close()
                if isinstance(exc, ImportError):  # the media extra is not installed
                    exc = EngineError(f"{group} input needs the 'media' extra (pip install 'streamer[media]'): "
                                      f"{exc}", code=Code.UNSUPPORTED_MEDIA)
                self.send_error(cmd, exc)
                return
            self.streams[(sid, group)] = stream
            if self.config.window_tokens:  # an endless stream: a bounded cache before its media lands
                self.engine.ensure_window(sid, self.config.window_tokens)
        fields = cmd.fields
        if group == "audio":
            job = lambda: stream.ingest.feed(fields["format"], fields["payload"], fields["seq"], fields["ts"],  # noqa: E731
                                             fields.get("sample_rate"), fields.get("channels"), bool(fields.get("end")))
            taken = stream.executor.submit(job)
        else:  # on the loop, without waiting: a container's piece goes straight into its decoder
            taken = stream.ingest.feed(kind, fields["format"], fields["payload"], fields["seq"], fields["ts"],
                                       bool(fields.get("end")), fields.get("live", True))
        fut = bridge(loop).wrap(taken)  # in order with the stream's observation events
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
                                                 code=Code.INTERNAL_ERROR))

        fut.add_done_callback(done)

    async def throttle(self, cmd: Command) -> None:
        """Wait while the frame's stream has more than `max_backlog` pieces queued."""
        group = "audio" if cmd["kind"] == "audio" else "video"
        stream = self.streams.get((cmd.session_id, group))
        while stream is not None and len(stream.backlog) > self.config.max_backlog:
            await asyncio.wait([stream.backlog[0]])

    def _open(self, sid: str, group: str, stream: MediaStream, loop: asyncio.AbstractEventLoop):
        def emit(event: str, payload: dict) -> None:
            if event == "error" and (sid, group) not in self.streams:
                return  # the session closed behind this work: its failure is expected, not news
            self.send_event(event, sid, payload)

        if group == "video":
            from streamer.vision.ingest import VideoConfig, VideoIngest
            from streamer.vision.video import require_av

            require_av()
            if getattr(self.engine.runner, "vl", None) is not None:  # the engine's model sees the frames
                from streamer.vision.vlm import EngineFrameEncoder

                encoder = EngineFrameEncoder(self.engine, sid, self.config.frame_tokens)
            elif self.config.video_encoder is not None:
                encoder = self.config.video_encoder()
            else:
                from streamer.vision.describe import FrameDescriber

                encoder = FrameDescriber()
            def later(delay: float, fn: Callable[[], None]) -> None:  # from any thread
                try:
                    loop.call_soon_threadsafe(loop.call_later, delay, fn)
                except RuntimeError:  # the loop is gone (server shutting down)
                    pass

            return VideoIngest(self.engine, sid, encoder, emit, self.config.video or VideoConfig(),
                               run=stream.executor.submit, later=later)
        from streamer.vision.ingest import AudioIngest

        return AudioIngest(self.engine, sid, emit, self.config.audio)

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


class LoggedEngine:
    """The engine as the media path sees it: appends, revises and window settings made on a
    media thread (observations, transcripts) go to the session's event log like a client's
    inputs, in the order the engine applied them, so replay rebuilds media sessions too.
    Everything else is the engine itself."""

    def __init__(self, engine, events, loop: asyncio.AbstractEventLoop) -> None:
        self._engine, self._events, self._loop = engine, events, loop

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def _logged(self, session_id: str, call, record_of, then):
        return self._events.from_thread(session_id, call, record_of, self._loop, then)

    def append(self, session_id: str, text: str, then=None):
        return self._logged(session_id, lambda: self._engine.append(session_id, text),
                            lambda r: Append(text=text, seq=r.seq, source="media",
                                              evicted=r.evicted_seqs or None), then)

    def revise(self, session_id: str, text: str, from_seq: int | None = None, then=None):
        return self._logged(session_id, lambda: self._engine.revise(session_id, text, from_seq),
                            lambda r: Revise(text=text, from_seq=from_seq, seq=r.seq, source="media",
                                              evicted=r.evicted_seqs or None), then)

    def transcribe(self, session_id: str, segment: str, text: str, final: bool, then=None):
        def record(r):  # what the engine did: appended, revised (or deleted) a partial, or nothing
            if r is None:
                return None
            evicted = r.evicted_seqs or None
            if r.replaced_seqs:
                return Revise(text=text, from_seq=r.replaced_seqs[0], seq=r.seq, source="media", evicted=evicted)
            return Append(text=text, seq=r.seq, source="media", evicted=evicted)

        return self._logged(session_id, lambda: self._engine.transcribe(session_id, segment, text, final),
                            record, then)

    def append_frame(self, session_id: str, frame, text: str, frame_tokens: int, label: str | None = None,
                     then=None) -> Future:
        """A frame into a VL session's cache, from a media thread (the decoder's) that does not wait: a future
        of the engine's result. The blob is compressed here; on the event loop, in the session's
        log pipeline (its turn, like any change), the blob is stored, then the frame is handed
        to the engine and its `frame` record logged after it. A blob the store does not take in
        `BLOB_TIMEOUT_S` fails the frame (store_unavailable): nothing applied, nothing logged."""
        from streamer.sessions.multimodal import frame_blob

        blob, store = frame_blob(frame.image), self._events.store

        async def store_then_apply(out: Future) -> None:
            try:
                await asyncio.wait_for(store.put_blob(frame.digest, blob), BLOB_TIMEOUT_S)
            except Exception as exc:
                settle(out, exc=EngineError(f"the frame could not be logged: {exc}", code=Code.STORE_UNAVAILABLE))
                return
            try:
                chain(self._engine.append_frame(session_id, frame, text), out)
            except Exception as exc:  # the engine refused it at once (stopping, closed)
                settle(out, exc=exc)

        def call() -> Future:  # on the loop, holding the session's place in its log
            out: Future = Future()
            task = self._events.spawn(store_then_apply(out))
            task.add_done_callback(lambda t: t.cancelled() and settle(
                out, exc=EngineError("the frame was cancelled before the engine took it", code=Code.ENGINE_STOPPED)))
            return out

        return self._logged(session_id, call,
                            lambda r: Frame(text=text, blob=frame.digest, frame_tokens=frame_tokens, label=label,
                                            media_s=frame.media_s, seq=r.seq, source="media",
                                            evicted=r.evicted_seqs or None), then)

    def ensure_window(self, session_id: str, max_tokens: int, then=None):
        def record(state: dict):  # logged only when it set a window
            return Update(window=state["window_set"]) if state.get("window_set") else None

        return self._logged(session_id, lambda: self._engine.ensure_window(session_id, max_tokens), record, then)
