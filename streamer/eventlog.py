"""The event log at the edge: the durability contract (docs/architecture.md, "Durability").

Every change of a session goes through that session's one ordered pipeline (a FIFO lock), so
the log's order is the engine's order:

- **logged first** (client inputs and settings: `input.text.append|revise`, `input.end`,
  `session.update`, `flash.unregister`): the record is written, and only once it is durable is
  the change handed to the engine. A write that fails is never applied and takes no seq; the
  client is told `store_unavailable` (recoverable) and resends it, and the resend is accepted.
- **applied first** (what needs the engine's answer to be logged: `flash.register` with the
  id it gets, media observations and transcripts, window settings the media path makes): the
  change is made, then logged. A write that fails keeps the record as the session's *pending*
  record; it is written before anything else of the session, so the log never has a gap.

Writes are idempotent by (session, position n) with a record id: a write that timed out (it may
have landed: a stalled Redis) stays *pending*, and is settled before the next change, or by a
retry loop once the store answers: an applied record is written again (a no-op if it landed);
an unapplied one was answered `store_unavailable` (not applied), so it never takes effect: its
position is fenced with a `void` record, or, if it landed after all, a `void` record right after
it cancels it (replay skips both), and its resend is a new input. A logged-first input the
engine refused for its size or memory (`context_overflow`, `kv_budget_exceeded`: another worker
might accept it) is voided the same way, so replay skips it as the live session did. After a
failure, the changes already queued behind it fail too, and later inputs above the failed
client_seq are refused until it is resent, so the client_seq high-water mark moves only with
durable writes, in order.

A store that lost a session (Redis restarted empty: StoreLost) gets it back: this worker
re-claims it and re-writes its log from the copy kept in memory (`relog_max_bytes` per session;
beyond it the copy is dropped and such a session fails with a non-recoverable
`store_unavailable` saying to recreate it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from streamer.sessions.errors import Code, EngineError

from .loopbridge import bridge
from .directory import Directory, Moved
from .records import Checkpoint, Create, Record, Void, note_event_ids
from .recovery import applied
from .store_base import Conflict, LogGap, NotOwner, Store, StoreError, StoreLost

log = logging.getLogger(__name__)

DEFAULT_RELOG_MAX_BYTES = 16 << 20
DEFAULT_CHECKPOINT_RECORDS = 1000  # a checkpoint at least every this many records
DEFAULT_CHECKPOINT_MIN_RECORDS = 16  # ... and after a window slide once this many records passed
MIRROR_SLOT_BYTES = 24  # per record of the log copy beyond its bytes object: list slot, list growth, rounding
SETTLE_RETRY_S = 0.5
DUPLICATE = object()  # what `first` resolves to for an input that turned out to be in the log already
# Engine refusals of a logged-first change that another worker (other limits, more memory) might
# not repeat: the record is voided (a `void` record after it), so replay skips it, as live did
VOIDED_REFUSALS = frozenset({Code.CONTEXT_OVERFLOW, Code.KV_BUDGET_EXCEEDED})


def unavailable(message: str, recoverable: bool = True) -> EngineError:
    return EngineError(message, code=Code.STORE_UNAVAILABLE, recoverable=recoverable)


@dataclass(eq=False)
class Pending:
    """A record whose write failed: applied (write it again) or not (void it: never applied)."""

    n: int
    rid: str
    data: dict
    applied: bool
    client_seq: int | None = None
    landed: bool = False  # an unapplied one found at position n after all: voided by a record after it
    void_rid: str = field(default_factory=lambda: _rid())  # the void's id, the same on every try (idempotent)


@dataclass(eq=False)
class Pipe:
    """One session's log state on this worker."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    next_n: int = 1
    mirror: list[bytes] | None = field(default_factory=list)  # each record written, as compact JSON (n, rid in it)
    mirror_bytes: int = 0  # what the copy costs in memory (counted as allocated, see LogWriter.mirror)
    pending: Pending | None = None
    enqueued: int = 0  # changes submitted
    broken_upto: int = 0  # changes submitted up to this count fail: one before them was not logged
    resend_from: int | None = None  # the lowest client_seq that failed: inputs above it wait for it
    inflight: dict[int, asyncio.Task] = field(default_factory=dict)  # client_seq -> its change
    passed: int = 0  # changes handed to the engine (or refused), in order
    waiters: list = field(default_factory=list)  # (count, future): barriers waiting for `passed`
    retrying: asyncio.Task | None = None
    closed: bool = False
    since_checkpoint: int = 0  # records written since the last checkpoint (or the start here)
    slid: bool = False  # the window evicted inputs since the last checkpoint
    slides: int = 0  # the window's slide count last seen
    checkpoint_blob: str | None = None  # the K/V blob of the last checkpoint written here
    checkpointing: asyncio.Task | None = None
    event_ids: OrderedDict = field(default_factory=OrderedDict)  # client event ids the log holds (note_event_ids)


