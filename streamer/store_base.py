"""What every store is: the errors and timing constants of the store contract, and `Store`, the
interface with its in-process implementation (nothing survives the process); the heartbeat
(`beat`, `heartbeat_loop`) and the lease (`lease_lapsed`) of any store.

streamer.store (what a store holds, how it compacts and expires) adds the file store and
`open_store`, a store from a URL; streamer.redis_store adds the Redis store. The Redis store
builds on this module, not on streamer.store, which opens it.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import re
import secrets
import time

DEFAULT_RETENTION_S = 86_400.0
HEARTBEAT_S = 2.0  # how often a worker says it is alive
WORKER_TTL_S = 6.0  # a worker silent this long is dead; its sessions may be adopted


class StoreError(Exception):
    """The store could not do it (unreachable, timed out, refused). After a timeout a write may
    or may not have landed: the event log resolves that by reading the position back."""


class NotOwner(StoreError):
    """This worker no longer owns the session in the store's directory."""


class StoreLost(NotOwner):
    """The store knows nothing of the session any more (it restarted empty): neither its owner
    entry nor its log exists. The event log re-claims it and re-writes its log from memory."""


class Conflict(StoreError):
    """Position `n` of the log holds another record (`holder`: that record's id, or None when
    the log is shorter than n - 1: a gap)."""

    def __init__(self, message: str, holder: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder


class LogGap(Conflict):
    """The log is shorter than the position written: a re-write of a lost log was cut off (the
    store failed again meanwhile). The event log finishes that re-write from memory."""


class Store:
    """The interface, and the in-process implementation (nothing survives the process)."""

    kind = "memory"
    # A worker silent for worker_ttl_s is dead (its sessions may be adopted); it beats every
    # heartbeat_s. Shorter fails over sooner and declares a stalled worker dead sooner
    # (`streamer serve --worker-ttl`, docs/cluster.md).
    worker_ttl_s: float = WORKER_TTL_S
    heartbeat_s: float = HEARTBEAT_S

    def __init__(self, worker_id: str | None = None, retention_s: float = DEFAULT_RETENTION_S) -> None:
        self.worker_id = worker_id or f"w-{secrets.token_hex(4)}"
        self.worker_url: str | None = None  # where clients reach this worker (set by the server)
        self.retention_s = retention_s
        self._logs: dict[str, list[dict]] = {}
        self._snapshots: dict[str, dict] = {}
        self._owners: dict[str, str] = {}
        self._closed_at: dict[str, float] = {}
        self._blobs: dict[str, tuple[bytes, float]] = {}
        self._beat_lock = asyncio.Lock()
        self._beats = 0  # heartbeats tried (see `beat`)
        self._settling = False  # a beat found this worker forgotten and is checking its sessions
        self._lease_until = float("inf")  # monotonic time until which this worker's heartbeat surely lives
        self._beat_failed_at = float("-inf")

    # ---- lifecycle ------------------------------------------------------------------------

    async def start(self) -> "Store":
        return self

    async def heartbeat(self) -> bool:
        """Say this worker is alive (and where it listens). True when the store had forgotten
        this worker since its last beat (it restarted empty, or this worker was paused past its
        TTL): another worker may own its sessions now, and the store may have lost their logs."""
        return False

    async def flush(self) -> None:
        """Everything appended so far is durable (appends already are when they return)."""

    async def close(self) -> None:
        await self.flush()

    # ---- event log ------------------------------------------------------------------------

    async def append(self, session_id: str, record: dict, n: int | None = None, rid: str | None = None) -> int:
        """Append one record; returns its position `n` (1-based). Durable on return.

        With `n` (and `rid`, the record's id) the write is idempotent by (session, n): when
        position n already holds the record `rid`, it returns n and writes nothing; when it holds
        another record, or the log is shorter than n - 1, it raises Conflict."""
        log = self._logs.setdefault(session_id, [])
        last = log[-1]["n"] if log else 0
        if n is not None:
            _check_position(session_id, n, rid, last, lambda: (_at(log, n) or {}).get("rid"), _gap_ok(record))
            if n <= last:
                return n
        record = {**record, "n": max(n or 0, last + 1), **({"rid": rid} if rid else {})}
        log.append(record)
        return record["n"]

    async def record_at(self, session_id: str, n: int) -> dict | None:
        """The record at position n (with its `rid`), or None."""
        return _at(await self.read_log(session_id), n)

    async def read_log(self, session_id: str) -> list[dict]:
        return list(self._logs.get(session_id, ()))

    async def log_length(self, session_id: str) -> int:
        """The position of the log's last record (0: no log); a compacted log holds fewer."""
        log = self._logs.get(session_id)
        return log[-1]["n"] if log else 0

    async def compact(self, session_id: str, upto: int, superseded: tuple[str, ...] = ()) -> int:
        """Drop the records after the creation (position 1) and before position `upto` (a
        checkpoint: replay starts there); returns how many went. Blobs only they named expire
        after the retention time from then on; `superseded` (earlier checkpoints' K/V, which
        only this session names) go now unless a kept record names them."""
        log = self._logs.get(session_id, [])
        keep = [r for r in log if r["n"] == 1 or r["n"] >= upto]
        self._logs[session_id] = keep
        named = {r.get("blob") for r in keep}
        for digest in superseded:
            if digest not in named:
                self._blobs.pop(digest, None)
        _drop_expired_blobs(self)
        return len(log) - len(keep)

    def expire(self) -> None:
        """Remove what outlived the retention time now (also done at each close and blob put)."""
        _expire_memory(self)

    async def closed(self, session_id: str) -> None:
        """The session closed: its data expire after the retention time."""
        self._closed_at[session_id] = time.time()
        self._owners.pop(session_id, None)
        _expire_memory(self)

    # ---- blobs (media inputs, content-addressed) -------------------------------------------

    async def put_blob(self, digest: str, data: bytes) -> None:
        """Keep `data` under its content address `digest` (a hex sha256) for the retention time
        (from its last put). Durable on return, like `append`: log it before the record naming it."""
        _check_digest(digest)
        self._blobs[digest] = (data, time.time())
        _drop_expired_blobs(self)

    async def get_blob(self, digest: str, take: bool = False) -> bytes | None:
        """The blob at `digest`, or None. `take`: it is dropped as it is read (a drain's handoff
        blob, used once: of two readers only one gets it)."""
        _check_digest(digest)
        entry = self._blobs.pop(digest, None) if take else self._blobs.get(digest)
        return entry[0] if entry is not None else None

    # ---- directory ------------------------------------------------------------------------

    async def claim(self, session_id: str) -> str | None:
        """Make this worker the session's owner unless a live worker owns it; returns the
        live owner's id when the claim fails, else None."""
        owner = self._owners.get(session_id)
        if owner not in (None, self.worker_id):
            return owner
        self._owners[session_id] = self.worker_id
        return None

    async def owner(self, session_id: str) -> dict | None:
        """{"worker": id, "url": ..., "alive": bool} of the session's owner, or None."""
        worker = self._owners.get(session_id)
        if worker is None:
            return None
        return {"worker": worker, "url": self.worker_url, "alive": worker == self.worker_id}

    async def release(self, session_id: str) -> None:
        if self._owners.get(session_id) == self.worker_id:
            del self._owners[session_id]

    # ---- snapshots ------------------------------------------------------------------------

    async def put_snapshot(self, session_id: str, snapshot: dict) -> None:
        self._snapshots[session_id] = snapshot

    async def snapshot(self, session_id: str) -> dict | None:
        return self._snapshots.get(session_id)

    async def snapshots(self) -> list[dict]:
        """Every session's latest snapshot (all workers), newest activity first."""
        return sorted(self._snapshots.values(), key=lambda s: -(s.get("updated_at") or 0))


MemoryStore = Store

_DIGEST = re.compile(r"[0-9a-f]{64}")


def _expire_memory(store: Store) -> None:
    """The in-process store's retention: closed sessions' logs and snapshots, then blobs."""
    cutoff = time.time() - store.retention_s
    for sid in [s for s, t in store._closed_at.items() if t <= cutoff]:
        store._closed_at.pop(sid)
        store._logs.pop(sid, None)
        store._snapshots.pop(sid, None)
    _drop_expired_blobs(store)


def _drop_expired_blobs(store: Store) -> None:
    """Blobs past the retention time that no kept log names (those never expire)."""
    cutoff = time.time() - store.retention_s
    live = {r["blob"] for log in store._logs.values() for r in log if isinstance(r.get("blob"), str)}
    for key in [k for k, (_, t) in store._blobs.items() if t <= cutoff and k not in live]:
        del store._blobs[key]


def lease_lapsed(store: Store) -> bool:
    """Whether this worker's heartbeat may have expired in the store since its last beat
    (the process was paused, or its event loop stalled, past WORKER_TTL_S), so that another
    worker may have adopted its sessions; False for a while after a beat failed (a store that
    does not answer cannot say, and nobody can adopt through it: the heartbeat loop tries
    again). Never for a store of one process (its lease never ends)."""
    if store._settling:  # renewed, but which sessions are still ours is being checked
        return True
    now = time.monotonic()
    return now > store._lease_until and now - store._beat_failed_at > store.heartbeat_s


def _check_digest(digest: str) -> None:
    if not _DIGEST.fullmatch(digest):
        raise StoreError(f"blob address {digest[:80]!r} is not a hex sha256")


def _gap_ok(record: dict) -> bool:
    """A checkpoint may follow a gap: a compacted log re-written after the store lost it holds
    its creation, then the last checkpoint and what came after it."""
    return record.get("kind") == "checkpoint"


def _check_position(session_id: str, n: int, rid: str | None, length: int, rid_at, gap_ok: bool = False) -> None:
    """Idempotent writes by (session, n): raise Conflict unless position n is free and next (or
    past a gap, for a checkpoint), or already holds record `rid`."""
    if n > length + 1 and not gap_ok:
        raise LogGap(f"log of session {session_id} has {length} records; cannot write position {n}")
    if n <= length:
        holder = rid_at()
        if rid is None or holder != rid:
            raise Conflict(f"position {n} of the log of session {session_id} holds record {holder}", holder)


def _at(log: list[dict], n: int) -> dict | None:
    """The record at position n of a log in position order (it may have gaps: compacted)."""
    i = bisect.bisect_left(log, n, key=lambda r: r["n"])
    return log[i] if i < len(log) and log[i]["n"] == n else None


async def beat(store: Store, on_forgotten=None) -> None:
    """One heartbeat; when the store had forgotten this worker, `await on_forgotten()` before
    any other beat returns. Single flight: a beat that waited for a running one returns with it
    (that one's outcome stands), so the heartbeat loop and the commands that need a fresh lease
    share one round trip. Raises StoreError when the store does not answer."""
    done = store._beats
    async with store._beat_lock:
        if store._beats != done:
            return
        try:
            forgotten = await store.heartbeat()
            if forgotten and on_forgotten is not None:
                logging.getLogger(__name__).warning(
                    "the store had forgotten this worker (it restarted empty, or this worker was paused past its "
                    "heartbeat TTL): checking who owns its sessions, re-writing the logs it lost")
                store._settling = True  # commands meanwhile wait for this beat (`lease_lapsed`)
                await on_forgotten()
        finally:
            store._settling = False
            store._beats += 1  # counted once settled: a command that waited returns after the check


async def heartbeat_loop(store: Store, interval_s: float | None = None, on_forgotten=None) -> None:
    """Beat every `interval_s` (default: the store's heartbeat_s); when the store had forgotten
    this worker, await `on_forgotten()` (the event log drops the sessions another worker adopted
    and re-writes what the store lost)."""
    interval_s = store.heartbeat_s if interval_s is None else interval_s
    while True:
        try:
            await beat(store, on_forgotten)
        except Exception:  # a Redis hiccup must not stop the beat for good
            logging.getLogger(__name__).warning("heartbeat to the store failed", exc_info=True)
        await asyncio.sleep(interval_s)
