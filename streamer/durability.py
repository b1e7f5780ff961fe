"""The server's side of durability: logging accepted input, resume, detach, snapshots.

`Keeper` sits between the websocket connections and the store (streamer.store):

- every change a session accepts is appended to its event log *before* the client gets its
  acknowledgement (`logged`), in the order the engine applied the changes;
- inputs may carry a client-chosen `client_seq` (strictly increasing per session); one at or
  below the highest the session has seen is a duplicate: acknowledged again
  (`duplicate: true`) and not applied, so a client that lost its connection resends
  everything after the `last_client_seq` that `session.resumed` reports without doubling
  anything;
- a session whose producer disconnects is detached, not closed; it closes after
  `detach_ttl_s` unless a producer resumes it (`session.resume` with the producer token);
- a session not live on this worker (a restart, or an adopted session of a dead worker) is
  recovered by replaying its log (streamer.recovery) once the token is checked against the
  digests its log holds and this worker has claimed it in the directory;
- a snapshot of each session (directory entry, ingest lag, cache, data_version, flash answers
  with version and confidence, recent reasoning, last action seq) is written to the store and
  pushed to its watchers at most once per `snapshot_interval_s`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from streamer.sessions.errors import EngineError

from .auth import ROLES, digest
from .recovery import client_seq_of, replay
from .store import Store, StoreError, heartbeat_loop

log = logging.getLogger(__name__)

DEFAULT_DETACH_TTL_S = 300.0
DEFAULT_SNAPSHOT_INTERVAL_S = 0.5
REASONING_KEEP_CHARS = 4000
ACTIONS_KEEP = 50


class Moved(EngineError):
    """The session is owned by another live worker."""

    def __init__(self, session_id: str, owner: dict) -> None:
        where = f" at {owner['url']}" if owner.get("url") else ""
        super().__init__(f"session {session_id} is owned by worker {owner['worker']}{where}; connect there",
                         code="moved")
        self.owner = owner


@dataclass(slots=True)
class Tracked:
    """Edge-side facts about a live session on this worker."""

    session_id: str
    key_name: str | None = None
    high_client_seq: int = 0  # highest client_seq seen (submitted)
    acked_client_seq: int = 0  # highest client_seq logged and acknowledged
    lag_ms: float | None = None
    reasoning: deque = field(default_factory=lambda: deque(maxlen=REASONING_KEEP_CHARS))
    actions: deque = field(default_factory=lambda: deque(maxlen=ACTIONS_KEEP))
    last_action_seq: int = 0
    detached_at: float | None = None
    expiry: asyncio.TimerHandle | None = None
    monitor: object = None
    last_snapshot: str | None = None
    dirty: bool = True


class Keeper:
    def __init__(self, server, store: Store, detach_ttl_s: float = DEFAULT_DETACH_TTL_S,
                 snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S) -> None:
        self.server = server
        self.engine = server.engine
        self.store = store
        self.detach_ttl_s = detach_ttl_s
        self.snapshot_interval_s = snapshot_interval_s
        self.sessions: dict[str, Tracked] = {}
        self._recovering: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._writes: set[asyncio.Task] = set()
        self.counters = {"log_records": 0, "log_errors": 0, "duplicates": 0, "recovered": 0, "detached_expired": 0,
                         "snapshots": 0}

    async def start(self, url: str | None) -> None:
        self.store.worker_url = url
        await self.store.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(heartbeat_loop(self.store)), loop.create_task(self._snapshot_loop())]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._writes:  # accepted changes still on their way to the log
            await asyncio.wait(list(self._writes), timeout=30)
        for tracked in self.sessions.values():
            if tracked.expiry is not None:
                tracked.expiry.cancel()
        try:
            await self._snapshot_all()
        except Exception:
            log.warning("final snapshots failed", exc_info=True)
        # The engine's copies go; the logs stay open (no close record), so a restarted or
        # another worker recovers these sessions on resume.
        for sid in list(self.sessions):
            try:
                await asyncio.wrap_future(self.engine.close_session(sid))
            except EngineError:
                pass  # already gone
            self.server.forget(sid)
        self.sessions.clear()
        try:
            await self.store.close()
        except StoreError as exc:
            log.warning("closing the store: %s", exc)

    # ---- logging --------------------------------------------------------------------------

    def spawn(self, coro) -> asyncio.Task:
        """A store write owned by the keeper, not by a connection (it survives the client)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    def log_after(self, session_id: str, fut, record_of) -> asyncio.Future:
        """When the engine future `fut` succeeds, append `record_of(result)` to the log; the
        returned future resolves once it is durable (or fails with store_unavailable). The
        write starts from the engine's own completion, in completion order, so the log order
        is the order the engine applied the changes, and a client that disconnects meanwhile
        cannot leave an applied change out of the log."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        done.add_done_callback(lambda d: d.cancelled() or d.exception())  # a waiter may be gone
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._start_log, session_id, f, record_of, done))
        return done

    def log_hook(self, session_id: str, record_of, loop: asyncio.AbstractEventLoop):
        """A done-callback for an engine future made on another thread (media ingest): pass it
        as the engine call's `then`, so it is attached before the engine can finish, and the
        change is logged in the order the engine applied it, like `log_after`."""
        return lambda f: loop.call_soon_threadsafe(self._start_log, session_id, f, record_of, None)

    def _start_log(self, session_id: str, f, record_of, done: asyncio.Future | None) -> None:
        if f.cancelled() or f.exception() is not None:
            if done is not None:
                done.set_result(None)  # nothing applied: nothing to log
            return
        try:
            record = record_of(f.result())
        except Exception as exc:  # a bug: the waiter reports it
            if done is not None:
                done.set_exception(exc)
            else:
                log.exception("building the log record of session %s failed", session_id)
            return
        task = self.spawn(self.logged(session_id, record))
        if done is not None:
            task.add_done_callback(lambda t: done.set_exception(t.exception()) if t.exception() is not None
                                   else done.set_result(None))
        else:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged() reports its failures

    async def logged(self, session_id: str, record: dict, reply: str | None = None) -> str | None:
        """Append `record` to the session's log, then hand back `reply` (the acknowledgement).
        Called in the order the engine resolved the changes; the store keeps that order."""
        record = {"ts": time.time(), **record}
        try:
            await self.store.append(session_id, record)
        except (StoreError, OSError, ConnectionError) as exc:
            self.counters["log_errors"] += 1
            log.error("could not log %s on session %s: %s", record["kind"], session_id, exc)
            raise EngineError(f"the change was applied but could not be logged ({exc}); it is not acknowledged "
                              "and would not survive a restart", code="store_unavailable") from None
        self.counters["log_records"] += 1
        tracked = self.sessions.get(session_id)
        if tracked is not None:
            tracked.dirty = True
            if record.get("client_seq"):
                tracked.acked_client_seq = max(tracked.acked_client_seq, record["client_seq"])
        return reply

    async def created(self, session_id: str, record: dict, reply: str, undo) -> str:
        """Log a new session's creation after claiming it in the directory. An id whose log
        exists (a session that closed within the retention time, or one live on another
        worker) is refused and `undo()` closes the engine's copy."""
        try:
            if await self.store.log_length(session_id):
                raise EngineError(f"session id {session_id!r} was used before (its log is kept for "
                                  f"{self.store.retention_s:.0f} s after it closes)", code="invalid_field")
            owner = await self.store.claim(session_id)
            if owner is not None:
                raise EngineError(f"session id {session_id!r} is in use on worker {owner}", code="invalid_field")
            return await self.logged(session_id, record, reply)
        except BaseException:
            self.sessions.pop(session_id, None)
            undo()
            raise

    def check_client_seq(self, session_id: str, client_seq: int | None) -> bool:
        """True when the input is a duplicate (already seen); otherwise it is now seen."""
        tracked = self.sessions.get(session_id)
        if client_seq is None or tracked is None:
            return False
        if client_seq <= tracked.high_client_seq:
            self.counters["duplicates"] += 1
            return True
        tracked.high_client_seq = client_seq
        return False

    def note_lag(self, session_id: str, lag_s: float) -> None:
        tracked = self.sessions.get(session_id)
        if tracked is not None:
            tracked.lag_ms = round(lag_s * 1000, 2)

    # ---- lifecycle of tracked sessions ------------------------------------------------------

    def track(self, session_id: str, key_name: str | None, client_seq: int = 0) -> Tracked:
        tracked = self.sessions.get(session_id)
        if tracked is None:
            tracked = self.sessions[session_id] = Tracked(session_id, key_name, client_seq, client_seq)
            tracked.monitor = self._monitor(tracked)
            self.engine.add_listener(session_id, tracked.monitor)
        return tracked

    def _monitor(self, tracked: Tracked):
        """An engine listener keeping what snapshots report beyond engine state. It is called on
        the engine thread and hands each event to the event loop, which owns `tracked`."""
        loop = asyncio.get_running_loop()

        def on_event(event: str, payload: dict) -> None:
            try:
                loop.call_soon_threadsafe(apply, event, payload)
            except RuntimeError:  # the server's loop is gone (shutting down)
                pass

        def apply(event: str, payload: dict) -> None:
            tracked.dirty = True
            if event == "reasoning.delta":
                tracked.reasoning.extend(payload.get("delta", ""))
            elif event == "action.chunk":
                tracked.last_action_seq = payload.get("seq", tracked.last_action_seq)
                tracked.actions.append({k: payload.get(k) for k in ("seq", "t0", "dt", "obs_ts")} |
                                       {"n": len(payload.get("actions") or ())})
            elif event == "action.command":
                tracked.actions.append({"command": payload.get("command"), "rule_id": payload.get("rule_id"),
                                        "at": time.time()})

        return on_event

    async def forget(self, session_id: str, reason: str) -> None:
        """The session closed (by its producer, or its detach TTL ran out)."""
        tracked = self.sessions.pop(session_id, None)
        if tracked is not None and tracked.expiry is not None:
            tracked.expiry.cancel()
        try:
            await self.store.append(session_id, {"kind": "close", "ts": time.time(), "reason": reason})
            await self.store.put_snapshot(session_id, {**(await self.store.snapshot(session_id) or
                                                          {"session_id": session_id}),
                                                       "closed": True, "updated_at": time.time()})
            await self.store.closed(session_id)
            await self.store.release(session_id)
        except Exception as exc:
            log.warning("could not record the close of session %s: %s", session_id, exc)

    def detach(self, session_id: str, close) -> None:
        """Its producer went away: keep the session for `detach_ttl_s`, then `close()` it."""
        tracked = self.sessions.get(session_id)
        if tracked is None:
            close()
            return
        tracked.detached_at = time.time()
        tracked.dirty = True

        def expire() -> None:
            if tracked.detached_at is not None and self.sessions.get(session_id) is tracked:
                self.counters["detached_expired"] += 1
                log.info("session %s expired after %.0f s detached", session_id, self.detach_ttl_s)
                close()

        tracked.expiry = asyncio.get_running_loop().call_later(self.detach_ttl_s, expire)

    def attach(self, session_id: str) -> Tracked:
        tracked = self.sessions[session_id]
        if tracked.expiry is not None:
            tracked.expiry.cancel()
            tracked.expiry = None
        tracked.detached_at = None
        tracked.dirty = True
        return tracked

    async def recover(self, session_id: str, token: str) -> dict:
        """Bring a session that is not live here back from its log; returns {state, records}.
        Raises EngineError: session_not_found (no log, closed, or a token that is not its
        producer token), moved (a live worker owns it), replay_failed."""
        if session_id in self._recovering:
            return await asyncio.shield(self._recovering[session_id])
        fut = self._recovering[session_id] = asyncio.get_running_loop().create_future()
        try:
            result = await self._recover(session_id, token)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: concurrent waiters re-raise it themselves
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            del self._recovering[session_id]

    async def _recover(self, session_id: str, token: str) -> dict:
        not_found = EngineError(f"no session {session_id!r} with that producer token", code="session_not_found")
        records = await self.store.read_log(session_id)
        if not records or records[0].get("kind") != "create" or any(r.get("kind") == "close" for r in records):
            raise not_found
        digests = records[0].get("tokens") or {}
        if set(digests) != set(ROLES) or not _is(token, digests["producer"]):
            raise not_found
        owner = await self.store.claim(session_id)
        if owner is not None:
            raise Moved(session_id, await self.store.owner(session_id) or {"worker": owner})
        try:
            state = await replay(self.engine, session_id, records)
        except BaseException:
            if session_id in self.engine.sessions:  # a partial copy must not linger
                self.engine.close_session(session_id)
            await self.store.release(session_id)
            raise
        self.server.tokens.restore(session_id, digests)
        key_name = records[0].get("key")
        if key_name is not None:
            self.server.session_keys[session_id] = key_name
            self.server.sessions_by_key[key_name] = self.server.sessions_by_key.get(key_name, 0) + 1
        tracked = self.track(session_id, key_name, client_seq_of(records))
        tracked.last_action_seq = 0
        self.counters["recovered"] += 1
        return {"state": state, "records": len(records)}

    # ---- snapshots ------------------------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.snapshot_interval_s)
            try:
                await self._snapshot_all()
            except Exception:
                log.warning("snapshot round failed", exc_info=True)

    async def _snapshot_all(self) -> None:
        for sid, tracked in list(self.sessions.items()):
            if not tracked.dirty:
                continue
            tracked.dirty = False
            try:
                state = await asyncio.wrap_future(self.engine.session_state(sid))
            except EngineError:
                continue  # closed meanwhile
            snap = self.snapshot(tracked, state)
            body = json.dumps(snap, sort_keys=True, default=str)
            if body == tracked.last_snapshot:
                continue
            tracked.last_snapshot = body
            snap["updated_at"] = time.time()
            await self.store.put_snapshot(sid, snap)
            self.counters["snapshots"] += 1
            self.server.push_snapshot(sid, snap)

    def snapshot(self, tracked: Tracked, state: dict) -> dict:
        return {
            "session_id": tracked.session_id, "owner": self.store.worker_id, "owner_url": self.store.worker_url,
            "created_at": state["created_at"], "last_input_at": state["last_input_at"],
            "detached": tracked.detached_at is not None, "closed": False,
            "ingest_lag_ms": tracked.lag_ms, "tokens": state["tokens"], "cache_bytes": state["cache_bytes"],
            "context_window": state["context_window"], "data_version": state["data_version"],
            "last_seq": state["last_seq"], "last_client_seq": tracked.acked_client_seq, "ended": state["ended"],
            "flash": [{k: q.get(k) for k in ("flash_id", "question", "answer", "data_version", "confidence",
                                             "staleness", "history")} for q in state["flash"]],
            "thinking": state["thinking"], "reasoning": "".join(tracked.reasoning)[-1000:],
            "last_action_seq": tracked.last_action_seq, "actions": list(tracked.actions)[-20:],
        }

    def metrics(self) -> dict:
        return {**self.counters, "detached": sum(1 for t in self.sessions.values() if t.detached_at is not None),
                "store": self.store.kind}