class LogWriter:
    """Writing one session's records: at its next position, idempotent by (position, record id);
    the in-memory copy a lost log is re-written from; settling a pending (failed) write."""

    def __init__(self, store: Store, directory: Directory, relog_max_bytes: int, counters: dict,
                 lost: Callable[[str, dict], None] | None = None) -> None:
        self.store, self.directory, self.relog_max_bytes, self.counters = store, directory, relog_max_bytes, counters
        self.lost = lost  # (session id, owner): another worker owns the session now
        self.written: Callable[[str, Pipe, dict], None] | None = None  # after each record (the Checkpointer)

    async def owned_elsewhere(self, sid: str) -> Moved | None:
        """After the store refused a write as not this worker's: the session's new owner, if
        another worker holds it (the session is then dropped here, `lost`), else None."""
        try:
            owner = await self.store.owner(sid)
        except (StoreError, OSError, ConnectionError):
            return None
        if owner is None or owner["worker"] == self.store.worker_id:
            return None
        if self.lost is not None:
            self.lost(sid, owner)
        return Moved(sid, owner)

    async def write(self, sid: str, pipe: Pipe, data: dict, rid: str, client_seq: int | None = None) -> None:
        """Write one record at the session's next position (idempotent by position and id)."""
        n = pipe.next_n
        try:
            try:
                await self.store.append(sid, data, n=n, rid=rid)
            except (StoreLost, LogGap):  # the store lost it, or an earlier re-write was cut off
                await self.relog(sid, pipe)
                await self.store.append(sid, data, n=n, rid=rid)
        except (StoreError, OSError, ConnectionError) as exc:
            self.counters["log_errors"] += 1
            if isinstance(exc, NotOwner) and not isinstance(exc, StoreLost):
                if (moved := await self.owned_elsewhere(sid)) is not None:
                    log.warning("session %s was adopted by worker %s: this worker's copy is dropped", sid,
                                moved.owner["worker"])
                    raise moved from None
            log.error("could not log %s on session %s: %s", data.get("kind"), sid, exc)
            if isinstance(exc, Conflict) and exc.holder is None:
                raise unavailable(f"the log of session {sid} is not where this worker left it ({exc}); "
                                  "close and recreate the session", recoverable=False) from None
            raise unavailable(f"the change could not be logged ({exc}); it is not acknowledged: resend it") from None
        pipe.next_n = n + 1
        self.mirror(pipe, n, rid, {**data, "n": n})
        self.counters["log_records"] += 1
        self.directory.logged(sid, client_seq if client_seq is not None else data.get("client_seq"))
        note_event_ids(pipe.event_ids, data)
        if self.written is not None:
            self.written(sid, pipe, data)

    def mirror(self, pipe: Pipe, n: int, rid: str, record: dict) -> None:
        """Keep a copy of the record written at `n`, for `relog`. It is kept as compact JSON
        bytes (a dict of fields cost ~0.9 KB a record) and counted as allocated: the bytes
        object's own size plus MIRROR_SLOT_BYTES (its list slot, the list's growth and the
        allocator's rounding), so `relog_max_bytes` bounds the memory the copy really takes."""
        if pipe.mirror is None:
            return
        body = {k: v for k, v in record.items() if k not in ("n", "rid", "session_id")}
        blob = json.dumps({"n": n, "rid": rid, **body}, ensure_ascii=False, separators=(",", ":")).encode()
        size = sys.getsizeof(blob) + MIRROR_SLOT_BYTES
        if pipe.mirror_bytes + size > self.relog_max_bytes:
            pipe.mirror = None  # too big to keep: a store that loses this session cannot get it back
            pipe.mirror_bytes = 0
            return
        pipe.mirror_bytes += size
        pipe.mirror.append(blob)

    @staticmethod
    def prune(pipe: Pipe, upto: int) -> None:
        """The log was compacted up to `upto`: the copy keeps what the log keeps."""
        if pipe.mirror is None:
            return
        kept = [b for b in pipe.mirror if (n := json.loads(b)["n"]) == 1 or n >= upto]
        pipe.mirror = kept
        pipe.mirror_bytes = sum(sys.getsizeof(b) + MIRROR_SLOT_BYTES for b in kept)

    @staticmethod
    def mirrored(pipe: Pipe) -> list[tuple[int, str, dict]]:
        """The copy as (n, rid, record without n and rid), in log order."""
        out = []
        for blob in pipe.mirror or ():
            record = json.loads(blob)
            out.append((record.pop("n"), record.pop("rid"), record))
        return out

    async def relog(self, sid: str, pipe: Pipe) -> None:
        """The store lost the session (it restarted empty), or a re-write of it was cut off by
        the next fault: claim it again and write back from memory what the log lacks (the
        records it holds are this worker's: only the owner appends)."""
        if pipe.mirror is None:
            raise unavailable(f"the store lost the log of session {sid} and its copy here is over "
                              f"{self.relog_max_bytes} bytes; close and recreate the session", recoverable=False)
        owner = await self.store.claim(sid)
        if owner is not None:
            if (moved := await self.owned_elsewhere(sid)) is not None:
                raise moved
            raise unavailable(f"session {sid} is now owned by worker {owner}", recoverable=False)
        have = await self.store.log_length(sid)
        missing = [(n, rid, record) for n, rid, record in self.mirrored(pipe) if n > have]
        for n, rid, record in missing:
            await self.store.append(sid, record, n=n, rid=rid)
        if missing:
            self.counters["relogged"] += 1
            log.warning("the store lacked %d of the %d records of session %s: re-claimed and re-wrote them",
                        len(missing), len(pipe.mirror), sid)

    async def settle(self, sid: str, pipe: Pipe) -> None:
        """Resolve the pending record, if any (under the session's lock)."""
        pending = pipe.pending
        if pending is None:
            return
        if pending.applied:  # it must be in the log: write it again (a no-op if it landed)
            await self.write(sid, pipe, pending.data, pending.rid)
            pipe.pending = None
            self.counters["log_settled"] += 1
            return
        # Not applied: its client was told store_unavailable ("not applied, resend it"), so it
        # must never take effect, even if the write that timed out landed after all. Its position
        # is fenced with a void record; if the record is there, a void record after it cancels
        # it. Replay skips both (streamer.recovery.applied); the resend is a new input.
        void = Void(ts=time.time(), rid_of=pending.rid).to_json()
        if not pending.landed:
            try:
                await self.write(sid, pipe, void, pending.void_rid)
            except EngineError as exc:
                if await self.holder(sid, pending.n) != pending.rid:
                    raise exc
                pipe.next_n = pending.n + 1  # it landed: it stays in the log, cancelled right after it
                self.mirror(pipe, pending.n, pending.rid, {**pending.data, "n": pending.n})
                pending.landed, pending.void_rid = True, _rid()
                self.counters["log_voided_late"] += 1
                log.warning("a write of session %s that timed out landed later (position %d); voiding it: "
                            "its client was told it was not applied", sid, pending.n)
        if pending.landed:
            await self.write(sid, pipe, void, pending.void_rid)
        self.counters["log_fenced"] += 1
        pipe.pending = None

    async def void_refused(self, sid: str, pipe: Pipe, rid: str) -> None:
        """The engine refused a logged record (VOIDED_REFUSALS): a `void` record after it makes
        replay skip it. A write that fails stays pending, written before anything else."""
        data, void_rid = Void(ts=time.time(), rid_of=rid).to_json(), _rid()
        async with pipe.lock:
            if pipe.closed:
                return
            try:
                await self.settle(sid, pipe)
                await self.write(sid, pipe, data, void_rid)
            except EngineError as exc:
                if pipe.pending is None and exc.recoverable and exc.code != Code.MOVED:
                    pipe.pending = Pending(pipe.next_n, void_rid, data, True)
                    self.retry(sid, pipe)
                log.warning("session %s: the void of a refused input is not logged yet (%s)", sid, exc.message)
                return
            self.counters["log_voided_refused"] += 1

    async def holder(self, sid: str, n: int) -> str | None:
        try:
            record = await self.store.record_at(sid, n)
        except (StoreError, OSError, ConnectionError):
            return None
        return record.get("rid") if record else None

    def retry(self, sid: str, pipe: Pipe) -> None:
        """Settle the pending record as soon as the store answers, even if no change comes."""
        if pipe.retrying is not None and not pipe.retrying.done():
            return

        async def retry() -> None:
            while not pipe.closed and pipe.pending is not None:
                await asyncio.sleep(SETTLE_RETRY_S)
                async with pipe.lock:
                    try:
                        await self.settle(sid, pipe)
                    except EngineError as exc:
                        if not exc.recoverable:
                            return
                        continue

        pipe.retrying = asyncio.get_running_loop().create_task(retry())



