"""Transcripts into a session: partials revise their segment's chunk in place, finals settle it.

Each segment becomes one input chunk of the session, stamped with its time range:

    "[12.0-14.5s] heard: the quick brown fox\n"

The first transcript of a segment is appended. Later ones (partials, then the final) revise
that chunk (`Engine.revise` from the chunk's seq), which crops the cache to the longest common
token prefix and prefills the rest; so a segment's partials followed by its final leave the
session exactly as if only the final had been appended. A final with no text deletes its
segment's partial chunk; a final with no partial before it is a plain append.

A revise replaces every chunk from the given seq on, so the sink revises only while its chunk
is still the session's last input. Once something else has landed after it (say a video
observation), the partial chunk stays as it is (labelled partial) and the segment's next
transcript is appended after the newer input instead of deleting it.

The sink waits for each engine future (it needs a chunk's seq to revise it later): call it
from the stream's worker thread, never from the event loop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from streamer.sessions.session import AppendResult

from .asr import Transcript

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Written:
    """The chunk that holds a segment's latest transcript."""

    segment: int
    seq: int


class TranscriptSink:
    """Applies one audio stream's transcripts to a session through the engine."""

    def __init__(self, engine, session_id: str, origin: float = 0.0, label: str = "heard",
                 timeout_s: float | None = 120.0) -> None:
        self.engine, self.session_id = engine, session_id
        self.origin = origin  # subtracted from transcript times when stamping (a shared media clock)
        self.label, self.timeout_s = label, timeout_s
        self._open: Written | None = None  # the segment whose chunk may still be revised
        self.stats = {"appends": 0, "revises": 0, "frozen_partials": 0}

    def text(self, t: Transcript) -> str:
        """The chunk text of a transcript: its time range, the label, the words."""
        kind = self.label if t.final else f"{self.label} (partial)"
        return f"[{t.start_s - self.origin:.1f}-{t.end_s - self.origin:.1f}s] {kind}: {t.text}\n"

    def apply_all(self, transcripts: list[Transcript]) -> list[AppendResult]:
        """Write transcripts in order; the engine's results (one per write)."""
        return [r for r in map(self.apply, transcripts) if r is not None]

    def apply(self, t: Transcript) -> AppendResult | None:
        """Write one transcript; the engine's result, or None when there was nothing to write
        (an empty transcript with no chunk of its segment to revise)."""
        written = self._open if self._open is not None and self._open.segment == t.segment else None
        if written is not None and not self._still_last(written.seq):
            self.stats["frozen_partials"] += 1
            written = None  # something landed after the partial: keep it, append after
        if written is None and not t.text:
            if t.final:
                self._open = None
            return None
        if written is None:
            result = self._wait(self.engine.append(self.session_id, self.text(t)))
            self.stats["appends"] += 1
        else:
            result = self._wait(self.engine.revise(self.session_id, self.text(t) if t.text else "", written.seq))
            self.stats["revises"] += 1
            if result.replaced_seqs != [written.seq]:  # input queued after the check was replaced too
                log.warning("session %s: revising transcript chunk %d replaced inputs %s",
                            self.session_id, written.seq, result.replaced_seqs)
        self._open = None if t.final else Written(t.segment, result.seq)
        return result

    def _still_last(self, seq: int) -> bool:
        state = self._wait(self.engine.session_state(self.session_id))
        return state["last_seq"] == seq

    def _wait(self, future):
        return future.result(timeout=self.timeout_s)
