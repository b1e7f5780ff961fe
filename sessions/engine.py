"""The engine thread: owns the model and every session; packs work into steps.

All model work and all session mutation happen on one thread, so sessions need no locks.
Other threads (the asyncio server, tests) talk to it through thread-safe calls that return
`concurrent.futures.Future`s. Each loop iteration is one step: drain control calls, ask the
scheduler what to run, run it in one forward, hand the logits back to the jobs.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from .errors import (EngineError, EngineStopped, InputEnded, InvalidRequest, SessionClosed,
                     SessionNotFound)
from .jobs import Job, PrefillJob, QueryJob, ReviseJob
from .runner import ModelRunner, SeqStep
from .sampling import SamplingParams, stop_token_ids
from .session import Session

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineLimits:
    """Engine-side limits; the server lists them with the protocol limits."""

    step_tokens: int = 512  # token budget of one forward (chunked prefill size)
    max_sessions: int = 64
    max_question_tokens: int = 1024
    max_answer_tokens: int = 1024
    max_context_tokens: int | None = None  # per session; default: the model's window


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    step_tokens: int = 0
    step_sequences: int = 0  # sequences run, summed over steps: > steps means packed steps
    step_seconds: float = 0.0
    tokens_ingested: int = 0
    queries: int = 0
    sessions_created: int = 0


class QueryHandle:
    """A running question: `future` resolves to a QueryResult; `cancel()` stops it at its next
    step (or before it starts), and it then finishes with finish_reason "cancelled"."""

    def __init__(self, future: Future, cancelled: threading.Event) -> None:
        self.future = future
        self._cancelled = cancelled

    def cancel(self) -> None:
        self._cancelled.set()


class Engine:
    def __init__(self, runner: ModelRunner, limits: EngineLimits | None = None) -> None:
        self.runner = runner
        self.limits = limits or EngineLimits()
        self.stats = EngineStats()
        self.stop_ids = stop_token_ids(runner.tokenizer, runner.model)
        self.sessions: dict[str, Session] = {}
        self._queues: dict[str, deque[tuple[Job, Future]]] = {}
        self._control: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._order = itertools.count()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="streamer-engine", daemon=True)

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> "Engine":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def context_window(self) -> int:
        return self.limits.max_context_tokens or self.runner.context_window

    # ---- thread-safe API -------------------------------------------------------------------

    def _call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the engine thread; its return value (or exception) resolves the future."""
        fut: Future = Future()
        if self._stopping:
            fut.set_exception(EngineStopped())
            return fut

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, never lost
                fut.set_exception(exc)
            else:
                if isinstance(result, Future):
                    result.add_done_callback(lambda f: _chain(f, fut))
                else:
                    fut.set_result(result)

        self._control.append(run)
        self._wake.set()
        return fut

    def create_session(self, system_prompt: str | None = None, session_id: str | None = None) -> Future:
        """Resolves to the new session's state once its system prompt is in the cache."""

        def create():
            if len(self.sessions) >= self.limits.max_sessions:
                raise EngineError(f"session limit reached ({self.limits.max_sessions} sessions)",
                                  code="too_many_sessions")
            sid = session_id or secrets.token_hex(12)
            if sid in self.sessions:
                raise InvalidRequest(f"session id {sid!r} is already in use")
            session = Session(sid, self.runner, system_prompt, self.context_window)
            if len(session.prefix_ids) >= session.context_window:
                raise InvalidRequest(f"system prompt of {len(session.prefix_ids)} tokens does not fit "
                                     f"the context window of {session.context_window} tokens")
            self.sessions[sid] = session
            self._queues[sid] = deque()
            self.stats.sessions_created += 1
            job = PrefillJob(session, session.prefix_ids, None)
            done = self._enqueue(job)
            out: Future = Future()
            done.add_done_callback(lambda f: _chain(f, out, lambda _: session.state()))
            return out

        return self._call(create)

    def append(self, session_id: str, text: str) -> Future:
        """Resolves to an AppendResult once the text's tokens are in the cache."""

        def append():
            session = self._writable(session_id)
            tokens = session.tokenize(text)
            if not tokens:
                raise InvalidRequest("text is empty")
            session.check_room(len(tokens))
            return self._enqueue(PrefillJob(session, tokens, text))

        return self._call(append)

    def revise(self, session_id: str, text: str, from_seq: int | None = None) -> Future:
        return self._call(lambda: self._enqueue(ReviseJob(self._writable(session_id), text, from_seq)))

    def end_input(self, session_id: str) -> Future:
        def end():
            session = self._writable(session_id)
            session.ended = True
            return session.state()

        return self._call(end)

    def query(self, session_id: str, question: str, params: SamplingParams | None = None,
              on_delta: Callable[[str], None] | None = None, query_id: str | None = None) -> QueryHandle:
        params = params or SamplingParams()
        cancelled = threading.Event()

        def query():
            session = self._live(session_id)
            params.validate(self.limits.max_answer_tokens)
            job = QueryJob(session, query_id or secrets.token_hex(6), question, params,
                           self.stop_ids, on_delta, cancelled)
            if len(job.question_ids) > self.limits.max_question_tokens:
                raise InvalidRequest(f"question of {len(job.question_ids)} tokens exceeds the limit "
                                     f"of {self.limits.max_question_tokens} tokens", code="question_too_long")
            return self._enqueue(job)

        return QueryHandle(self._call(query), cancelled)

    def close_session(self, session_id: str) -> Future:
        def close():
            session = self._live(session_id)
            session.closed = True
            for job, fut in self._queues.pop(session_id, ()):
                job.abort()
                fut.set_exception(SessionClosed(f"session {session_id} was closed"))
            del self.sessions[session_id]
            return session.state()

        return self._call(close)

    def session_state(self, session_id: str) -> Future:
        return self._call(lambda: self._live(session_id).state())

    def snapshot_stats(self) -> dict:
        s = self.stats
        return {"sessions": len(self.sessions), "steps": s.steps, "step_tokens": s.step_tokens,
                "step_sequences": s.step_sequences,
                "step_seconds": s.step_seconds, "tokens_ingested": s.tokens_ingested,
                "queries": s.queries, "sessions_created": s.sessions_created,
                "queued_jobs": sum(len(q) for q in list(self._queues.values()))}

    # ---- engine thread ---------------------------------------------------------------------

    def _live(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (never created, or closed)")
        return session

    def _writable(self, session_id: str) -> Session:
        session = self._live(session_id)
        if session.ended:
            raise InputEnded(f"session {session_id} got input.end; it takes no more input")
        return session

    def _enqueue(self, job: Job) -> Future:
        fut: Future = Future()
        job.order = next(self._order)
        self._queues[job.session.id].append((job, fut))
        return fut

    def _run(self) -> None:
        while True:
            while self._control:
                self._control.popleft()()
            if self._stopping:
                break
            batch = self._schedule()
            if batch:
                self._execute(batch)
            elif not self._control:
                self._wake.wait()
                self._wake.clear()
        self._fail_all(EngineStopped())

    def _schedule(self) -> list[tuple[Job, Future, SeqStep]]:
        """The whole policy: the head job of each session, by priority then arrival, packed
        into the step's token budget. Jobs that finish without a forward resolve here."""
        heads = sorted((q[0] for q in self._queues.values() if q), key=lambda jf: (jf[0].priority, jf[0].order))
        budget = self.limits.step_tokens
        batch = []
        for job, fut in heads:
            if budget <= 0:
                break
            try:
                step = job.plan(budget)
            except Exception as exc:
                self._resolve(job, fut, exc)
                continue
            if step is None:
                if job.done:
                    self._resolve(job, fut)
                continue
            batch.append((job, fut, step))
            budget -= step.n
        return batch

    def _execute(self, batch: list[tuple[Job, Future, SeqStep]]) -> None:
        started = time.perf_counter()
        try:
            logits = self.runner.forward([step for _, _, step in batch], logits="last")
        except Exception as exc:
            log.exception("forward failed for %d jobs", len(batch))
            for job, fut, _ in batch:
                self._resolve(job, fut, EngineError(f"model step failed: {exc}", code="internal_error"))
            return
        tokens = sum(step.n for _, _, step in batch)
        self.stats.steps += 1
        self.stats.step_tokens += tokens
        self.stats.step_sequences += len(batch)
        self.stats.step_seconds += time.perf_counter() - started
        for (job, fut, step), row in zip(batch, logits):
            try:
                job.complete(row)
            except Exception as exc:
                log.exception("job %s failed", type(job).__name__)
                self._resolve(job, fut, exc)
                continue
            if isinstance(job, PrefillJob) and job.text is not None:
                self.stats.tokens_ingested += step.n
            if job.done:
                self._resolve(job, fut)

    def _resolve(self, job: Job, fut: Future, exc: BaseException | None = None) -> None:
        queue = self._queues.get(job.session.id)
        if queue and queue[0][0] is job:
            queue.popleft()
        if isinstance(job, QueryJob) and exc is None:
            self.stats.queries += 1
        if exc is not None:
            if not job.done:
                job.abort()
            fut.set_exception(exc)
        else:
            fut.set_result(job.result())

    def _fail_all(self, exc: BaseException) -> None:
        while self._control:
            self._control.popleft()()
        for queue in self._queues.values():
            for job, fut in queue:
                if not fut.done():
                    fut.set_exception(exc)
            queue.clear()


def _chain(src: Future, dst: Future, transform: Callable | None = None) -> None:
    if dst.done():
        return
    exc = src.exception()
    if exc is not None:
        dst.set_exception(exc)
    else:
        dst.set_result(transform(src.result()) if transform else src.result())