class Checkpointer:
    """Checkpoints in the log (docs/architecture.md, "Recovery in O(window)"): after a window slide once
    `min_records` records passed since the last checkpoint, and every `every` records, the
    session's state and K/V are captured (sessions/checkpoint.py), the K/V is put as a blob,
    a `checkpoint` record is written, and the log before it is compacted (Store.compact),
    together with the previous checkpoint's blob. So replay reads a window, and a live
    session's log and blobs stay bounded.

    A checkpoint is taken under the session's log lock, so it holds exactly what the records
    before it applied; a session still reading its backlog, or writing a note, is tried again
    a little later (the lock is let go meanwhile: inputs go on being logged). A feed that keeps
    the engine behind would put the checkpoint off for as long as it lasts (the log growing the
    while), so after HOLD_AFTER tries the lock is kept while the engine reads what it has: the
    session's next inputs wait (their acks come later), at most HOLD_S, once a checkpoint."""

    RETRY_S = 0.02
    TRIES = 250
    HOLD_AFTER = 25  # tries (~0.5 s) with the lock let go between them
    HOLD_S = 2.0  # then the most a checkpoint keeps the session's inputs waiting

    def __init__(self, engine, events: "EventLog", every: int = DEFAULT_CHECKPOINT_RECORDS,
                 min_records: int = DEFAULT_CHECKPOINT_MIN_RECORDS) -> None:
        if not 1 <= min_records <= every:
            raise ValueError(f"checkpoint_min_records {min_records} must be in [1, checkpoint_records={every}]")
        self.engine, self.events, self.every, self.min_records = engine, events, every, min_records

    def due(self, pipe: Pipe) -> bool:
        return pipe.since_checkpoint >= self.every or (pipe.slid and pipe.since_checkpoint >= self.min_records)

    def written(self, sid: str, pipe: Pipe, data: dict) -> None:
        """After a record is durable: count it, and start a checkpoint when one is due."""
        if data.get("kind") == "checkpoint":
            return
        pipe.since_checkpoint += 1
        slides = self._slides(sid)
        pipe.slid = pipe.slid or bool(data.get("evicted")) or slides != pipe.slides
        pipe.slides = slides
        if self.due(pipe) and (pipe.checkpointing is None or pipe.checkpointing.done()) and not pipe.closed:
            pipe.checkpointing = self.events.spawn(self.run(sid, pipe))

    def _slides(self, sid: str) -> int:
        """How often the session's window has slid (read from the engine's thread: a hint that
        may be a step old; an input logged before it is applied carries no evictions)."""
        session = self.engine.core.sessions.get(sid)
        window = session.window if session is not None else None
        return window.slides if window is not None else 0

    async def run(self, sid: str, pipe: Pipe) -> bool:
        """Take a checkpoint of the session now (records were written since the last one);
        True when one was written."""
        from streamer.sessions.checkpoint import capture

        def attempt():
            return asyncio.wrap_future(self.engine.call(lambda: capture(self.engine.core, sid), session_id=sid))

        loop = asyncio.get_running_loop()
        for tried in range(self.TRIES):
            async with pipe.lock:
                if pipe.closed or pipe.pending is not None or pipe.since_checkpoint == 0:
                    return False
                try:
                    got = await attempt()
                    if got is None and tried == self.HOLD_AFTER:  # hold the inputs while the engine catches up
                        until = loop.time() + self.HOLD_S
                        while got is None and loop.time() < until and not pipe.closed:
                            await asyncio.sleep(self.RETRY_S)
                            got = await attempt()
                    if got is not None:
                        await self._write(sid, pipe, *got)
                        return True
                except (EngineError, StoreError, OSError) as exc:  # the next records try again
                    self.events.counters["checkpoint_errors"] += 1
                    log.warning("checkpoint of session %s failed: %s", sid, exc)
                    return False
            await asyncio.sleep(self.RETRY_S)
        return False

    async def _write(self, sid: str, pipe: Pipe, state: dict, tensors: dict) -> None:
        from streamer.sessions.checkpoint import pack

        store, writer = self.events.store, self.events.writer
        digest, blob = await asyncio.to_thread(pack, tensors)
        await store.put_blob(digest, blob)
        tracked = self.events.directory.get(sid)
        upto = pipe.next_n
        record = Checkpoint(ts=time.time(), state=state, blob=digest,
                            client_seq=tracked.acked_client_seq if tracked is not None else None,
                            event_ids=[[k, v] for k, v in pipe.event_ids.items()] or None)
        data, rid = record.to_json(), _rid()
        try:
            await writer.write(sid, pipe, data, rid)
        except EngineError as exc:  # it may have landed (a timeout): written again before the next record
            if pipe.pending is None and exc.recoverable and exc.code != Code.MOVED:
                pipe.pending = Pending(pipe.next_n, rid, data, True)
                writer.retry(sid, pipe)
            raise
        superseded = (pipe.checkpoint_blob,) if pipe.checkpoint_blob not in (None, digest) else ()
        dropped = await store.compact(sid, upto, superseded)
        pipe.checkpoint_blob, pipe.since_checkpoint, pipe.slid = digest, 0, False
        writer.prune(pipe, upto)
        self.events.counters["checkpoints"] += 1
        self.events.counters["log_compacted"] += dropped
        log.info("session %s: checkpoint at record %d (%d inputs, %d tokens, %d bytes of K/V); %d records compacted",
                 sid, upto, len(state["chunks"]), state["length"], len(blob), dropped)


