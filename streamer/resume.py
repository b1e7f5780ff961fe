"""Sessions outliving their connection: detach, resume, recover, close.

- A session whose producer disconnects is detached, not closed; it closes after `detach_ttl_s`
  unless a producer resumes it (`session.resume` with the producer token). Detached sessions
  still count for the API key that created them (`sessions_per_key`) and hold engine slots, so
  under pressure the oldest detached one closes first (`evicted`): past a client's or the
  server's detach cap, and when a new session needs its key's or the engine's last slot
  (`make_room`). With API keys only the same key's detached sessions go: one tenant's load
  never closes another tenant's sessions.
- A session not live on this worker (a restart, or an adopted session of a dead worker) is
  recovered by replaying its log (streamer.recovery) once the token is checked against the
  digests its log holds and this worker has claimed it in the store's directory.
- Closing a session records a `close` in its log and releases it in the store, so its log is
  kept only for the store's retention time.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable

from streamer.sessions.errors import Code, EngineError

from .auth import ROLES, digest
from .directory import Directory, Moved, Tracked
from .drain import adopt as take_handoff, new_counters
from .eventlog import EventLog
from .records import Close, Create, client_seq_of
from .recovery import applied, parse, replay
from .snapshots import Snapshots
from .store_base import Store, beat, lease_lapsed

log = logging.getLogger(__name__)

DEFAULT_DETACH_TTL_S = 300.0


class Resumer:
    def __init__(self, engine, store: Store, directory: Directory, events: EventLog, snapshots: Snapshots,
                 detach_ttl_s: float = DEFAULT_DETACH_TTL_S, on_close: Callable[[str, str], None] | None = None,
                 max_detached: int = 128, max_detached_per_client: int = 8) -> None:
        self.engine = engine
        self.store = store
        self.directory = directory
        self.events = events
        self.snapshots = snapshots
        self.detach_ttl_s = detach_ttl_s
        self.on_close = on_close  # (session id, reason): closed here (subscribers are told, MQTT stops)
        self._recovering: dict[str, asyncio.Future] = {}
        self.max_detached, self.max_detached_per_client = max_detached, max_detached_per_client
        self.counters = {"recovered": 0, "adopted": 0, "detached_expired": 0, "detached_evicted": 0,
                         "sessions_lost": 0}
        self.on_adopt: Callable[[str], None] | None = None  # a session adopted with nobody asking (MQTT goes on)
        self.handoffs = new_counters()  # streamer.drain: sessions handed over with their KV, both ways
        self.draining = False  # set by a draining server: sessions not live here are not recovered here
        events.on_lost = self.lost

    # ---- ownership: a worker that lost its lease ----------------------------------------------

    def lost(self, session_id: str, owner: dict) -> None:
        """Another worker owns the session now: this worker was presumed dead (paused past its
        heartbeat TTL) and the session was adopted. Its copy here goes at once (engine, tokens,
        event pipe), with no close in the log and no release in the directory (both are the
        new owner's); commands on it are answered `moved` to `owner`."""
        if self.directory.get(session_id) is None and session_id not in self.events.pipes:
            self.directory.moved(session_id, owner)
            return
        self.counters["sessions_lost"] += 1
        log.warning("session %s is owned by worker %s now (this worker lost its lease): dropping it here",
                    session_id, owner.get("worker"))
        self.directory.forget(session_id)
        self.directory.moved(session_id, owner)
        self.events.forget(session_id)
        if session_id in self.engine.sessions:
            self.engine.close_session(session_id)

    async def fence(self, cmd, proto) -> str | None:
        """Before a command on a session: when this worker's lease may have lapsed (it was
        paused, or its loop stalled, past the heartbeat TTL), beat first (one beat shared by
        every waiting command); a beat that finds this worker forgotten drops the sessions
        another worker adopted meanwhile. Returns the `moved` error event for a session lost
        that way, else None (the command goes on). `session.resume` is let through: it claims
        the session (adopting it back when its new owner died too, or answering `moved`);
        `session.create` names a new session."""
        session_id, command = cmd.session_id, cmd.type
        if session_id is None or command == "session.create":
            return None
        if self.directory.get(session_id) is not None and lease_lapsed(self.store):
            try:
                await beat(self.store, self.events.store_restarted)
            except Exception as exc:  # the store does not answer: nobody can adopt through it either
                log.warning("renewing this worker's lease before a %s: %s", command, exc)
        owner = self.directory.moved_to(session_id)
        if owner is None or command == "session.resume":
            return None
        return Moved(session_id, owner).event(proto, cmd.event_id, session_id)

    def detach(self, session_id: str, client: str | None = None) -> None:
        """Its producer went away: keep the session for `detach_ttl_s`, then close it. Over the
        client's or the server's detach quota, the oldest detached session closes first."""
        if self.directory.moved_to(session_id) is not None:
            return  # adopted by another worker: nothing of it is left here to keep or close
        tracked = self.directory.get(session_id)
        if tracked is None or self.detach_ttl_s <= 0:
            self.close(session_id, "detached")
            return
        tracked.detached_at = time.time()
        tracked.client = client
        tracked.dirty = True
        self._schedule_expiry(session_id, tracked)
        self._enforce_quota(client, tracked.key_name)

    def _tenant(self, key_name: str | None) -> Callable[[Tracked], bool]:
        """Whose detached sessions a key's load may close: with API keys, that key's own only
        (a tenant never closes another's); without keys (one tenant), any."""
        if self.directory.keys_enabled and key_name is not None:
            return lambda t: t.key_name == key_name
        return lambda t: True

    def _enforce_quota(self, client: str | None, key_name: str | None = None) -> None:
        """Past the client's detach cap its oldest detached sessions close; past the server's,
        as many of the oldest detached sessions of the detaching key (without keys: of anyone)
        as the server holds too many."""
        def held(mine: Callable[[Tracked], bool]) -> list[Tracked]:
            return sorted((t for t in self.directory.sessions.values() if t.detached_at is not None and mine(t)),
                          key=lambda t: t.detached_at)

        clients = held(lambda t: client is not None and t.client == client)
        for tracked in clients[:max(0, len(clients) - self.max_detached_per_client)]:
            self._evict(tracked, "over the detach quota of its client")
        over = self.directory.detached() - self.max_detached
        for tracked in held(self._tenant(key_name))[:max(0, over)]:
            self._evict(tracked, "over the server's detach quota")

    def make_room(self, key_name: str | None) -> list[str]:
        """A session is about to be created for `key_name`: if the key holds `sessions_per_key`
        sessions and one of them is detached, or the engine is at its session limit and one of
        the key's sessions is detached (without keys: any detached session), the oldest such
        detached session closes first. Another key's detached sessions are never closed: with
        none of its own, the new session is refused (or queued) as the engine's admission says.
        Returns the ids closed that were this key's (its creator is told)."""
        directory, mine = self.directory, []
        if key_name is not None and directory.keys_enabled and directory.held(key_name) >= directory.sessions_per_key:
            if (oldest := self._oldest_detached(lambda t: t.key_name == key_name)) is not None:
                self._evict(oldest, "its API key is at its session quota")
                mine.append(oldest.session_id)
        if len(directory.sessions) >= self.engine.limits.max_sessions:
            if (oldest := self._oldest_detached(self._tenant(key_name))) is not None:
                self._evict(oldest, "the engine is at its session limit")
                if key_name is not None and oldest.key_name == key_name:
                    mine.append(oldest.session_id)
        return mine

    def _oldest_detached(self, mine: Callable[[Tracked], bool]) -> Tracked | None:
        held = [t for t in self.directory.sessions.values() if t.detached_at is not None and mine(t)]
        return min(held, key=lambda t: t.detached_at, default=None)

    def _evict(self, tracked: Tracked, why: str) -> None:
        self.counters["detached_evicted"] += 1
        log.info("detached session %s closed: %s", tracked.session_id, why)
        self.close(tracked.session_id, "evicted")

    def _schedule_expiry(self, session_id: str, tracked: Tracked) -> None:
        def expire() -> None:
            if tracked.detached_at is not None and self.directory.get(session_id) is tracked:
                self.counters["detached_expired"] += 1
                log.info("session %s expired after %.0f s detached", session_id, self.detach_ttl_s)
                self.close(session_id, "expired")

        tracked.expiry = asyncio.get_running_loop().call_later(self.detach_ttl_s, expire)

    def attach(self, session_id: str) -> Tracked:
        tracked = self.directory.sessions[session_id]
        if tracked.expiry is not None:
            tracked.expiry.cancel()
            tracked.expiry = None
        tracked.detached_at = None
        tracked.dirty = True
        return tracked

    def close(self, session_id: str, reason: str):
        """Close the session here and in its log (a producer's close, or its detach TTL ran out);
        returns the engine's future of its final state and the task that records the close.
        Reasons: `closed` (its producer), `detached` (no detach time), `expired`, `evicted`."""
        if self.on_close is not None:
            self.on_close(session_id, reason)
        tracked = self.directory.forget(session_id)
        key_name = tracked.key_name if tracked is not None else None
        recorded = self.events.spawn(self._record_close(session_id, reason, key_name))
        recorded.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self.engine.close_session(session_id), recorded

    async def _record_close(self, session_id: str, reason: str, key_name: str | None) -> None:
        try:
            await self.events.closing(session_id, Close(ts=time.time(), reason=reason))
            await self.store.put_snapshot(session_id, {**(await self.store.snapshot(session_id) or
                                                          {"session_id": session_id, "key": key_name}),
                                                       "closed": True, "updated_at": time.time()})
            await self.store.closed(session_id)
            await self.store.release(session_id)
        except Exception as exc:
            log.warning("could not record the close of session %s: %s", session_id, exc)

    async def recover(self, session_id: str, token: str | None, adopt: bool = False) -> dict:
        """Bring a session that is not live here back from its log; returns {state, records}.
        Raises EngineError: session_not_found (no log, closed, or a token that is not its
        producer token), moved (a live worker owns it), replay_failed. `adopt` (no token): a
        dead worker's session taken over with nobody asking (streamer.adoption); it is left
        detached, so it closes after `detach_ttl_s` unless its producer resumes it."""
        if session_id in self._recovering:  # one replay; each waiter's token is checked against its result
            result = await asyncio.shield(self._recovering[session_id])
            if not adopt and self.directory.tokens.role_of(session_id, token) != "producer":
                raise EngineError(f"no session {session_id!r} with that producer token", code=Code.SESSION_NOT_FOUND)
            return result
        fut = self._recovering[session_id] = asyncio.get_running_loop().create_future()
        try:
            result = await self._recover(session_id, token, adopt)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: concurrent waiters re-raise it themselves
            raise
        else:
            fut.set_result(result)
            return result
        finally:
            del self._recovering[session_id]

    async def _recover(self, session_id: str, token: str | None, adopt: bool = False) -> dict:
        if self.draining:
            raise EngineError(f"this worker is draining: resume session {session_id} on another worker",
                              code=Code.DRAINING)
        not_found = EngineError(f"no session {session_id!r} with that producer token", code=Code.SESSION_NOT_FOUND)
        raw = await self.store.read_log(session_id)
        records = parse(applied(raw)) if raw else []
        if not records or not isinstance(records[0], Create) or any(r.kind == "close" for r in records):
            raise not_found
        digests = records[0].tokens or {}
        if set(digests) != set(ROLES) or not (adopt or _is(token, digests["producer"])):
            raise not_found
        owner = await self.store.claim(session_id)
        if owner is not None:
            raise Moved(session_id, await self.store.owner(session_id) or {"worker": owner})
        try:
            state = await take_handoff(self.engine, self.store, session_id, raw, records[0], self.handoffs)
            reprefill = 0  # a drained worker's handoff: the KV came with it
            if state is None:
                state = await replay(self.engine, session_id, raw, self.store)
                reprefill = state["tokens"] - state["prefix_tokens"]  # the window it read again (at least)
        except BaseException:
            if session_id in self.engine.sessions:  # a partial copy must not linger
                self.engine.close_session(session_id)
            await self.store.release(session_id)
            raise
        self.events.open(session_id, raw)
        tracked = self.directory.restore(session_id, digests, records[0].key, client_seq_of(records))
        self.snapshots.watch(tracked)
        self.counters["recovered"] += 1
        if adopt:  # before any waiting resume goes on: that one attaches it again
            self.counters["adopted"] += 1
            if self.on_adopt is not None:
                self.on_adopt(session_id)
            self.detach(session_id)
        return {"state": state, "records": len(records), "reprefill_tokens": reprefill}

    async def stop(self) -> None:
        """The server stops: the engine's copies go; the logs stay open (no close record), so a
        restarted or another worker recovers these sessions on resume."""
        for sid in list(self.directory.sessions):
            try:
                await asyncio.wrap_future(self.engine.close_session(sid))
            except EngineError:
                pass  # already gone
            self.directory.forget(sid)
            self.events.forget(sid)


def _is(token: str | None, want_digest: str) -> bool:
    return bool(token) and hmac.compare_digest(digest(token).encode(), want_digest.encode())
