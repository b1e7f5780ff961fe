"""Rebuild a session from its event log (DESIGN invariant 4).

The log holds, in the order the engine applied them, the session's creation (system prompt,
flash questions with their ids, thinking and window settings) and every accepted change after
it: appends, revises, input.end, flash registrations and removals, setting updates, as typed
records (streamer.records). Replaying them through the same engine calls, in the same order,
gives the same token ids at the same positions (each chunk is tokenized on its own), hence the
same caches, the same seq numbers and the same greedy answers. Each replayed input's seq is
checked against the logged one where the log has it (inputs logged before they were applied
have none; one the engine refused then is refused again and skipped; `void` records, and the
records they cancel, replay as nothing: see `applied` and streamer.eventlog).

Checkpoints (sessions/checkpoint.py, `checkpoint` records) bound the work: replay runs the
creation, restores the last checkpoint (the window's inputs, clocks, notes, flash answers and
its K/V from a blob) and replays only the records after it, so recovery costs a window.

Not replayed: action rules and running action policies (they are not logged; a client that
resumes re-sends them), reasoning written by `interleaved` thinking (it is regenerated, so the
reading cache of an interleaved session matches only if the reasoning does).
"""

from __future__ import annotations

import asyncio
import logging

from streamer.sessions.errors import Code, EngineError

from .records import Create, Record, ReplayError, load_blobs

log = logging.getLogger(__name__)

# Refusals that depend only on the session's own inputs, never on the worker (its memory or
# limits): a record logged first and refused with one of these was refused live too. Any other
# refusal (kv_budget_exceeded, context_overflow on a smaller worker) fails the replay.
REFUSED_THE_SAME_EVERYWHERE = frozenset({Code.INPUT_ENDED, Code.INVALID_FIELD, Code.FLASH_NOT_FOUND,
                                         Code.MISSING_FIELD})


def applied(raw: list[dict]) -> list[dict]:
    """The stored records that took effect: without `void` records and the records they cancel
    (an input whose write timed out, was answered `store_unavailable` and landed after all,
    streamer.eventlog). The positions `n` stay as stored."""
    voided = {r.get("rid_of") for r in raw if r.get("kind") == "void"} - {None}
    return [r for r in raw if r.get("kind") != "void" and r.get("rid") not in voided]


def from_checkpoint(raw: list[dict]) -> list[dict]:
    """What replay runs: the creation, then the last checkpoint and what follows it (a log not
    compacted yet may still hold the records before that checkpoint: they are skipped)."""
    last = max((i for i, r in enumerate(raw) if r.get("kind") == "checkpoint"), default=None)
    if last is None or not raw:
        return raw
    return [raw[0], *raw[last:]] if raw[0].get("kind") == "create" else raw[last:]


def blobs_of(raw: list[dict]) -> set[str]:
    """The blobs the records name (frames and checkpoints)."""
    return {r["blob"] for r in raw if isinstance(r.get("blob"), str)}


def parse(raw: list[dict]) -> list[Record]:
    """The stored JSON records as typed records (ReplayError on an unknown or malformed one)."""
    return [Record.from_json(r) for r in raw]


async def replay(engine, session_id: str, raw: list[dict], store=None) -> dict:
    """Re-create `session_id` on `engine` from its log; resolves to the session's state. Video
    frames come back from their blobs in `store`."""
    records = parse(from_checkpoint(applied(raw)))
    await load_blobs(records, store)
    if not records or not isinstance(records[0], Create):
        raise ReplayError(f"the log of session {session_id} does not start with its creation")
    await asyncio.wrap_future(records[0].apply(engine, session_id))
    pending = [(record, record.apply(engine, session_id)) for record in records[1:]]
    for record, fut in pending:  # all queued in log order; the engine runs them in that order
        try:
            result = await asyncio.wrap_future(fut)
        except EngineError as exc:
            if record.first and exc.code in REFUSED_THE_SAME_EVERYWHERE:
                continue  # logged before it was applied, and refused then too: the same refusal
            raise ReplayError(f"replaying record {record.n} ({record.kind}) of session {session_id} "
                              f"failed: {exc.message}") from exc
        record.check(result)
    state = await asyncio.wrap_future(engine.session_state(session_id))
    log.info("session %s replayed from %d log records (%d tokens)", session_id, len(records), state["tokens"])
    return state


async def restore(engine, store, session_id: str) -> dict:
    """Re-create `session_id` on `engine` from what `store` holds: its creation, its last
    checkpoint and the records after it (the entry point for recovery, adoption and handoff;
    ownership and tokens are the caller's). Resolves to {state, records, raw}."""
    raw = await store.read_log(session_id)
    state = await replay(engine, session_id, raw, store)
    return {"state": state, "records": len(from_checkpoint(applied(raw))), "raw": raw}
