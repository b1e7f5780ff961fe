"""Transcripts into a session: partials revise their segment's chunk in place, finals settle it.

Each segment becomes one input chunk of the session, stamped with its time range:

    "[12.0-14.5s] heard: the quick brown fox\n"

The first transcript of a segment is appended. Later ones (partials, then the final) revise
that chunk, which crops the cache to the longest common token prefix and prefills the rest; so a
segment's partials followed by its final leave the session exactly as if only the final had been
appended. A final with no text deletes its segment's partial chunk; a final with no partial
before it is a plain append.

A revise replaces every chunk from the given seq on, so a segment's chunk is revised only while
it is still the session's last input. Once something else has landed after it (say a video
observation), the partial chunk stays as it is (labelled partial) and the segment's next
transcript is appended after the newer input instead of deleting it.

Which of the two happens is decided by the engine when the transcript's turn comes
(`Engine.transcribe`, sessions/jobs.py: SegmentJob), so the sink never waits: `apply` returns
the engine's future at once, and a stream's transcripts are written in the order they came.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

from .asr import Transcript

log = logging.getLogger(__name__)


class TranscriptSink:
    """Applies one audio stream's transcripts to a session through the engine."""

    def __init__(self, engine, session_id: str, origin: float = 0.0, label: str = "heard") -> None:
        self.engine, self.session_id = engine, session_id
        self.origin = origin  # subtracted from transcript times when stamping (a shared media clock)
        self.label = label
        self.stream = f"{id(self):x}"  # segment keys are this sink's own
        self.stats = {"appends": 0, "revises": 0, "frozen_partials": 0}

    def text(self, t: Transcript) -> str:
        """The chunk text of a transcript: its time range, the label, the words."""
        kind = self.label if t.final else f"{self.label} (partial)"
        return f"[{t.start_s - self.origin:.1f}-{t.end_s - self.origin:.1f}s] {kind}: {t.text}\n"

    def apply_all(self, transcripts: list[Transcript]) -> list[Future]:
        """Write transcripts in order; the engine's futures (one per transcript)."""
        return [self.apply(t) for t in transcripts]

    def apply(self, t: Transcript, then: Callable[[Future], None] | None = None) -> Future:
        """Write one transcript; the future resolves to the engine's AppendResult, or None when
        there was nothing to write. `then` runs when it is written (on the engine thread)."""

        def count(f: Future) -> None:
            result = None if f.cancelled() or f.exception() is not None else f.result()
            if result is not None:
                self.stats["revises" if result.replaced_seqs else "appends"] += 1
                self.stats["frozen_partials"] += result.frozen_partial
                if result.replaced_seqs and len(result.replaced_seqs) > 1:
                    log.warning("session %s: revising a transcript replaced inputs %s", self.session_id,
                                result.replaced_seqs)
            if then is not None:
                then(f)

        return self.engine.transcribe(self.session_id, f"{self.stream}:{t.segment}", self.text(t) if t.text else "",
                                      t.final, then=count)
