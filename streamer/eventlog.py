"""The event log at the edge: every change a session accepts is appended to its log *before*
the client gets its acknowledgement, in the order the engine applied the changes.

A write is started from the engine's own completion of the change (the `then` callback that
`expect` or `hook` gives, attached to the engine call before its work is queued), so the log
order is the engine's order and a client that disconnects meanwhile cannot leave an applied
change out of the log. The writes are owned here,
not by a connection, so they survive the client; `drain` waits for the ones still on their way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

from streamer.sessions.errors import Code, EngineError

from .directory import Directory
from .records import Create, Record
from .store import Store, StoreError

log = logging.getLogger(__name__)

RecordOf = Callable[[object], Record | None]


class EventLog:
    def __init__(self, store: Store, directory: Directory) -> None:
        self.store = store
        self.directory = directory
        self.writes: set[asyncio.Task] = set()
        self.counters = {"log_records": 0, "log_errors": 0}

    def spawn(self, coro) -> asyncio.Task:
        """A store write owned by the log, not by a connection (it survives the client)."""
        task = asyncio.get_running_loop().create_task(coro)
        self.writes.add(task)
        task.add_done_callback(self.writes.discard)
        return task

    async def drain(self, timeout: float = 30.0) -> None:
        if self.writes:  # accepted changes still on their way to the log
            await asyncio.wait(list(self.writes), timeout=timeout)

    def expect(self, session_id: str, record_of: RecordOf) -> tuple[Callable[[Future], None], asyncio.Future]:
        """For an engine call about to be made: `then`, the done-callback to pass to it (it is
        attached before the engine can finish, so writes start in the order the engine applied
        the changes), and `durable`, an asyncio future that resolves once `record_of(result)`
        is in the log (or fails with store_unavailable). Call on the event loop."""
        loop = asyncio.get_running_loop()
        durable = loop.create_future()
        durable.add_done_callback(lambda d: d.cancelled() or d.exception())  # a waiter may be gone
        return (lambda f: loop.call_soon_threadsafe(self._start, session_id, f, record_of, durable)), durable

    def hook(self, session_id: str, record_of: RecordOf, loop: asyncio.AbstractEventLoop):
        """`expect`'s `then` for an engine call made on another thread (media ingest), whose
        caller does not wait for the write."""
        return lambda f: loop.call_soon_threadsafe(self._start, session_id, f, record_of, None)

    def _start(self, session_id: str, f: Future, record_of: RecordOf, done: asyncio.Future | None) -> None:
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
        if record is None:  # the call changed nothing that needs logging
            if done is not None:
                done.set_result(None)
            return
        task = self.spawn(self.append(session_id, record))
        if done is not None:
            task.add_done_callback(lambda t: done.set_exception(t.exception()) if t.exception() is not None
                                   else done.set_result(None))
        else:
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # append() reports its failures

    async def append(self, session_id: str, record: Record) -> None:
        """Append `record` to the session's log; raises store_unavailable when it cannot."""
        record.ts = time.time()
        try:
            await self.store.append(session_id, record.to_json())
        except (StoreError, OSError, ConnectionError) as exc:
            self.counters["log_errors"] += 1
            log.error("could not log %s on session %s: %s", record.kind, session_id, exc)
            raise EngineError(f"the change was applied but could not be logged ({exc}); it is not acknowledged "
                              "and would not survive a restart", code=Code.STORE_UNAVAILABLE) from None
        self.counters["log_records"] += 1
        self.directory.logged(session_id, getattr(record, "client_seq", None))

    async def created(self, session_id: str, record: Create) -> None:
        """Log a new session's creation after claiming it in the directory. An id whose log
        exists (a session that closed within the retention time, or one live on another
        worker) is refused."""
        if await self.store.log_length(session_id):
            raise EngineError(f"session id {session_id!r} was used before (its log is kept for "
                              f"{self.store.retention_s:.0f} s after it closes)", code=Code.INVALID_FIELD)
        owner = await self.store.claim(session_id)
        if owner is not None:
            raise EngineError(f"session id {session_id!r} is in use on worker {owner}", code=Code.INVALID_FIELD)
        await self.append(session_id, record)
