"""Drain: a worker told to stop (SIGTERM, a rolling upgrade) hands its sessions over with their
KV cache instead of leaving them to be re-read.

The drain, within the server's grace period (`shutdown_grace_s`):

1. The worker stops taking new sessions: `/healthz` answers 503 `{"status": "draining"}` (a
   proxy stops routing here), `session.create` gets a `draining` error, and so does a
   `session.resume` of a session not live here (its client goes to another worker).
2. Connections that hold nothing (no session, subscription or command in flight) close at
   once (1001); every other one gets `server.draining` (`deadline_s`: the seconds left, the ids
   of the sessions it produces into): reconnect (through the proxy, or another worker), resume.
3. Commands already in flight finish; later ones are refused (`shutting_down`, resent by the
   SDKs after they resume elsewhere); questions still running near the deadline end
   (`finish_reason: "shutdown"`), as in a plain shutdown.
4. Each session, once its engine work is done, is exported (sessions.handoff) and closed here in
   one engine command, so nothing reaches it after its blob was made. The blob goes into the
   store's blobs (deleted once used, else kept for the retention time) at an address derived from the session id and
   the log's end at export (its record count and last record: `handoff_address`), and the
   session is released in the store's directory, with no `close` in its log.
5. The connections close (1001) and the server stops.

The worker that resumes the session next (`adopt`, from streamer.resume) looks the blob up at
the address of the log's end it reads, and imports it: the session's input is not read again
(`session.resumed.reprefill_tokens` is 0). A log that moved on since (another address), a blob
gone or one that does not fit (another model, say) falls back to the ordinary replay. A session that
cannot be exported before the deadline is left to replay too (counted as a failure).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from typing import TYPE_CHECKING

from streamer.sessions.handoff import HandoffError, export_session, import_session

from .connection import CLOSE_WAIT_S, going_away
from .metrics import DRAIN

if TYPE_CHECKING:
    from .server import StreamerServer

log = logging.getLogger(__name__)

SETTLE_S = 0.5  # after `server.draining`: commands the clients sent before they read it still run
EXPORT_RETRY_S = 0.02  # a session with engine work in flight is exported once that work is done
CLOSE_RESERVE_S = 1.5  # of the grace period, kept for closing the connections and stopping


def new_counters() -> dict:
    """The handoff counters (streamer.metrics.DRAIN says what each counts)."""
    return dict.fromkeys(DRAIN, 0)


def drains(server: StreamerServer) -> bool:
    """Whether SIGTERM drains this server: its store outlives it (file or Redis), so another (or
    a restarted) worker can take the sessions over."""
    return server.store.kind != "memory"


async def drain(server: StreamerServer, grace_s: float | None = None, reason: str = "the worker is shutting down") -> dict:
    """Hand every session over and stop (the steps above). Returns what it did, for the log."""
    grace_s = server.config.shutdown_grace_s if grace_s is None else grace_s
    start = time.monotonic()
    end = start + grace_s
    deadline = end - min(CLOSE_RESERVE_S, grace_s / 2)  # then the connections close and the server stops
    server.draining = server.resumer.draining = reason
    # connections with no session, subscription or work close at once: nothing of theirs moves
    idle = [c for c in server.connections if not (c.inflight or c.outbox.bytes or c.peer.sessions
                                                  or c.peer.subscriptions)]
    await going_away(idle, min(CLOSE_WAIT_S, grace_s))
    announce(server, end, reason)
    await _settle(server, min(deadline, time.monotonic() + SETTLE_S))
    server.shutting_down = True
    await _settle(server, deadline)
    answers = await server._end_answers()  # questions still running end now: their sessions can move
    await server.events.drain(timeout=max(0.1, deadline - time.monotonic()))
    moved = [await hand_off(server, sid, deadline) for sid in list(server.directory.sessions)]
    done = await server.shutdown(max(0.0, end - time.monotonic()))
    return {**done, "connections": done["connections"] + len(idle), "answers_ended": done["answers_ended"] + answers,
            "handed_off": sum(1 for b in moved if b), "not_handed_off": sum(1 for b in moved if not b),
            "drain_s": round(time.monotonic() - start, 3)}


def announce(server: StreamerServer, until: float, reason: str) -> None:
    """`server.draining` to every connection: the seconds left and its sessions."""
    left = round(max(0.0, until - time.monotonic()), 3)
    for conn in list(server.connections):
        conn.send(conn.proto.event("server.draining", deadline_s=left, reason=reason,
                                   worker=server.store.worker_id, sessions=sorted(conn.peer.sessions) or None))


async def _settle(server: StreamerServer, until: float) -> None:
    while any(c.inflight for c in server.connections) and time.monotonic() < until:
        await asyncio.sleep(0.02)


async def hand_off(server: StreamerServer, session_id: str, deadline: float) -> int:
    """Export `session_id` and close it here, store its blob and pointer, release it. Returns
    the blob's size, 0 when it could not be handed over (it stays here: stopping leaves its
    log to be replayed)."""
    counters = server.handoffs
    try:
        blob = await _export_and_close(server.engine, session_id, deadline)
    except Exception as exc:
        counters["handoff_failures"] += 1
        log.warning("session %s not handed over (it will be replayed): %s", session_id, exc)
        return 0
    server.directory.forget(session_id)
    # gone from here, not closed: its connection's end must not detach (and later close) it
    server.directory.moved(session_id, {"worker": None, "url": None, "alive": False, "handed_off": True})
    server.events.forget(session_id)
    if server.mqtt is not None:
        server.mqtt.detach(session_id)
    try:
        await _publish(server.store, session_id, blob)
    except Exception as exc:  # the log is intact: the next owner replays it
        counters["handoff_failures"] += 1
        log.warning("storing the handoff of session %s failed (it will be replayed): %s", session_id, exc)
        return 0
    counters["handoffs_exported"] += 1
    counters["handoff_bytes"] += len(blob)
    log.info("session %s handed over (%d bytes)", session_id, len(blob))
    return len(blob)


async def _export_and_close(engine, session_id: str, deadline: float) -> bytes:
    def export_close() -> bytes:
        blob = export_session(engine.core, session_id)
        engine.core.close_session(session_id)  # the same engine command: nothing lands after the blob
        return blob

    while True:
        try:
            return await asyncio.wrap_future(engine.call(export_close, session_id=session_id))
        except HandoffError:  # work in flight: wait for it
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(EXPORT_RETRY_S)


async def _publish(store, session_id: str, blob: bytes) -> None:
    await store.put_blob(handoff_address(session_id, await store.read_log(session_id)), blob)
    await store.release(session_id)


def handoff_address(session_id: str, raw: list[dict]) -> str:
    """Where the handoff blob of `session_id` lies when its log is `raw`: a blob address derived
    from the session and the log's end (its record count and last record), so a worker finds
    the blob only while the log ends where it ended at export."""
    last = json.dumps(raw[-1], sort_keys=True, separators=(",", ":")) if raw else ""
    return hashlib.sha256(f"handoff\0{session_id}\0{len(raw)}\0{last}".encode()).hexdigest()


# ---- the adopting worker ----------------------------------------------------------------------


async def adopt(engine, store, session_id: str, raw: list[dict], create, counters: dict) -> dict | None:
    """Import the session's handoff blob if there is one for the log's end `raw`: create the
    session as its `create` record says, then import. Returns its state, or None (no blob, or
    one that does not fit: the caller replays the log)."""
    address = handoff_address(session_id, raw)
    try:
        blob = await store.get_blob(address, take=True)  # used once: a blob is as large as the session's cache
    except Exception as exc:  # the replay reads the same store: it says whether it answers
        return _fallback(counters, session_id, f"reading the blob: {exc}")
    if blob is None:
        return None
    await asyncio.wrap_future(create.apply(engine, session_id))
    try:
        state = await asyncio.wrap_future(
            engine.call(lambda: import_session(engine.core, session_id, blob), session_id=session_id))
    except Exception as exc:
        await asyncio.wrap_future(engine.close_session(session_id))
        return _fallback(counters, session_id, str(exc))
    counters["handoffs_imported"] += 1
    log.info("session %s adopted from its handoff blob (%d bytes, no input read again)", session_id, len(blob))
    return state


def _fallback(counters: dict, session_id: str, why: str) -> None:
    counters["handoff_fallbacks"] += 1
    log.warning("handoff blob of session %s not used (%s): replaying its log", session_id, why)
    return None
