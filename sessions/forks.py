"""Where a fork reads: the one answer for questions, flash evaluations and reasoning units.

A fork (a `QueryJob`, a `FlashJob`'s questions) never writes the session's caches it reads: it
sees the reading cache up to its committed length and, with dual thinking, the notes, and its
own tokens take the positions after both streams (on a VL model the reading cache's next
position, which may be below its length: sessions/multimodal.py). A reasoning unit reads the
reading cache as it is when the unit starts and writes its notes after its next position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .session import Session


@dataclass(frozen=True, slots=True)
class ForkView:
    """What a fork of a session reads, and from which position it writes."""

    prefixes: tuple  # ((cache, length), ...): the reading cache, then the dual notes if there are any
    base: int  # the reading cache's committed length when the fork starts
    reading_position: int  # the reading cache's next position (what a reasoning unit's notes follow)
    position: int  # the fork's first position: the reading cache's next one, or past the last note
    notes_end: int | None  # the position after the last note (dual thinking with notes), else None

    @property
    def notes(self) -> bool:
        """Whether the fork reads the dual thinking notes too."""
        return self.notes_end is not None


def fork_view(session: Session) -> ForkView:
    """Where a fork of `session` reads now, and from which position."""
    base = session.cache.length
    thinking = session.thinking
    if thinking is not None and thinking.cache is not None and thinking.cache.length:
        notes_end = thinking.last_position + 1
        return ForkView(((session.cache, base), (thinking.cache, thinking.cache.length)), base,
                        session.next_position, max(session.next_position, notes_end), notes_end)
    return ForkView(((session.cache, base),), base, session.next_position, session.next_position, None)
