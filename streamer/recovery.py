"""Rebuild a session from its event log (DESIGN invariant 4).

The log holds, in the order the engine applied them, the session's creation (system prompt,
flash questions with their ids, thinking settings) and every accepted change after it:
appends, revises, input.end, flash registrations and removals, thinking updates. Replaying
them through the same engine calls, in the same order, gives the same token ids at the same
positions (each chunk is tokenized on its own), hence the same caches, the same seq numbers
and the same greedy answers. Each replayed input's seq is checked against the logged one.

Not replayed: action rules and running action policies (they are not logged; a client that
resumes re-sends them), reasoning written by `interleaved` thinking (it is regenerated, so the
reading cache of an interleaved session matches only if the reasoning does).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future

from streamer.sessions.engine import Engine
from streamer.sessions.errors import EngineError

log = logging.getLogger(__name__)

FLASH_KEYS = ("question", "flash_id", "max_tokens", "priority", "min_interval_s", "confirm")


class ReplayError(EngineError):
    def __init__(self, message: str) -> None:
        super().__init__(message, code="replay_failed", recoverable=False)


def flash_record(args: dict, state: dict) -> dict:
    """A flash registration as logged: its arguments with the id the engine gave it."""
    return {**{k: v for k, v in args.items() if k in FLASH_KEYS}, "flash_id": state["flash_id"]}


async def replay(engine: Engine, session_id: str, records: list[dict]) -> dict:
    """Re-create `session_id` on `engine` from its log; resolves to the session's state."""
    if not records or records[0].get("kind") != "create":
        raise ReplayError(f"the log of session {session_id} does not start with its creation")
    first = records[0]
    await asyncio.wrap_future(engine.create_session(first.get("system_prompt"), session_id,
                                                    first.get("flash") or None, first.get("thinking")))
    if first.get("window"):
        await asyncio.wrap_future(engine.configure_window(session_id, **first["window"]))
    pending: list[tuple[dict, Future]] = []
    for record in records[1:]:
        fut = _apply(engine, session_id, record)
        if fut is not None:
            pending.append((record, fut))
    for record, fut in pending:  # all queued in log order; the engine runs them in that order
        try:
            result = await asyncio.wrap_future(fut)
        except EngineError as exc:
            raise ReplayError(f"replaying record {record.get('n')} ({record['kind']}) of session {session_id} "
                              f"failed: {exc.message}") from exc
        seq = getattr(result, "seq", None)
        if record["kind"] in ("append", "revise") and seq != record.get("seq"):
            raise ReplayError(f"record {record.get('n')} of session {session_id} replayed as seq {seq}, "
                              f"logged as seq {record.get('seq')}")
    state = await asyncio.wrap_future(engine.session_state(session_id))
    log.info("session %s replayed from %d log records (%d tokens)", session_id, len(records), state["tokens"])
    return state


def _apply(engine: Engine, sid: str, record: dict) -> Future | None:
    kind = record["kind"]
    if kind == "append":
        return engine.append(sid, record["text"])
    if kind == "revise":
        return engine.revise(sid, record["text"], record.get("from_seq"))
    if kind == "end":
        return engine.end_input(sid)
    if kind == "flash.register":
        return engine.register_flash(sid, **{k: record[k] for k in FLASH_KEYS if k in record})
    if kind == "flash.unregister":
        return engine.unregister_flash(sid, record["flash_id"])
    if kind == "update":
        if record.get("thinking") is not None:
            fut = engine.configure_thinking(sid, record["thinking"])
            if not record.get("window"):
                return fut
        return engine.configure_window(sid, **record["window"])
    if kind == "close":
        raise ReplayError(f"session {sid} was closed")
    raise ReplayError(f"unknown record kind {kind!r} in the log of session {sid}")


def client_seq_of(records: list[dict]) -> int:
    """The highest client seq the log holds (0: none): the client resends what is above it."""
    return max((r.get("client_seq") or 0 for r in records), default=0)
