"""Resolving `concurrent.futures.Future`s from the engine thread, safely."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from .errors import Code, EngineError


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
