"""The vision-encoder interface: what turns sampled frames into session input.

The video pipeline (vision/video.py) decodes a container that arrives in pieces, samples frames
to a target rate, skips near-duplicates and drops stale frames when the engine is behind; what
is left goes, in order, to one `VisionEncoder` per media stream. Two implementations:

- `FrameDescriber` (vision/describe.py, the embedded default): no weights; each frame becomes a
  timestamped text observation (scene cut, motion level, dominant colours, brightness) that the
  caller appends to the session's text model (`Observation.text`).
- the engine's VLM (vision/vlm.py `EngineFrameEncoder`): each frame, patched, is handed to the
  engine, whose job runs the vision tower and reads the embeddings into the session's own
  reading cache (3-D M-RoPE positions continuing chunk to chunk); it reports the visual tokens
  (`Observation.tokens`) at once and the engine's future (`Observation.pending`), whose
  resolution fills in the engine's result (`Observation.appended`).

An encoder is stateful (it remembers the previous frame, or owns a cache) and is used from one
thread at a time. This module imports nothing heavy: numpy arrays are the frame currency.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(slots=True)
class Frame:
    """One decoded picture.

    `image` is RGB uint8 of shape [height, width, 3] (C-contiguous). `pts` is its presentation
    time in seconds from the start of its media stream; `ts` is its capture time on the
    sender's clock (the binary header's `ts` of the stream's first piece plus `pts`, or the
    header `ts` itself for a single image). `index` counts decoded frames of the stream (before
    sampling), so gaps show what sampling, dedup and newest-frame-wins skipped. `still`: a
    single picture (an image frame), not a frame of a video stream.
    """

    image: np.ndarray
    pts: float
    ts: float
    index: int
    still: bool = False

    @property
    def height(self) -> int:
        return int(self.image.shape[0])

    @property
    def width(self) -> int:
        return int(self.image.shape[1])


@dataclass(slots=True)
class Observation:
    """What an encoder made of one or more frames, stamped with the media time they cover.

    `text`: a line for the session's text model (appended by the caller), or None when the
    encoder wrote to a cache of its own. `tokens`: visual tokens the encoder appended to its own
    cache (0 for text-only encoders). `frames`: indices of the frames this covers.
    `events`: machine-readable tags (for instance "scene_cut") for tests and session state.
    """

    start_s: float
    end_s: float
    ts: float
    text: str | None = None
    tokens: int = 0
    frames: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    appended: object = None  # the engine's AppendResult when the encoder put the frame into the session's cache
    pending: object = None  # a Future of that AppendResult while the engine reads the frame (the
    #   caller counts the observation in flight until it resolves; `appended` is set by then)


class VisionEncoder(ABC):
    """Turns frames into session input. One instance per media stream of a session.

    Contract:
    - `encode(frames)` takes frames in increasing `pts` order (never a frame twice) and returns
      the observations they produced, possibly none (an encoder may hold a frame back to
      compare it with the next one, or fold quiet frames into one line); it never waits on the
      engine: an observation the engine still has to read carries its future (`pending`);
    - `finish()` flushes whatever is held back at the end of the stream;
    - errors are `streamer.vision.errors.MediaError` subclasses (for instance `MediaTooLarge`
      for a frame over `max_pixels`); after one, the encoder still takes further frames;
    - `appends_text` says whether observations carry text the caller must append to the text
      session (the describer) or the encoder ingests on its own (the VLM path).
    """

    name: str = "encoder"
    appends_text: bool = True
    max_pixels: int = 4096 * 4096
    frame_side: int | None = None  # longer side the decoder should scale frames to (None: its default)

    @abstractmethod
    def encode(self, frames: Sequence[Frame]) -> list[Observation]:
        """Ingest frames (in pts order); return what they produced."""

    def finish(self) -> list[Observation]:
        """The stream ended: flush what is held back."""
        return []

    def state(self) -> dict:
        """A small JSON-able summary for session state (frames seen, tokens, window...)."""
        return {"encoder": self.name}

    def close(self) -> None:
        """Release what the encoder holds (caches, model references)."""