def _is(token: str | None, want_digest: str) -> bool:
    import hmac

    return bool(token) and hmac.compare_digest(digest(token).encode(), want_digest.encode())


class LoggedEngine:
    """The engine as the media path sees it: appends, revises and window settings made on a
    media thread (observations, transcripts) go to the session's event log like a client's
    inputs, in the order the engine applied them, so replay rebuilds media sessions too.
    Everything else is the engine itself."""

    def __init__(self, engine, keeper: Keeper, loop: asyncio.AbstractEventLoop) -> None:
        self._engine, self._keeper, self._loop = engine, keeper, loop

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def append(self, session_id: str, text: str):
        hook = self._keeper.log_hook(session_id, lambda r: {"kind": "append", "text": text, "seq": r.seq,
                                                            "source": "media"}, self._loop)
        return self._engine.append(session_id, text, then=hook)

    def revise(self, session_id: str, text: str, from_seq: int | None = None):
        hook = self._keeper.log_hook(session_id, lambda r: {"kind": "revise", "text": text, "from_seq": from_seq,
                                                            "seq": r.seq, "source": "media"}, self._loop)
        return self._engine.revise(session_id, text, from_seq, then=hook)

    def configure_window(self, session_id: str, max_tokens: int, keep_tokens: int = 0, sink_inputs: int = 1):
        window = {"max_tokens": max_tokens, "keep_tokens": keep_tokens, "sink_inputs": sink_inputs}
        hook = self._keeper.log_hook(session_id, lambda _: {"kind": "update", "thinking": None, "window": window},
                                     self._loop)
        return self._engine.configure_window(session_id, max_tokens, keep_tokens, sink_inputs, then=hook)

