"""Handing work from the engine's threads to the event loop, one wake-up per batch.

`loop.call_soon_threadsafe` writes to the loop's self-pipe every time it is called: a system call
on the engine thread, after which that thread must win the GIL back from a busy event loop. With
many small commands a step (twenty connections each asking `session.get`, say) those hand-overs
took most of each command's time on the engine thread. A `LoopBridge` queues callbacks in order
and wakes the loop only when no wake-up is pending: while the loop is busy, everything the
engine hands it meanwhile rides the one wake-up already on its way. Callbacks run in the order
they were posted (every engine-to-loop hand-over of a connection goes through its loop's bridge:
an event is sent from its callback, a reply by the task its future wakes, a loop iteration or two
later, as with `asyncio.wrap_future`). While the engine runs a round of commands
(`sessions.futures.wakes_held`), the wake-up waits for the round's end, or for the first command
to end 2 ms after the hold began.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from streamer.sessions.futures import hold_wake, release_old_wakes

log = logging.getLogger("streamer.loopbridge")

_bridges: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_bridges_lock = threading.Lock()


class LoopBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the bridge is kept per loop: it must not keep its loop alive
        self._queue: deque = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self.posted = 0  # callbacks handed over
        self.wakeups = 0  # self-pipe writes they took

    def post(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on the loop, after everything posted before it. Safe from any thread;
        after the loop has closed the callback is dropped."""
        loop = self._loop()
        with self._lock:
            self.posted += 1
            if loop is None or loop.is_closed():  # nothing will run there again (a wake-up may
                self._drop()                      # have been pending when it closed)
                return
            self._queue.append((fn, args))
            first, self._scheduled = not self._scheduled, True
        if not first:  # a wake-up is on its way, or held by a round (made now if the round is too old)
            release_old_wakes()
        elif not hold_wake(self, self._wake):
            self._wake()

    def _wake(self) -> None:
        with self._lock:
            self.wakeups += 1
        loop = self._loop()
        try:
            if loop is not None:
                loop.call_soon_threadsafe(self._run)
                return
        except RuntimeError:  # the loop is closed
            pass
        with self._lock:  # nothing will run there again
            self._drop()

    def _drop(self) -> None:
        """Forget what is queued and any wake-up (under the lock): the loop is gone."""
        self._queue.clear()
        self._scheduled = False

    def _run(self) -> None:
        with self._lock:
            batch, self._queue = self._queue, deque()
            self._scheduled = False
        for fn, args in batch:
            try:
                fn(*args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException:  # one broken callback never drops the others (as asyncio's handles)
                log.exception("callback %r failed", fn)

    def wrap(self, fut: Future | asyncio.Future) -> asyncio.Future:
        """An asyncio future on the loop that takes `fut`'s outcome (asyncio.wrap_future, through
        the bridge; cancelling the waiter cancels `fut`, as there). Call it on the loop."""
        if asyncio.isfuture(fut):  # already the loop's
            return fut
        waiter = self._loop().create_future()
        waiter.add_done_callback(lambda w: fut.cancel() if w.cancelled() else None)
        fut.add_done_callback(lambda f: self.post(_copy, f, waiter))
        return waiter


def _copy(src: Future, dst: asyncio.Future) -> None:
    if dst.done():
        return
    if src.cancelled():
        dst.cancel()
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(src.result())


def bridge(loop: asyncio.AbstractEventLoop) -> LoopBridge:
    """The one bridge of `loop`."""
    found = _bridges.get(loop)
    if found is None:
        with _bridges_lock:
            found = _bridges.get(loop)
            if found is None:
                found = _bridges[loop] = LoopBridge(loop)
    return found
