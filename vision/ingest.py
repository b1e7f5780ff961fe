"""One session's video input, from binary media frames to its cache.

    payload pieces -> VideoDecoder (demux + decode, its own thread) -> FrameSampler (rate,
    near-duplicates) -> LatestSlot (newest frame wins) -> VisionEncoder -> Engine.append with a
    then= callback (text observations), or the encoder's own hand-off to the engine, whose
    future gets the same callback (VLM: `Observation.pending`)

`feed()` runs on the caller's thread (the event loop) and does not wait: a container's piece
goes straight into its decoder's pipe, and the decoder's thread samples each frame as it comes
out and encodes the newest one whenever the previous one's observations are in the cache, so a
slow encoder or a busy engine drops stale frames instead of falling ever further behind
(`live=True`, the default for cameras); nothing blocks on the engine. The piece's future (its
`input.ack`) resolves once the decoder has used the piece up. With `live=False` (a file sent as
fast as possible) the decoder's thread waits for the previous frame instead, so no frame is
dropped and, as the pieces' futures resolve later, the sender is slowed down.

Events go out through `emit(type, payload)` from the decoder's thread, the stream's or the
engine's: `media.observation` when an observation is in the cache, `error` for failures (the
stream resets; the session is kept).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from streamer.sessions.errors import EngineError
from streamer.sessions.futures import settle

from .encoder import Frame, Observation, VisionEncoder
from .errors import MediaDecodeError, MediaError, MediaHeaderInvalid, MediaTooLarge
from .video import DecodeLimits, FrameSampler, LatestSlot, VideoDecoder, decode_image

log = logging.getLogger(__name__)

Emit = Callable[[str, dict], None]


@dataclass(slots=True)
class VideoConfig:
    """Video input settings, with their defaults."""

    sample_fps: float = 2.0  # frames per second of media time handed to the encoder, at most
    dup_threshold: float = 1.5  # mean thumbnail difference (luma levels) below which a frame is a duplicate
    heartbeat_s: float = 10.0  # keep one duplicate this often, so a still scene is confirmed
    decode: DecodeLimits = field(default_factory=DecodeLimits)
    append_timeout_s: float = 120.0  # at the end of a stream: how long to wait for its last observations


@dataclass(slots=True)
class VideoStats:
    pieces: int = 0
    bytes: int = 0
    decoded: int = 0
    sampled: int = 0
    duplicates: int = 0
    dropped: int = 0
    encoded: int = 0
    observations: int = 0
    tokens: int = 0  # visual tokens the encoder appended to its own cache (VLM path)
    errors: int = 0
    last_lag_s: float | None = None  # capture timestamp -> observation in the cache
    max_lag_s: float = 0.0

    def public(self) -> dict:
        out = {k: getattr(self, k) for k in self.__slots__ if k not in ("last_lag_s", "max_lag_s")}
        out["lag_ms"] = round(self.last_lag_s * 1000, 1) if self.last_lag_s is not None else None
        out["max_lag_ms"] = round(self.max_lag_s * 1000, 1)
        return out


class VideoIngest:
    """The video (and still image) input of one session.

    Threads: `feed()` runs on the caller's thread (the event loop) and chains the piece after
    the one before it: when that one is done, the piece's bytes go into the open container's
    decoder pipe (from the thread that finished it: the loop, or the decoder's own), or a
    picture is decoded on `run` (the stream's thread). The decoder's thread offers each frame
    it decodes to the newest-frame slot; the newest frame is encoded at once if nothing is in
    flight, on the same thread. Observations are appended to the session with a `then=`
    callback (a VLM encoder hands its frame to the engine itself and the same callback goes on
    its future), so no thread waits on the engine: when the last one is in the cache, the
    callback (on the thread that resolved it: the event loop once the log has the change)
    hands the next waiting frame back to where frames come from (`_resume`: the decoder's
    thread between two reads, or `run` with no container open). While appends are in flight,
    newer frames replace the waiting one: the slot is the one backpressure point. `live=False`
    waits, on a condition, for the previous frame instead.
    """

    def __init__(self, engine, session_id: str, encoder: VisionEncoder, emit: Emit,
                 config: VideoConfig | None = None, run: Callable[[Callable[[], None]], object] | None = None,
                 later: Callable[[float, Callable[[], None]], None] | None = None) -> None:
        self.engine = engine
        self.session_id = session_id
        self.encoder = encoder
        self.emit = emit
        self.config = config or VideoConfig()
        if encoder.frame_side:  # the encoder wants frames of its own size (a VLM's resolution)
            self.config = replace(self.config, decode=replace(self.config.decode, max_side=encoder.frame_side))
        self.stats = VideoStats()
        self.sampler = FrameSampler(self.config.sample_fps, self.config.dup_threshold, self.config.heartbeat_s)
        self.slot = LatestSlot()
        self.decoder: VideoDecoder | None = None
        self.fmt: str | None = None  # format of the open container stream
        self.last_seq = -1
        self.ts0: float | None = None  # capture time of the session's first media: time 0
        self._offset = 0.0  # media time of the open container's start on the session's clock
        self._images = 0
        self._own = None if run is not None else ThreadPoolExecutor(1, thread_name_prefix=f"encode-{session_id}")
        self._run = run if run is not None else self._own.submit
        self._idle = threading.Condition()
        self._busy = False  # a frame is being encoded, or its observations are not all in the cache yet
        self._inflight = 0  # observations handed to the engine, not yet in its cache
        self._closed = False
        self._tail: Future | None = None  # the last piece taken: the next starts when it is done
        self._live = True  # the live flag of the piece being decoded
        self._later = later  # (seconds, fn): fn later on some thread; watches decoders for stalls

    # ---- feeder side (the caller's thread: the event loop; pieces in order, none waits) ------

    def feed(self, kind: str, fmt: str, payload: bytes, seq: int, ts: float, end: bool = False,
             live: bool = True) -> Future:
        """Take one media frame's payload without waiting: a future of the stream's counters
        (for `input.ack`), resolved once the piece's frames are taken. Each piece starts when
        the one before it is done (at once when it is), on the thread that finished that one: a
        container's bytes go straight into its decoder's pipe, a picture is decoded on `run`."""
        out: Future = Future()
        prev, self._tail = self._tail, out
        if prev is None:
            self._start(out, kind, fmt, payload, seq, ts, end, live)
        else:
            prev.add_done_callback(lambda _: self._start(out, kind, fmt, payload, seq, ts, end, live))
        return out

    def _start(self, out: Future, kind: str, fmt: str, payload: bytes, seq: int, ts: float, end: bool,
               live: bool) -> None:
        try:
            self._check_header(kind, fmt, seq)
        except MediaError as exc:
            settle(out, exc=exc)
            return
        self.last_seq = seq
        self.stats.pieces += 1
        self.stats.bytes += len(payload)
        if self.ts0 is None:
            self.ts0 = ts
        self._live = live
        try:
            if kind == "image":
                self._run(lambda: self._image(out, fmt, payload, ts))
            else:
                self._write(out, fmt, payload, ts, end)
        except MediaError as exc:
            self.stats.errors += 1
            settle(out, exc=exc)
        except Exception as exc:  # the stream's thread is gone (closing), or a bug: the piece fails
            settle(out, exc=exc)

    def _check_header(self, kind: str, fmt: str, seq: int) -> None:
        if self._closed:
            raise MediaHeaderInvalid(f"the video input of session {self.session_id} is closed")
        if seq <= self.last_seq:
            raise MediaHeaderInvalid(f"media seq {seq} does not follow seq {self.last_seq} of this stream")
        if self.decoder is not None and (kind != "video" or fmt != self.fmt):
            raise MediaHeaderInvalid(f"a {self.fmt} video stream is open on session {self.session_id}; "
                                     f"got {kind}/{fmt} (send 'end' on the open stream first)")

    def _image(self, out: Future, fmt: str, payload: bytes, ts: float) -> None:
        """One picture (on `run`, the stream's thread): decoded, then offered like a frame."""
        try:
            frames = [decode_image(fmt, payload, ts, self._images, self.config.decode)] if payload else []
        except MediaError as exc:
            self.stats.errors += 1
            settle(out, exc=exc)
            return
        for f in frames:
            f.pts = ts - self.ts0
        self._images += len(frames)
        try:
            self._offer(frames, self._live)
        except Exception as exc:
            settle(out, exc=exc)
            return
        settle(out, self.stats.public())

    def _write(self, out: Future, fmt: str, payload: bytes, ts: float, end: bool) -> None:
        """A container's piece into its decoder's pipe. The decoder's thread hands each frame to
        `_decoded` as it comes out, then calls `_used` once the piece is used up."""
        if self.decoder is None:
            self.decoder = VideoDecoder(fmt, ts, self.config.decode, on_frame=self._decoded)
            self.fmt = fmt
            self._offset = ts - self.ts0
        decoder = self.decoder

        def used() -> None:
            self._used(out, decoder, end)

        if end:
            decoder.end(payload, used)
        elif payload:
            decoder.write(payload, used)
        else:
            used()
            return
        if self._later is not None:
            decoder.watch(out.done, self._later)

    def _decoded(self, frame: Frame) -> None:
        """One decoded frame (on the decoder's thread): on the session's clock, then offered."""
        frame.pts += self._offset
        self.stats.decoded += 1
        self._offer([frame], self._live)

    def _used(self, out: Future, decoder: VideoDecoder, end: bool) -> None:
        """The decoder used the piece up (its frames were offered), finished, or failed."""
        if end or decoder.failed:
            if self.decoder is decoder:
                self.decoder, self.fmt = None, None
            if decoder.failed:
                decoder.close()
                self.stats.errors += 1
                try:
                    decoder.check()
                except MediaError as exc:
                    settle(out, exc=exc)
                    return
        settle(out, self.stats.public())

    def _offer(self, frames: list[Frame], live: bool) -> None:
        kept = self.sampler.filter(frames)
        s = self.sampler.stats
        self.stats.sampled, self.stats.duplicates = s.sampled, s.duplicates
        for frame in kept:
            if not live:
                self._wait_turn()
            self.slot.put(frame)
            self._pump()  # an idle encoder takes each frame now: only a busy one lets the next replace it
        self.stats.dropped = self.slot.dropped

    def _wait_turn(self) -> None:
        """`live=False`: wait until the previous frame is in the cache; a frame left waiting by
        an earlier live piece is encoded here first (the hand-back of `_resume` may be queued
        behind this very wait, on this thread)."""
        while True:
            with self._idle:
                self._idle.wait_for(lambda: not self._busy)
                if not self.slot.pending:
                    return
            self._pump()

    # ---- encoding (one frame at a time, on whichever thread finds the encoder free) ------------

    def _pump(self) -> None:
        """Encode the waiting frame if the encoder is free; frames encoded into no text go on
        to the next waiting frame at once."""
        while True:
            with self._idle:
                if self._busy:
                    return
                frame = self.slot.get(timeout=0)
                if frame is None:
                    return
                self._busy = True
            self._encode(frame)
            with self._idle:
                if self._inflight:
                    return  # the last append's callback frees the encoder
                self._busy = False
                self._idle.notify_all()

    def _encode(self, frame: Frame) -> None:
        try:
            observations = self.encoder.encode([frame])
            self.stats.encoded += 1
        except (MediaError, EngineError) as exc:  # EngineError: the engine refused the frame (VL path)
            self.stats.errors += 1
            self._error(exc)
            return
        except Exception as exc:  # a bug in an encoder must not end the stream
            log.exception("encoding a frame failed on session %s", self.session_id)
            self.stats.errors += 1
            self._error(MediaError(f"encoding frame {frame.index} failed: {type(exc).__name__}: {exc}"))
            return
        for obs in observations:
            self._deliver(obs)

    def _deliver(self, obs: Observation) -> None:
        payload = {"start_s": round(obs.start_s, 3), "end_s": round(obs.end_s, 3), "capture_ts": obs.ts,
                   "text": obs.text, "events": obs.events or None, "frames": obs.frames,
                   "visual_tokens": obs.tokens or None, "encoder": self.encoder.name}
        if obs.pending is not None:  # the encoder handed the frame to the engine itself (VLM)
            with self._idle:
                self._inflight += 1
            obs.pending.add_done_callback(lambda f: self._appended(obs, payload, f))
            return
        if not (obs.text and self.encoder.appends_text):
            self._observed(obs, payload)
            return
        with self._idle:
            self._inflight += 1
        try:
            self.engine.append(self.session_id, obs.text, then=lambda f: self._appended(obs, payload, f))
        except Exception as exc:  # the engine refused synchronously (it is stopping)
            self._appended(obs, payload, _failed(exc))

    def _appended(self, obs: Observation, payload: dict, f) -> None:
        """An observation's append (a line, or a frame the encoder handed on) finished: on the
        thread that resolved it (the event loop once logged, the engine's on a bare engine), or
        inline when refused."""
        exc = None if not f.cancelled() else MediaError("the append was cancelled")
        exc = exc or f.exception()
        if exc is not None:  # EngineError (context, budget, closed, the frame's blob not stored)
            self.stats.errors += 1
            self._error(exc)
        else:
            result = f.result()
            payload.update(seq=result.seq, tokens=result.tokens, total_tokens=result.total_tokens,
                           data_version=result.data_version, events=obs.events or None)
            self._observed(obs, payload)
        with self._idle:
            self._inflight -= 1
            if self._inflight:
                return
            self._busy = False
            self._idle.notify_all()
            more = self.slot.pending and not self._closed
        if more:
            self._resume(self._pump)

    def _resume(self, fn: Callable[[], None]) -> None:
        """Run `fn` where the frames come from: the open container's decoder thread (between two
        reads), or, with none open, `run` (the stream's thread)."""
        decoder = self.decoder
        if decoder is not None and decoder.call(fn):
            return
        try:
            self._run(fn)
        except RuntimeError:  # the stream's thread is shutting down
            pass

    def _observed(self, obs: Observation, payload: dict) -> None:
        self.stats.tokens += obs.tokens
        self.stats.observations += 1
        lag = max(0.0, time.time() - obs.ts)
        self.stats.last_lag_s, self.stats.max_lag_s = lag, max(self.stats.max_lag_s, lag)
        payload["lag_ms"] = round(lag * 1000, 1)
        self.emit("media.observation", payload)

    def _error(self, exc: BaseException) -> None:
        code = getattr(exc, "code", "media_error")
        self.emit("error", {"error": {"code": code, "message": str(exc) or type(exc).__name__,
                                      "recoverable": getattr(exc, "recoverable", True)}})

    # ---- control ---------------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no frame waits and every observation made is in the cache."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._busy and not self.slot.pending, timeout)

    def state(self) -> dict:
        return {"stream": self.fmt, "last_seq": self.last_seq, **self.stats.public(),
                **self.encoder.state()}

    def close(self) -> None:
        """The stream ends: the waiting frame is encoded, what the encoder holds back is flushed
        (its observations are appended), and the encoder is released."""
        self._closed = True
        if self.decoder is not None:
            self.decoder.close()
        self._pump()
        self.wait_idle(self.config.append_timeout_s)
        try:
            for obs in self.encoder.finish():
                self._deliver(obs)
        except Exception:
            log.exception("encoder finish failed on session %s", self.session_id)
        finally:
            self.encoder.close()
            self.slot.close()
            if self._own is not None:
                self._own.shutdown(wait=False)


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_exception(exc)
    return fut


class AudioIngest:
    """The audio input of one session: `streamer.vision.audio.AudioStream` (decode, resample to
    16 kHz mono, voice activity, incremental transcription) and its `TranscriptSink` (partials
    revise their segment's chunk, finals replace it), fed one piece at a time."""

    def __init__(self, engine, session_id: str, emit: Emit, options: dict | None = None) -> None:
        from .audio import TranscriptSink  # PyAV and the ASR packages: the 'media' extra

        self.engine = engine
        self.session_id = session_id
        self.emit = emit
        self.options = dict(options or {})
        self.sink = TranscriptSink(engine, session_id)
        self.stream = None
        self.fmt: str | None = None
        self.rate: tuple[int | None, int | None] = (None, None)
        self.last_seq = -1
        self.pieces = self.bytes = self.transcripts = self.errors = 0
        self.write_errors = 0  # transcripts the engine refused (counted on the engine thread)
        self._closed = False

    def feed(self, fmt: str, payload: bytes, seq: int, ts: float, sample_rate: int | None = None,
             channels: int | None = None, end: bool = False) -> dict:
        from .audio import AudioStream

        if self._closed:
            raise MediaHeaderInvalid(f"the audio input of session {self.session_id} is closed")
        if seq <= self.last_seq:
            raise MediaHeaderInvalid(f"media seq {seq} does not follow seq {self.last_seq} of this stream")
        if self.stream is not None and (fmt != self.fmt or (fmt == "pcm_s16le" and (sample_rate, channels) != self.rate)):
            raise MediaHeaderInvalid(
                f"an audio stream ({self.fmt}, rate {self.rate[0]}, channels {self.rate[1]}) is open on session "
                f"{self.session_id}; got {fmt} rate {sample_rate} channels {channels} (send 'end' first)")
        self.last_seq = seq
        self.pieces += 1
        self.bytes += len(payload)
        if self.stream is None:
            self.stream = AudioStream(fmt, sample_rate=sample_rate, channels=channels, **self.options)
            self.fmt, self.rate = fmt, (sample_rate, channels)
        stream = self.stream
        try:
            transcripts = stream.feed(payload, ts) if payload else []
            if end:
                transcripts += stream.finish()
        except (MediaDecodeError, MediaTooLarge) as exc:
            # Damaged or oversized bytes: the stream resynchronises itself (Ogg pages, PCM
            # frames), keeps what it heard and hands held-back transcripts to the next call,
            # so it stays open. At the end, the finals still come out before the error goes.
            self.errors += 1
            if end:
                self.stream, self.fmt = None, None
                try:
                    for t in stream.finish():
                        self._apply(t)
                except MediaError:
                    pass
            raise exc
        except MediaError:  # the stream itself is unusable (unsupported, mismatched): start over
            self.errors += 1
            self.stream, self.fmt = None, None
            raise
        if end:
            self.stream, self.fmt = None, None
        for t in transcripts:
            self._apply(t)
        return self.counters()

    def _apply(self, transcript) -> None:
        """Hand one transcript to the sink; its event goes out once the engine has written it."""

        def written(f) -> None:  # engine thread
            exc = None if f.cancelled() else f.exception()
            if f.cancelled() or exc is not None:
                self.write_errors += 1
                if exc is not None:
                    self.emit("error", {"error": {"code": getattr(exc, "code", "media_error"), "message": str(exc),
                                                  "recoverable": getattr(exc, "recoverable", True)}})
                return
            result = f.result()
            self.transcripts += 1
            self.emit("media.transcript", {
                "text": transcript.text, "start_s": round(transcript.start_s, 3), "end_s": round(transcript.end_s, 3),
                "final": transcript.final, "segment": transcript.segment,
                "seq": getattr(result, "seq", None), "data_version": getattr(result, "data_version", None)})

        self.sink.apply(transcript, then=written)

    def counters(self) -> dict:
        return {"pieces": self.pieces, "bytes": self.bytes, "transcripts": self.transcripts,
                "errors": self.errors + self.write_errors}

    def state(self) -> dict:
        return {"stream": self.fmt, "last_seq": self.last_seq, **self.counters()}

    def close(self) -> None:
        self._closed = True
        self.stream = None
