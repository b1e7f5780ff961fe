"""Shared test helpers (tests/ is on sys.path: pytest puts the rootdir conftest's folder there).

Engine tests drive the engine by hand: an `Engine` that is not started runs its commands on the
calling thread and does model work only in `step()` / `run_until_idle()`, so a test decides
exactly when work happens and never sleeps. `Sync` wraps one to call a command and run it to
completion in one line. `wait_until` is for the tests that need real threads (servers).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

from streamer.sessions.engine import Engine, EngineLimits
from streamer.sessions.query import QueryHandle


def run_unit(runner, session, stop_ids=None):
    """One reasoning unit of `session`, driven step by step on `runner` (stop ids: the
    tokenizer's end of sequence unless given); returns the finished ThinkJob."""
    from streamer.sessions.thinking import ThinkJob
    from streamer.sessions.window import make_room

    job = ThinkJob(session, frozenset([runner.tokenizer.eos_token_id]) if stop_ids is None else stop_ids)
    while not job.done:
        make_room(session, job.room())  # as the engine's step does before a job plans
        steps = job.plan(512)
        if steps:
            job.complete_many(runner.forward(steps, logits="last"))
    return job


def tiny_vl_engine(name: str = "tiny-vl:5", kv_budget_bytes: int = 64 << 20) -> Engine:
    """A started engine whose model is the tiny seeded Qwen2.5-VL (stop it when done)."""
    from streamer.app import load_tiny_vl
    from streamer.sessions.runner import ModelRunner

    loaded = load_tiny_vl(name)
    return Engine(ModelRunner(loaded.model, loaded.tokenizer, loaded.name),
                  EngineLimits(kv_budget_bytes=kv_budget_bytes)).start()


def driven(runner, **limits) -> Engine:
    """An engine on `runner` that is not started: step it by hand."""
    return Engine(runner, EngineLimits(**limits))


class Sync:
    """`Sync(engine).append(sid, text)` calls the command, runs the engine until idle and
    returns the result (raising its error). The engine must not be started."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        method = getattr(self.engine, name)

        def call(*args, **kwargs):
            return result(self.engine, method(*args, **kwargs))

        return call


def result(engine: Engine, pending: Future | QueryHandle):
    """Run the engine until idle; the outcome of `pending` (a future or a query handle)."""
    future = pending.future if isinstance(pending, QueryHandle) else pending
    engine.run_until_idle()
    return future.result(timeout=0)


def wait_until(predicate, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll `predicate` until it holds (for tests with real threads and sockets)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


class Deadline:
    """The deadline of a poll loop that `until` and `wait_until` cannot express (one that does
    work each turn): call `check()` every turn; past `timeout` s it fails naming `what`."""

    def __init__(self, timeout: float, what: str) -> None:
        self.timeout, self.what = timeout, what
        self.at = time.monotonic() + timeout

    def check(self) -> None:
        if time.monotonic() > self.at:
            raise AssertionError(f"timed out after {self.timeout:g} s waiting for {self.what}")


async def until(predicate, timeout: float = 60.0, what: str = "the condition"):
    """Await `predicate()` (a function, or a coroutine function) until it returns something
    truthy, and return that (for asyncio tests against real servers)."""
    import asyncio
    import inspect

    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(0.02)


def get_json(url):
    """(status, body) of a JSON GET, errors included."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def require_native() -> None:
    """Skip the calling test where streamer's C kernels cannot be built (no C compiler): the
    service then runs int4/int8 on ATen's kernels, and these tests have nothing to check."""
    import pytest

    from streamer.kernels import cpu

    if not cpu.available():
        pytest.skip(f"the native CPU stack needs a C compiler: {cpu.unavailable_reason()}")
