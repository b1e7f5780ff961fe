"""Streaming speech recognition: audio bytes in pieces -> timestamped transcripts.

    AudioStream(fmt, sample_rate, channels)     one session's audio input
      feed(payload, ts) -> [Transcript]         decode (asr_decode) -> 16 kHz mono
                                                -> voice activity per 32 ms window (asr)
                                                -> segments -> transcriber (asr)
      finish() -> [Transcript]                  end of stream: close the open segment

While a segment is open, a partial transcript of everything heard so far in it goes out every
`partial_every_s` of new speech (`final=False`); when the speaker pauses for `min_silence_s`
(or the segment reaches `max_segment_s`) the segment's final transcript goes out
(`final=True`). Partials and the final of a segment share its `segment` number, so a consumer
revises the segment's text in place (vision/asr_sink.py does so on a session).

Times: a transcript's `start_s`/`end_s` are media time, seconds since the stream's first
sample, and its `ts` is the capture time of its start on the sender's clock (the first piece's
`ts` plus the samples decoded since). A forward jump of `ts` beyond `max_gap_s` re-anchors the
clock (audio was lost or paused), and media time jumps with it.

Errors are MediaErrors (the session survives them): a bad piece raises after every good byte
in it was used, and transcripts made before the error are returned by the next call, so
nothing already heard is lost. Feed from a worker thread: transcription takes real time.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from .asr import WINDOW, Transcriber, Transcript, VoiceActivity
from .asr_decode import RATE, make_decoder, take
from .errors import MediaDecodeError, MediaHeaderInvalid, MediaTooLarge

__all__ = ["AudioStream", "Transcript", "TranscriptSink"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Segment:
    """The open segment: its audio and where it started."""

    number: int
    start_s: float
    audio: list[np.ndarray]
    samples: int = 0
    silence: int = 0  # trailing windows below the speech threshold
    speech: int = 0  # windows at or above it
    partial_at: int = 0  # samples when the last partial was made

    def add(self, window: np.ndarray) -> None:
        self.audio.append(window)
        self.samples += len(window)

    def pcm(self, trim: int = 0) -> np.ndarray:
        x = np.concatenate(self.audio)
        return x[:len(x) - trim] if trim else x


class AudioStream:
    """One session's audio: decode, segment by voice activity, transcribe incrementally.

    Limits (keyword arguments, with their defaults):
      max_payload_bytes  1 MiB per piece (MediaTooLarge beyond; the piece is dropped)
      threshold          0.5: a window with speech probability at or above it is speech;
                         one below `threshold - 0.15` is silence (hysteresis)
      min_silence_s      0.5 s of silence closes a segment
      min_speech_s       0.25 s: shorter segments are noise, dropped untranscribed
      max_segment_s      20 s: a segment is cut there (Whisper reads at most 30 s)
      pad_s              0.2 s of audio kept before a segment's first speech and after its last
      partial_every_s    1.0 s of new audio between partial transcripts (0: finals only)
      partial_share      0.5: partials may use at most this share of real time; when
                         transcription is slower the interval between partials grows
      max_gap_s          1.0: a `ts` that far ahead of the sample clock re-anchors it
    """

    def __init__(self, fmt: str, sample_rate: int | None = None, channels: int | None = None,
                 transcriber: Transcriber | None = None, vad: VoiceActivity | None = None, *,
                 max_payload_bytes: int = 1 << 20, threshold: float = 0.5, min_silence_s: float = 0.5,
                 min_speech_s: float = 0.25, max_segment_s: float = 20.0, pad_s: float = 0.2,
                 partial_every_s: float = 1.0, partial_share: float = 0.5, max_gap_s: float = 1.0) -> None:
        if not 0 < threshold < 1 or not 0 < max_segment_s <= 30 or min(min_silence_s, min_speech_s, pad_s,
                                                                       partial_every_s, max_gap_s) < 0:
            raise ValueError(f"bad AudioStream limits: threshold {threshold} must be in (0, 1), max_segment_s "
                             f"{max_segment_s} in (0, 30] (Whisper's window), durations >= 0")
        if partial_share <= 0:
            raise ValueError(f"partial_share must be > 0, got {partial_share}")
        self.fmt, self.sample_rate, self.channels = fmt, sample_rate, channels
        self.decoder = make_decoder(fmt, sample_rate, channels)
        if transcriber is None:
            from .asr import FasterWhisperTranscriber

            transcriber = FasterWhisperTranscriber()
        if vad is None:
            from .asr import default_vad

            vad = default_vad()
        self.transcriber, self.vad = transcriber, vad
        self.max_payload_bytes = max_payload_bytes
        self.threshold, self.neg_threshold = threshold, max(threshold - 0.15, 0.01)
        self.min_silence = round(min_silence_s * RATE / WINDOW)
        self.min_speech = round(min_speech_s * RATE / WINDOW)
        self.max_segment = round(max_segment_s * RATE)
        self.pad = round(pad_s * RATE / WINDOW)
        self.partial_every = round(partial_every_s * RATE)
        self.partial_share = partial_share
        self._cost_s = 0.0  # how long the last transcription took
        self.max_gap_s = max_gap_s
        self._preroll: deque[np.ndarray] = deque(maxlen=max(self.pad, 1))
        self._rest = np.zeros(0, np.float32)  # samples short of a whole window
        self._segment: Segment | None = None
        self._segments = 0
        self._out: list[Transcript] = []  # made but not yet returned (an error came first)
        self._origin: float | None = None  # sender-clock time of sample 0 (moves on re-anchoring)
        self._first: float | None = None  # sender-clock time of the stream's first sample
        self.samples = 0  # samples consumed by the segmenter (16 kHz)
        self.ended = False
        self.stats = {"pieces": 0, "bytes": 0, "audio_s": 0.0, "segments": 0, "partials": 0, "finals": 0,
                      "errors": 0, "dropped_segments": 0}

    def check_header(self, fmt: str, sample_rate: int | None, channels: int | None) -> None:
        """A later piece must describe the same stream as the first."""
        if fmt != self.fmt or (fmt == "pcm_s16le" and (sample_rate, channels) != (self.sample_rate, self.channels)):
            raise MediaHeaderInvalid(
                f"audio piece says {fmt} {sample_rate} Hz x {channels}, but this stream is {self.fmt}"
                + (f" {self.sample_rate} Hz x {self.channels}" if self.fmt == "pcm_s16le" else ""))

    def feed(self, payload: bytes, ts: float | None = None) -> list[Transcript]:
        """Decode a piece; transcripts it completed (and any held back by an earlier error)."""
        if self.ended:
            raise MediaDecodeError("the audio stream has already ended; start a new one for more audio")
        if len(payload) > self.max_payload_bytes:
            self.stats["errors"] += 1
            raise MediaTooLarge(f"audio piece of {len(payload)} bytes exceeds the limit of "
                                f"{self.max_payload_bytes} bytes; it was dropped")
        self.stats["pieces"] += 1
        self.stats["bytes"] += len(payload)
        self._anchor(ts)
        return self._run(lambda: self.decoder.feed(payload))

    def finish(self) -> list[Transcript]:
        """End of stream: decode what is left and close the open segment."""
        if self.ended:
            return self._drain()
        self.ended = True
        return self._run(self.decoder.finish, last=True)

    def state(self) -> dict:
        """Counters, and how much audio is held (bounded by max_segment_s + pad_s + one window)."""
        held = len(self._rest) + WINDOW * len(self._preroll) + (self._segment.samples if self._segment else 0)
        return {"format": self.fmt, "samples": self.samples, "open_segment": self._segment is not None,
                "buffered_s": round(held / RATE, 3), **self.stats}

    def _run(self, decode, last: bool = False) -> list[Transcript]:
        try:
            decode()
        except Exception:
            self.stats["errors"] += 1
            self._consume(take(self.decoder), last)  # what was good before the error still counts
            raise
        self._consume(take(self.decoder), last)
        return self._drain()

    def _drain(self) -> list[Transcript]:
        out, self._out = self._out, []
        return out

    def _anchor(self, ts: float | None) -> None:
        if ts is None:
            if self._origin is None:
                self._origin = self._first = 0.0
            return
        if self._origin is None:
            self._origin = self._first = ts
        elif ts - self._clock(self.samples + len(self._rest)) > self.max_gap_s:
            log.info("audio clock re-anchored: ts %.3f is %.3f s ahead", ts, ts - self._clock(self.samples))
            self._origin = ts - (self.samples + len(self._rest)) / RATE

    def _clock(self, sample: int) -> float:
        return (self._origin or 0.0) + sample / RATE

    def _consume(self, audio: np.ndarray, last: bool) -> None:
        self.stats["audio_s"] += len(audio) / RATE
        audio = np.concatenate([self._rest, audio]) if len(self._rest) else audio
        whole = len(audio) - len(audio) % WINDOW
        windows, self._rest = audio[:whole].reshape(-1, WINDOW), audio[whole:]
        probs = self.vad(windows) if len(windows) else np.zeros(0, np.float32)
        for window, prob in zip(windows, probs):
            self._window(window, float(prob))
            self.samples += WINDOW
        if self._segment is not None and self.partial_every and not last:
            seg = self._segment
            if self._partial_due(seg):
                seg.partial_at = seg.samples
                self._emit(seg, final=False)
        if last:
            if len(self._rest) and self._segment is not None:
                self._segment.add(self._rest)
            self._rest = np.zeros(0, np.float32)
            self._close()

    def _partial_due(self, seg: Segment) -> bool:
        """Enough new speech since the last partial, the speaker is not pausing (the final is
        near), and partials stay within their share of real time."""
        interval = max(self.partial_every, round(self._cost_s / self.partial_share * RATE))
        return (seg.samples - seg.partial_at >= interval and seg.speech >= self.min_speech
                and seg.silence <= self.pad)

    def _window(self, window: np.ndarray, prob: float) -> None:
        seg = self._segment
        if seg is None:
            if prob >= self.threshold:
                start = self.samples - WINDOW * len(self._preroll)
                self._segments += 1
                seg = self._segment = Segment(self._segments, self._clock(start), list(self._preroll))
                seg.samples = WINDOW * len(self._preroll)
                self._preroll.clear()
            else:
                self._preroll.append(window)
                return
        seg.add(window)
        if prob >= self.threshold or (seg.silence == 0 and prob >= self.neg_threshold):
            seg.speech += 1
            seg.silence = 0
        else:
            seg.silence += 1
        if seg.silence >= self.min_silence or seg.samples >= self.max_segment:
            self._close()

    def _close(self) -> None:
        seg, self._segment = self._segment, None
        if seg is None:
            return
        # keep `pad` windows of the trailing silence; the rest primes the next segment's pre-roll
        extra = max(0, seg.silence - self.pad)
        for window in seg.audio[len(seg.audio) - extra:] if extra else []:
            self._preroll.append(window)
        if seg.speech < self.min_speech:
            self.stats["dropped_segments"] += 1
            return
        self._emit(seg, final=True, trim=extra * WINDOW)

    def _emit(self, seg: Segment, final: bool, trim: int = 0) -> None:
        audio = seg.pcm(trim)
        began = time.perf_counter()
        text = self.transcriber.transcribe(audio)
        self._cost_s = time.perf_counter() - began
        start = seg.start_s - (self._first or 0.0)
        self.stats["finals" if final else "partials"] += 1
        self.stats["segments"] += final
        if text or final:
            self._out.append(Transcript(text, round(start, 3), round(start + len(audio) / RATE, 3), final,
                                        seg.number, seg.start_s))


from .asr_sink import TranscriptSink
