"""What the edge knows about the live sessions of this worker, in one place.

Connections, the event log, snapshots and detach/resume all read and change the same facts:
which capability tokens open a session, which API key created it (and how many sessions each key
holds), the client_seq marks that make resent input idempotent, ingest lag, whether the session
is detached. They do so through this object's methods only, so no part writes into another's
fields. Only the server's event loop uses it (SessionTokens is also thread-safe).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from streamer.sessions.errors import Code, EngineError

from .auth import SessionTokens

REASONING_KEEP_CHARS = 4000
ACTIONS_KEEP = 50
MOVED_KEEP = 4096  # sessions remembered as adopted by another worker (their clients are told `moved`)


class Moved(EngineError):
    """The session is owned by another worker (`owner`: {worker, url, alive}): connect there."""

    def __init__(self, session_id: str, owner: dict) -> None:
        where = f" at {owner['url']}" if owner.get("url") else ""
        super().__init__(f"session {session_id} is owned by worker {owner['worker']}{where}; connect there",
                         code=Code.MOVED)
        self.owner = owner

    def event(self, proto, reply_to: str | None, session_id: str | None) -> str:
        """The `error` event, with `owner` (ServerProtocol.error has no field for it)."""
        return proto.event("error", reply_to=reply_to, session_id=session_id, error={
            "code": self.code, "message": self.message, "recoverable": True, "owner": self.owner})


@dataclass(slots=True)
class Tracked:
    """Edge-side facts about a live session on this worker."""

    session_id: str
    key_name: str | None = None
    acked_client_seq: int = 0  # highest client_seq logged (moves only with a durable write)
    lag_ms: float | None = None
    reasoning: deque = field(default_factory=lambda: deque(maxlen=REASONING_KEEP_CHARS))
    actions: deque = field(default_factory=lambda: deque(maxlen=ACTIONS_KEEP))
    last_action_seq: int = 0
    detached_at: float | None = None
    client: str | None = None  # who detached it (API key name or remote address): its detach quota
    expiry: asyncio.TimerHandle | None = None
    monitor: object = None  # the engine listener that feeds snapshots
    last_snapshot: str | None = None
    dirty: bool = True  # changed since the last snapshot


class Directory:
    def __init__(self, keys_enabled: bool, sessions_per_key: int) -> None:
        self.keys_enabled = keys_enabled
        self.sessions_per_key = sessions_per_key
        self.tokens = SessionTokens()  # capability tokens of live sessions (digests only)
        self.sessions: dict[str, Tracked] = {}
        self._per_key: dict[str, int] = {}  # API key name -> live sessions it holds
        self._key_of: dict[str, str] = {}  # session id -> the API key name that created it
        self._moved: OrderedDict[str, dict] = OrderedDict()  # session id -> its new owner, newest last
        self.duplicates = 0

    # ---- API key quotas ---------------------------------------------------------------------

    def reserve(self, key_name: str) -> None:
        """Count one more session against the key (released if its creation fails)."""
        held = self._per_key.get(key_name, 0)
        if held >= self.sessions_per_key:
            raise EngineError(f"this API key already holds {held} sessions (limit {self.sessions_per_key})",
                              code=Code.TOO_MANY_SESSIONS)
        self._per_key[key_name] = held + 1

    def release(self, key_name: str) -> None:
        held = self._per_key.get(key_name, 0) - 1
        if held > 0:
            self._per_key[key_name] = held
        else:
            self._per_key.pop(key_name, None)

    def held(self, key_name: str) -> int:
        return self._per_key.get(key_name, 0)

    # ---- sessions ----------------------------------------------------------------------------

    def track(self, session_id: str, key_name: str | None, client_seq: int = 0) -> Tracked:
        """A live session on this worker (new, or recovered with the client_seq its log holds)."""
        self._moved.pop(session_id, None)  # live here (again)
        tracked = self.sessions.get(session_id)
        if tracked is None:
            tracked = self.sessions[session_id] = Tracked(session_id, key_name, client_seq)
        if key_name is not None:
            self._key_of[session_id] = key_name
        return tracked

    def restore(self, session_id: str, digests: dict[str, str], key_name: str | None, client_seq: int) -> Tracked:
        """A session recovered from its log: its tokens work again and it counts for its key."""
        self.tokens.restore(session_id, digests)
        if key_name is not None:
            self._per_key[key_name] = self._per_key.get(key_name, 0) + 1
        return self.track(session_id, key_name, client_seq)

    # ---- ownership: sessions another worker adopted from this one -----------------------------

    def moved(self, session_id: str, owner: dict) -> None:
        """Another worker owns the session now (this one lost its lease): it is no longer live
        here, and commands on it are answered `moved` to `owner` until it is live here again."""
        self._moved.pop(session_id, None)
        self._moved[session_id] = owner
        while len(self._moved) > MOVED_KEEP:
            self._moved.popitem(last=False)

    def moved_to(self, session_id: str) -> dict | None:
        """The owner a session was lost to, or None."""
        return self._moved.get(session_id)

    def get(self, session_id: str) -> Tracked | None:
        return self.sessions.get(session_id)

    def key_of(self, session_id: str) -> str | None:
        """The name of the API key that created the live session (None: none, or not live)."""
        return self._key_of.get(session_id)

    def forget(self, session_id: str) -> Tracked | None:
        """The session is gone from this worker: its tokens stop working, its key's count drops."""
        self.tokens.revoke(session_id)
        key_name = self._key_of.pop(session_id, None)
        if key_name is not None:
            self.release(key_name)
        tracked = self.sessions.pop(session_id, None)
        if tracked is not None and tracked.expiry is not None:
            tracked.expiry.cancel()
        return tracked

    # ---- client_seq (duplicates are told by streamer.eventlog.EventLog.duplicate) ------------

    def logged(self, session_id: str, client_seq: int | None) -> None:
        """A change of the session is durable in its log (with the client's seq, if it had one)."""
        tracked = self.sessions.get(session_id)
        if tracked is not None:
            tracked.dirty = True
            if client_seq:
                tracked.acked_client_seq = max(tracked.acked_client_seq, client_seq)

    def note_lag(self, session_id: str, lag_s: float) -> None:
        tracked = self.sessions.get(session_id)
        if tracked is not None:
            tracked.lag_ms = round(lag_s * 1000, 2)

    def detached(self) -> int:
        return sum(1 for t in self.sessions.values() if t.detached_at is not None)
