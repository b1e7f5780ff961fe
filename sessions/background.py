"""A session's idle-time work: reasoning units and flash evaluations, and the rule they share.

The rule (docs/protocol.md, "Flash queries"): a session runs at most one of them at a time (a
unit may drop notes a flash fork reads, and a flash fork reads the notes), and when both are
due they take turns: the one that did not run last goes first. So neither can starve the
other: with a steady feed and dual thinking, every flash question is evaluated at least once
per two background jobs of its session. Before choosing, questions that are too far behind
their data are marked stale (`flash.stale`), and a stale question no longer waits for the
input queue to drain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import flash, thinking

if TYPE_CHECKING:
    from .engine import EngineCore
    from .session import Session

KINDS = ("flash", "think")


def start(core: EngineCore) -> None:
    """Queue the idle-time work that is due, one job per session at most."""
    limits = core.limits
    for session in core.sessions.values():
        if session.flash.questions:
            flash.check_stale(session, limits.flash_stale_versions, limits.flash_stale_s)
        first = session.idle_turn
        for kind in (first, *(k for k in KINDS if k != first)):
            job = _next(core, session, kind)
            if job is None:
                continue
            core.lanes.submit(job)
            if kind == "flash":
                core.stats.flash_evaluations += 1
            session.idle_turn = "think" if kind == "flash" else "flash"
            break


def adopt(session: Session, turn: str) -> None:
    """A handed-off session's turn between flash and thinking (sessions/handoff.py)."""
    session.idle_turn = turn


def _next(core: EngineCore, session, kind: str):
    if kind == "flash":
        if core.lanes.running(session.id, "flash"):
            return None
        return flash.next_evaluation(session, core.lanes, core.stop_ids)
    return thinking.next_unit(session, core.lanes, core.stop_ids)


def next_wakeup(session, limits) -> float | None:
    """Seconds until timed work of the session is due: a flash interval, or a question crossing
    the staleness limit in time."""
    waits = [w for w in (flash.next_due_s(session), flash.next_stale_s(session, limits.flash_stale_s))
             if w is not None]
    return min(waits, default=None)
