"""Resolving `concurrent.futures.Future`s from the engine thread, safely; and holding back the
wake-ups of whoever waits on them while the engine runs a batch of commands."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager

from .errors import Code, EngineError

log = logging.getLogger(__name__)


def settle(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
    """Resolve a future unless its waiter already gave up on it (a cancelled future, say when
    the client disconnected): that must never raise on the engine thread."""
    if fut.done():
        return
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except Exception:  # cancelled between the check and the set
        pass


def chain(src: object, dst: Future, transform: Callable | None = None) -> None:
    """Resolve `dst` with `src` (a value, or a future whose outcome it takes), transformed."""
    if not isinstance(src, Future):
        try:
            settle(dst, transform(src) if transform else src)
        except Exception as error:
            settle(dst, exc=error)
        return
    src.add_done_callback(lambda f: _relay(f, dst, transform))


def _relay(src: Future, dst: Future, transform: Callable | None) -> None:
    if dst.done():
        return
    exc = src.exception() if not src.cancelled() else EngineError("the request was cancelled", code=Code.INTERNAL_ERROR)
    if exc is not None:
        settle(dst, exc=exc)
        return
    chain(src.result(), dst, transform)


_held = threading.local()


@contextmanager
def wakes_held(max_hold_s: float = 0.002) -> Iterator[None]:
    """Inside, a waiter's wake-up that can wait (`hold_wake`) is made once, when the block ends or
    once the block is `max_hold_s` old, whichever is first: a round of small engine commands wakes
    the event loop once, not once per command."""
    outer = getattr(_held, "wakes", None)
    if outer is not None:  # already holding: the outer block wakes
        yield
        return
    _held.wakes, _held.since, _held.max_hold_s = {}, time.perf_counter(), max_hold_s
    try:
        yield
    finally:
        wakes, _held.wakes = _held.wakes, None
        _wake_all(wakes)


def hold_wake(key: object, wake: Callable[[], None]) -> bool:
    """Called by a waker on the current thread: inside `wakes_held`, note `wake` (once per `key`)
    for the block's end and return True; else, or once the block is older than its `max_hold_s`
    (every held wake-up is then made now), return False: the caller wakes at once."""
    wakes = getattr(_held, "wakes", None)
    if wakes is None or release_old_wakes():
        return False
    wakes.setdefault(key, wake)
    return True


def release_old_wakes() -> bool:
    """Inside a `wakes_held` block older than its `max_hold_s`, make the held wake-ups now (the
    block holds on afresh) and return True; else False."""
    wakes = getattr(_held, "wakes", None)
    if wakes is None or time.perf_counter() - _held.since <= _held.max_hold_s:
        return False
    _held.wakes, _held.since = {}, time.perf_counter()
    _wake_all(wakes)
    return True


def _wake_all(wakes: dict) -> None:
    for wake in wakes.values():
        try:
            wake()
        except Exception:  # one failing waker never keeps the others' wake-ups held
            log.exception("a held wake-up failed")