class EventLog:
    def __init__(self, store: Store, directory: Directory, relog_max_bytes: int = DEFAULT_RELOG_MAX_BYTES,
                 engine=None, checkpoint_records: int = DEFAULT_CHECKPOINT_RECORDS,
                 checkpoint_min_records: int = DEFAULT_CHECKPOINT_MIN_RECORDS) -> None:
        self.store = store
        self.directory = directory
        self.relog_max_bytes = relog_max_bytes
        self.pipes: dict[str, Pipe] = {}
        self.writes: set[asyncio.Task] = set()
        self.counters = {"log_records": 0, "log_errors": 0, "log_settled": 0, "log_fenced": 0, "log_voided_late": 0,
                         "log_voided_refused": 0, "relogged": 0, "checkpoints": 0, "checkpoint_errors": 0,
                         "log_compacted": 0}
        self.on_lost: Callable[[str, dict], None] | None = None  # set by the Resumer: drop a session here
        self.writer = LogWriter(store, directory, relog_max_bytes, self.counters, self.lose)
        # without an engine (tools, tests of the log alone) no checkpoints are taken
        self.checkpointer = (Checkpointer(engine, self, checkpoint_records, checkpoint_min_records)
                             if engine is not None and checkpoint_records > 0 else None)
        if self.checkpointer is not None:
            self.writer.written = self.checkpointer.written

    def lose(self, session_id: str, owner: dict) -> None:
        """Another worker owns the session now: it goes from this worker (`on_lost`)."""
        if self.on_lost is not None:
            self.on_lost(session_id, owner)
        else:
            self.directory.moved(session_id, owner)
            self.forget(session_id)

    async def store_restarted(self) -> None:
        """The store forgot this worker (its heartbeat key was gone: Redis restarted empty, or
        this worker was paused past its heartbeat TTL). First, the sessions another worker
        owns now (it adopted them meanwhile) are dropped here at once (`lose`): their clients
        are told `moved`, none is answered from this stale copy. Then every other session this
        worker logs is re-claimed and its log re-written now, not at its next change, so acked
        inputs are durable again even if no input comes."""
        for sid in sorted(set(self.pipes) | set(self.directory.sessions)):
            await self.writer.owned_elsewhere(sid)
        for sid, pipe in list(self.pipes.items()):
            if pipe.closed or pipe.mirror is None:
                continue
            async with pipe.lock:
                try:
                    await self.writer.relog(sid, pipe)
                except (EngineError, StoreError, OSError, ConnectionError) as exc:
                    log.warning("re-writing the log of session %s after the store restarted: %s", sid, exc)
                    continue
            if self.checkpointer is not None and pipe.checkpoint_blob is not None:
                # the re-written log names a checkpoint whose K/V blob went with the store: a new
                # checkpoint (blob and record) makes the log replayable again
                pipe.since_checkpoint = max(pipe.since_checkpoint, 1)
                await self.checkpointer.run(sid, pipe)

    def spawn(self, coro) -> asyncio.Task:
        """A change or store write owned by the log, not by a connection (it survives the client)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its waiter may be gone
        return task

    async def drain(self, timeout: float = 30.0) -> None:
        if self.writes:  # accepted changes still on their way to the log
            await asyncio.wait(list(self.writes), timeout=timeout)
        for pipe in self.pipes.values():
            if pipe.retrying is not None:
                pipe.retrying.cancel()

    # ---- sessions ---------------------------------------------------------------------------

    def open(self, session_id: str, raw: list[dict] | None = None) -> Pipe:
        """A session live on this worker: new, or recovered from its log `raw`."""
        pipe = self.pipes.get(session_id)
        if pipe is None:
            pipe = self.pipes[session_id] = Pipe()
            for record in raw or ():
                self.writer.mirror(pipe, record.get("n") or pipe.next_n, record.get("rid") or _rid(), record)
                pipe.next_n = max(pipe.next_n, (record.get("n") or 0) + 1)
                if record.get("kind") == "checkpoint":  # the blob the next checkpoint supersedes
                    pipe.checkpoint_blob, pipe.since_checkpoint = record.get("blob"), 0
                else:
                    pipe.since_checkpoint += 1
            for record in applied(raw or []):
                note_event_ids(pipe.event_ids, record)
        return pipe

    def forget(self, session_id: str) -> None:
        pipe = self.pipes.pop(session_id, None)
        if pipe is not None:
            pipe.closed = True
            if pipe.retrying is not None:
                pipe.retrying.cancel()

    async def created(self, session_id: str, record: Create) -> None:
        """Log a new session's creation after claiming it in the directory. An id whose log
        exists (a session that closed within the retention time, or one live on another
        worker) is refused."""
        pipe = self.open(session_id)
        async with pipe.lock:
            try:
                if await self.store.log_length(session_id):
                    raise EngineError(f"session id {session_id!r} was used before (its log is kept for "
                                      f"{self.store.retention_s:.0f} s after it closes)", code=Code.INVALID_FIELD)
                owner = await self.store.claim(session_id)
            except StoreError as exc:
                self.forget(session_id)
                self.counters["log_errors"] += 1
                raise unavailable(f"the store cannot take a new session now ({exc}); retry session.create") from None
            except BaseException:
                self.forget(session_id)
                raise
            if owner is not None:
                self.forget(session_id)
                raise EngineError(f"session id {session_id!r} is in use on worker {owner}", code=Code.INVALID_FIELD)
            try:
                await self.writer.write(session_id, pipe, record.to_json(), _rid())
            except EngineError:
                self.forget(session_id)
                raise

    async def closing(self, session_id: str, record: Record) -> None:
        """Log the session's close (after what is still queued) and stop tracking it."""
        pipe = self.pipes.get(session_id)
        if pipe is None:  # not tracked here (an engine-only session): append after what the log holds
            pipe = self.open(session_id)
            pipe.mirror = None
            pipe.next_n = await self.store.log_length(session_id) + 1
        try:
            async with pipe.lock:
                await self.writer.settle(session_id, pipe)
                await self.writer.write(session_id, pipe, record.to_json(), _rid())
        finally:
            self.forget(session_id)

    # ---- changes ----------------------------------------------------------------------------

    def barrier(self, session_id: str | None) -> asyncio.Future | None:
        """A future that resolves once every change submitted so far to the session has been
        handed to the engine (or refused); None when there is nothing to wait for. A command
        that reads or uses the session directly (a question, a rule) waits on it, so it sees
        the inputs its client sent before it."""
        pipe = self.pipes.get(session_id) if session_id is not None else None
        if pipe is None or pipe.passed >= pipe.enqueued:
            return None
        fut = asyncio.get_running_loop().create_future()
        pipe.waiters.append((pipe.enqueued, fut))
        return fut

    @staticmethod
    def _pass(pipe: Pipe) -> None:
        pipe.passed += 1
        ready = [w for w in pipe.waiters if w[0] <= pipe.passed]
        if ready:
            pipe.waiters = [w for w in pipe.waiters if w[0] > pipe.passed]
            for _, fut in ready:
                if not fut.done():
                    fut.set_result(None)

    def duplicate(self, session_id: str, client_seq: int | None):
        """For an input with `client_seq`: True if it is in the log, the still running change
        that carries it (the resend waits for it), or None (not seen: a new input)."""
        tracked = self.directory.get(session_id)
        if client_seq is None or tracked is None:
            return None
        if client_seq <= tracked.acked_client_seq:
            self.directory.duplicates += 1
            return True
        pipe = self.pipes.get(session_id)
        running = pipe.inflight.get(client_seq) if pipe is not None else None
        if running is not None:
            self.directory.duplicates += 1
        return running

    def first(self, session_id: str, record: Record, apply: Callable[[], Future],
              client_seq: int | None = None) -> asyncio.Task:
        """Log `record`, then make the change (`apply()`: the engine call); a task of the
        engine's result, or store_unavailable (nothing applied)."""
        record.first = True
        pipe = self.pipes.get(session_id) or self.open(session_id)
        pipe.enqueued += 1
        task = self.spawn(self._first(session_id, pipe, pipe.enqueued, record, apply, client_seq))
        if client_seq is not None:
            pipe.inflight[client_seq] = task
            task.add_done_callback(lambda _: pipe.inflight.get(client_seq) is task and pipe.inflight.pop(client_seq))
        return task

    def after(self, session_id: str, call: Callable[[], Future], record_of: Callable[[Any], Record | None]):
        """Make the change (`call()`), then log `record_of(result)`; a task of the engine's
        result, or store_unavailable (applied, not logged yet: it is logged before anything
        else of this session)."""
        pipe = self.pipes.get(session_id) or self.open(session_id)
        pipe.enqueued += 1
        return self.spawn(self._after(session_id, pipe, pipe.enqueued, call, record_of))

    def from_thread(self, session_id: str, call: Callable[[], Future], record_of, loop: asyncio.AbstractEventLoop,
                    then: Callable[[Future], None] | None = None) -> Future:
        """`after` for a change made on another thread (media): a concurrent future of the
        engine's result (the change is applied whatever the log write does; a failed write
        stays pending and is written first when the store answers)."""
        out: Future = Future()
        if then is not None:
            out.add_done_callback(then)

        def start() -> None:
            task = self.after(session_id, call, record_of)

            def relay(t: asyncio.Task) -> None:
                exc = t.exception() if not t.cancelled() else EngineError("cancelled", code=Code.ENGINE_STOPPED)
                result = getattr(exc, "applied", None)
                if exc is None:
                    out.set_result(t.result())
                elif result is not None:  # applied; its record is pending
                    out.set_result(result[0])
                else:
                    out.set_exception(exc)

            task.add_done_callback(relay)

        loop.call_soon_threadsafe(start)
        return out

    def _refused(self, pipe: Pipe, index: int, client_seq: int | None) -> EngineError | None:
        if pipe.closed:
            return EngineError("the session closed", code=Code.SESSION_CLOSED)
        if index <= pipe.broken_upto:
            return unavailable("not logged: a change sent before it could not be logged" +
                               (f"; resend from client_seq {pipe.resend_from}" if pipe.resend_from else "; resend it"))
        if client_seq is not None and pipe.resend_from is not None and client_seq > pipe.resend_from:
            return unavailable(f"not logged: input client_seq {pipe.resend_from} could not be logged; resend from it")
        return None

    def _broke(self, pipe: Pipe, client_seq: int | None) -> None:
        pipe.broken_upto = pipe.enqueued
        if client_seq is not None:
            pipe.resend_from = client_seq if pipe.resend_from is None else min(pipe.resend_from, client_seq)

    async def _first(self, sid: str, pipe: Pipe, index: int, record: Record, apply, client_seq):
        try:
            fut, rid = await self._log_then_apply(sid, pipe, index, record, apply, client_seq)
        finally:
            self._pass(pipe)
        if fut is DUPLICATE:
            return fut
        try:
            return await bridge(asyncio.get_running_loop()).wrap(fut)
        except EngineError as exc:
            if getattr(record, "event_id", None) is not None:  # refused: a resend of its event is a new try
                pipe.event_ids.pop(record.event_id, None)
            if exc.code in VOIDED_REFUSALS:
                await self.writer.void_refused(sid, pipe, rid)
            raise

    async def _log_then_apply(self, sid: str, pipe: Pipe, index: int, record: Record, apply, client_seq):
        async with pipe.lock:
            if (refusal := self._refused(pipe, index, client_seq)) is not None:
                raise refusal
            rid = _rid()
            record.ts = time.time()
            data = record.to_json()
            try:
                await self.writer.settle(sid, pipe)
                tracked = self.directory.get(sid)
                if client_seq is not None and tracked is not None and client_seq <= tracked.acked_client_seq:
                    self.directory.duplicates += 1
                    return DUPLICATE, None  # the settled write was this input: it is in the log and applied
                await self.writer.write(sid, pipe, data, rid, client_seq)
            except EngineError as exc:
                if pipe.pending is None and exc.recoverable and exc.code != Code.MOVED:
                    pipe.pending = Pending(pipe.next_n, rid, data, False, client_seq)
                    self.writer.retry(sid, pipe)
                self._broke(pipe, client_seq)
                raise
            if client_seq is not None and pipe.resend_from == client_seq:
                pipe.resend_from = None
            return apply(), rid  # in log order: the engine queues it behind the earlier changes

    async def _after(self, sid: str, pipe: Pipe, index: int, call, record_of):
        async with pipe.lock:
            try:
                if (refusal := self._refused(pipe, index, None)) is not None:
                    raise refusal
                try:
                    await self.writer.settle(sid, pipe)
                except EngineError:
                    self._broke(pipe, None)
                    raise
                fut = call()
            finally:
                self._pass(pipe)
            result = await bridge(asyncio.get_running_loop()).wrap(fut)
            record = record_of(result)
            if record is None:  # the call changed nothing that needs logging
                return result
            record.ts = time.time()
            data, rid = record.to_json(), _rid()
            try:
                await self.writer.write(sid, pipe, data, rid)
            except EngineError as exc:
                if exc.code == Code.MOVED:
                    raise
                if pipe.pending is None and exc.recoverable:
                    pipe.pending = Pending(pipe.next_n, rid, data, True)
                    self.writer.retry(sid, pipe)
                self._broke(pipe, None)
                failed = unavailable(f"the change was applied but is not logged yet ({exc.message}); it is logged "
                                     "before anything else of this session once the store answers")
                failed.applied = (result,)
                raise failed from None
            return result

def logged_event_ids(events: EventLog, session_id: str) -> dict:
    """The client event ids the session's log holds (at most MAX_LOGGED_EVENT_IDS, the newest
    last), with what each made: streamer.records.note_event_ids."""
    pipe = events.pipes.get(session_id)
    return dict(pipe.event_ids) if pipe is not None else {}


def _rid() -> str:
    return secrets.token_hex(8)
