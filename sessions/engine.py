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
from .pool import BlockPool, OutOfBlocks, default_budget_bytes
from .flash import FlashJob, FlashQuestion, normalize, validate_registration
from .jobs import Job, PrefillJob, Priority, QueryJob, QueryResult, ReviseJob
from .runner import ModelRunner, SeqStep
from .sampling import SamplingParams, stop_token_ids
from .session import Session, json_object
from .actions import POLICIES, ActionLoop, AsyncController, FlashRule
from .thinking import ThinkingConfig, ThinkJob, configure
from .thinking import due as thinking_due
from .window import SlideJob, check_window_room, set_window

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineLimits:
    """Engine-side limits; the server lists them with the protocol limits."""

    step_tokens: int = 512  # token budget of one forward (chunked prefill size)
    query_step_tokens: int = 64  # budget while a question is running: keeps its decode steps short
    max_sessions: int = 64
    max_question_tokens: int = 1024
    max_answer_tokens: int = 1024
    max_context_tokens: int | None = None  # per session; default: the model's window
    max_flash_per_session: int = 16
    kv_budget_bytes: int | None = None  # the KV pool; default: half the memory available at start
    block_size: int = 16  # tokens per pool block
    share_prefix: bool = True  # sessions with the same system prompt share its full blocks
    admission: str = "refuse"  # when the pool is full: "refuse" new sessions, or "queue" them
    admission_timeout_s: float = 30.0  # how long a queued session may wait for memory
    park_idle_s: float = 1.0  # a session idle this long may be parked to free blocks
    park_to_disk: bool = False  # park to files under the cache directory instead of host memory
    aging_s: float = 2.0  # a job waiting this long is scheduled one priority class higher (no starvation)
    attention_backend: str | None = None  # auto | reference | triton; None: $STREAMER_ATTENTION_BACKEND, else auto


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    step_tokens: int = 0
    step_sequences: int = 0  # sequences run, summed over steps: > steps means packed steps
    step_seconds: float = 0.0
    tokens_ingested: int = 0
    queries: int = 0
    queries_cached: int = 0
    sessions_created: int = 0
    flash_evaluations: int = 0  # batched evaluations (jobs), not questions
    flash_questions_evaluated: int = 0
    flash_pushed: int = 0
    flash_cancelled: int = 0
    parked: int = 0
    restored: int = 0
    admissions_queued: int = 0
    admissions_refused: int = 0


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
        if self.limits.admission not in ("refuse", "queue"):
            raise ValueError(f"admission must be 'refuse' or 'queue', got {self.limits.admission!r}")
        runner.set_attention_backend(self.limits.attention_backend)
        budget = self.limits.kv_budget_bytes or default_budget_bytes(runner.device)
        self.pool = BlockPool(runner.kv_shape, budget, self.limits.block_size)
        self._admission: deque[tuple[float, Callable[[], object], Future]] = deque()  # waiting for memory
        self.sessions: dict[str, Session] = {}
        self._queues: dict[str, deque[tuple[Job, Future]]] = {}
        self._flash: dict[str, FlashJob] = {}  # running flash evaluation per session
        self._think: dict[str, ThinkJob] = {}  # running dual-mode reasoning unit per session
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

    def _call(self, fn: Callable[[], object], then: Callable[[Future], None] | None = None) -> Future:
        """Run `fn` on the engine thread; its return value (or exception) resolves the future.
        `then` is attached to the future before any work is queued, so callers on other threads
        see completions in the order the engine made them (the event log relies on it)."""
        fut: Future = Future()
        if then is not None:
            fut.add_done_callback(then)
        if self._stopping:
            fut.set_exception(EngineStopped())
            return fut

        def run() -> None:
            try:
                result = fn()
            except BaseException as exc:  # handed to the caller, never lost
                _settle(fut, exc=exc)
            else:
                if isinstance(result, Future):
                    result.add_done_callback(lambda f: _chain(f, fut))
                else:
                    _settle(fut, result)

        self._control.append(run)
        self._wake.set()
        return fut

    def create_session(self, system_prompt: str | None = None, session_id: str | None = None,
                       flash: list[dict] | None = None, thinking: dict | None = None) -> Future:
        """Resolves to the new session's state once its system prompt is in the cache. `flash`
        lists questions to register (keyword arguments of `register_flash`); if one is refused,
        no session is created."""

        def create():
            if len(self.sessions) >= self.limits.max_sessions:
                raise EngineError(f"session limit reached ({self.limits.max_sessions} sessions)",
                                  code="too_many_sessions")
            sid = session_id or secrets.token_hex(12)
            if sid in self.sessions:
                raise InvalidRequest(f"session id {sid!r} is already in use")
            return self._admit(lambda: self._open_session(sid, system_prompt, flash, thinking))

        return self._call(create)

    def _open_session(self, sid: str, system_prompt: str | None, flash: list[dict] | None,
                      thinking: dict | None) -> Future:
        """Build the session (its shared prefix may need blocks: OutOfBlocks propagates) and
        queue the prefill of its framing; the future resolves to its state."""
        if sid in self.sessions:  # checked again: it may have waited in the admission queue
            raise InvalidRequest(f"session id {sid!r} is already in use")
        if len(self.sessions) >= self.limits.max_sessions:
            raise EngineError(f"session limit reached ({self.limits.max_sessions} sessions)", code="too_many_sessions")
        session = Session(sid, self.runner, system_prompt, self.context_window, self.pool, self.limits.share_prefix)
        try:
            if len(session.prefix_ids) >= session.context_window:
                raise InvalidRequest(f"system prompt of {len(session.prefix_ids)} tokens does not fit "
                                     f"the context window of {session.context_window} tokens")
            for item in flash or ():
                q = self._flash_question(session, **item)
                session.flash[q.flash_id] = q
            if thinking:
                configure(session, _thinking_config(thinking))
            session.cache.reserve(len(session.prefix_ids))  # admission: its framing must fit now
        except BaseException:
            session.cache.release()
            raise
        self.sessions[sid] = session
        self._queues[sid] = deque()
        self.stats.sessions_created += 1
        shared = session.cache.prefix
        done = None
        if shared is not None and not shared.filled:
            done = self._enqueue(PrefillJob(session, shared.tokens, None, cache=shared))
        rest = session.prefix_ids[session.cache.length:]
        if rest:
            done = self._enqueue(PrefillJob(session, rest, None))
        out: Future = Future()
        if done is None:
            out.set_result(session.state())
        else:
            done.add_done_callback(lambda f: _chain(f, out, lambda _: session.state()))
        return out

    def _admit(self, open_session: Callable[[], Future]) -> Future:
        """Admission control: open the session if its blocks fit the KV budget (parking idle
        sessions if that makes room); otherwise refuse, or queue it until memory frees."""
        try:
            return self._with_room(open_session)
        except OutOfBlocks as exc:
            if self.limits.admission == "refuse":
                self.stats.admissions_refused += 1
                raise OutOfBlocks(f"no room for a new session: {exc}") from None
        out: Future = Future()
        self._admission.append((time.monotonic() + self.limits.admission_timeout_s, open_session, out))
        self.stats.admissions_queued += 1
        return out

    def _retry_admissions(self) -> None:
        now = time.monotonic()
        while self._admission:
            deadline, open_session, out = self._admission[0]
            try:
                result = self._with_room(open_session)
            except OutOfBlocks as exc:
                if now < deadline:
                    return  # FIFO: later arrivals wait behind the first
                self._admission.popleft()
                self.stats.admissions_refused += 1
                _settle(out, exc=OutOfBlocks(f"no room for a new session after waiting "
                                             f"{self.limits.admission_timeout_s:.0f} s: {exc}"))
                continue
            except Exception as exc:
                self._admission.popleft()
                _settle(out, exc=exc)
                continue
            self._admission.popleft()
            result.add_done_callback(lambda f, out=out: _chain(f, out))

    def _with_room(self, action: Callable[[], object], keep: Session | None = None):
        """Run `action`; if it runs out of blocks, park idle sessions and try once more."""
        try:
            return action()
        except OutOfBlocks:
            if not self._park_idle(keep):
                raise
            return action()

    def _park_idle(self, keep: Session | None = None) -> int:
        """Park idle sessions, least recently used first, to free pool blocks; returns how
        many were parked. A session is idle when nothing of it is queued or running."""
        now = time.monotonic()
        idle = [s for sid, s in self.sessions.items()
                if s is not keep and not self._queues[sid] and sid not in self._flash and sid not in self._think
                and s.cache.parked is None and now - s.last_active >= self.limits.park_idle_s]
        parked = 0
        for session in sorted(idle, key=lambda s: s.last_active):
            if session.cache.park(self.limits.park_to_disk, session.id):
                parked += 1
                self.stats.parked += 1
                session.log.info("parked to %s", "disk" if self.limits.park_to_disk else "host memory")
        return parked

    def append(self, session_id: str, text: str, then: Callable[[Future], None] | None = None) -> Future:
        """Resolves to an AppendResult once the text's tokens are in the cache."""

        def append():
            session = self._writable(session_id)
            tokens = session.tokenize(text)
            if not tokens:
                raise InvalidRequest("text is empty")
            if session.window is None:
                session.check_room(len(tokens))
            elif check_window_room(session, session.window, len(tokens)):
                self._enqueue(SlideJob(session, session.window))
            return self._enqueue(PrefillJob(session, tokens, text))

        return self._call(append, then)

    def configure_window(self, session_id: str, max_tokens: int, keep_tokens: int = 0,
                         sink_inputs: int = 1, then: Callable[[Future], None] | None = None) -> Future:
        """Bound the session's reading cache: sinks + recent inputs (sessions/window.py).
        Resolves to the session state."""

        def update():
            session = self._live(session_id)
            set_window(session, max_tokens, keep_tokens, sink_inputs)
            if session.cache.length + session.pending_tokens > max_tokens:
                self._enqueue(SlideJob(session, session.window))
            return session.state()

        return self._call(update, then)

    def revise(self, session_id: str, text: str, from_seq: int | None = None,
               then: Callable[[Future], None] | None = None) -> Future:
        return self._call(lambda: self._enqueue(ReviseJob(self._writable(session_id), text, from_seq)), then)

    def end_input(self, session_id: str) -> Future:
        """No more input. With thinking on, a final deliberation continues the notes."""

        def end():
            session = self._writable(session_id)
            session.ended = True
            state = session.thinking
            if state is not None and state.config.mode != "off" and state.config.final_tokens:
                state.final_requested = True
            return session.state()

        return self._call(end)

    def configure_thinking(self, session_id: str, settings: dict) -> Future:
        """Set or change the session's thinking mode and settings (ThinkingConfig fields)."""

        def update():
            session = self._live(session_id)
            if session.window is not None and settings.get("mode", "off") != "off":
                raise InvalidRequest(f"session {session_id} has a text window; thinking needs an unbounded cache")
            configure(session, _thinking_config(settings))
            return session.state()

        return self._call(update)

    def query(self, session_id: str, question: str, params: SamplingParams | None = None,
              on_delta: Callable[[str], None] | None = None, query_id: str | None = None) -> QueryHandle:
        params = params or SamplingParams()
        cancelled = threading.Event()

        def query():
            session = self._live(session_id)
            params.validate(self.limits.max_answer_tokens)
            cached = self._cached_answer(session, question, params, query_id)
            if cached is not None:
                if on_delta is not None and cached.text:
                    on_delta(cached.text)
                return cached
            job = QueryJob(session, query_id or secrets.token_hex(6), question, params,
                           self.stop_ids, on_delta, cancelled)
            if len(job.question_ids) > self.limits.max_question_tokens:
                raise InvalidRequest(f"question of {len(job.question_ids)} tokens exceeds the limit "
                                     f"of {self.limits.max_question_tokens} tokens", code="question_too_long")
            return self._enqueue(job)

        return QueryHandle(self._call(query), cancelled)

    def register_flash(self, session_id: str, question: str, flash_id: str | None = None, max_tokens: int = 32,
                       priority: int = 0, min_interval_s: float = 0.0, confirm: int = 1) -> Future:
        """Register a flash question; resolves to its state. It is evaluated in idle time after
        every data update, and `flash.updated` goes to the session's listeners on a change."""

        def register():
            session = self._live(session_id)
            q = self._flash_question(session, question, flash_id, max_tokens, priority, min_interval_s, confirm)
            session.flash[q.flash_id] = q
            return q.state(session.data_version)

        return self._call(register)

    def _flash_question(self, session: Session, question: str, flash_id: str | None = None, max_tokens: int = 32,
                        priority: int = 0, min_interval_s: float = 0.0, confirm: int = 1) -> FlashQuestion:
        q = validate_registration(session, question, flash_id, max_tokens, priority, min_interval_s,
                                  confirm, self.limits.max_flash_per_session, self.limits.max_answer_tokens)
        if len(q.question_ids) > self.limits.max_question_tokens:
            raise InvalidRequest(f"question of {len(q.question_ids)} tokens exceeds the limit of "
                                 f"{self.limits.max_question_tokens} tokens", code="question_too_long")
        return q

    def unregister_flash(self, session_id: str, flash_id: str) -> Future:
        def unregister():
            session = self._live(session_id)
            q = session.flash.pop(flash_id, None)
            if q is None:
                raise EngineError(f"no flash question {flash_id!r} on session {session_id}", code="flash_not_found")
            return q.state(session.data_version)

        return self._call(unregister)

    def add_listener(self, session_id: str, listener: Callable[[str, dict], None]) -> Future:
        """`listener(event_type, payload)` is called on the engine thread for session events
        (`flash.updated`); it must not block."""
        return self._call(lambda: self._live(session_id).listeners.append(listener))

    def remove_listener(self, session_id: str, listener: Callable[[str, dict], None]) -> Future:
        def remove():
            session = self.sessions.get(session_id)
            if session is not None and listener in session.listeners:
                session.listeners.remove(listener)

        return self._call(remove)

    def add_rule(self, session_id: str, flash_id: str, pattern: str, command: dict, debounce_s: float = 0.0,
                 rule_id: str | None = None) -> Future:
        """When flash question `flash_id`'s answer changes to match `pattern`, the session's
        listeners get an `action.command` event with `command`, once per change."""

        def add():
            session = self._live(session_id)
            if flash_id not in session.flash:
                raise EngineError(f"no flash question {flash_id!r} on session {session_id}", code="flash_not_found")
            session.next_rule_id += 1
            rid = rule_id or f"r{session.next_rule_id}"
            if rid in session.rules:
                raise InvalidRequest(f"rule id {rid!r} is already in use")
            if len(session.rules) >= self.limits.max_flash_per_session:
                raise EngineError(f"session {session_id} already has {len(session.rules)} rules (the limit)",
                                  code="rule_limit")
            rule = FlashRule(rid, flash_id, pattern, command, debounce_s)
            answer = session.flash[flash_id].answer
            if answer is not None:  # a rule starts from the present answer: only changes fire
                rule.matched = bool(rule.regex.search(normalize(answer.text)))
            session.rules[rid] = rule
            return {"rule_id": rid, "flash_id": flash_id, "pattern": pattern, "matched": rule.matched}

        return self._call(add)

    def remove_rule(self, session_id: str, rule_id: str) -> Future:
        def remove():
            session = self._live(session_id)
            if session.rules.pop(rule_id, None) is None:
                raise EngineError(f"no rule {rule_id!r} on session {session_id}", code="rule_not_found")
            return {"rule_id": rule_id}

        return self._call(remove)

    def start_actions(self, session_id: str, policy: str = "tracker", mode: str = "async_rollforward",
                      dt: float = 0.05, **options) -> Future:
        """Run an action policy for the session in its own thread; chunks go to the session's
        listeners as `action.chunk`. JSON inputs are its observations; robot state comes
        through `robot_state`."""

        def start():
            session = self._live(session_id)
            if session.actions is not None:
                raise InvalidRequest(f"session {session_id} already runs an action policy")
            factory = POLICIES.get(policy)
            if factory is None:
                raise InvalidRequest(f"unknown policy {policy!r}; known: {', '.join(sorted(POLICIES))}")
            if not 0.001 <= dt <= 10:
                raise InvalidRequest(f"dt must be in [0.001, 10] seconds, got {dt}")
            try:
                instance = factory(dt=dt, **options)
            except TypeError as exc:
                raise InvalidRequest(f"bad options for policy {policy!r}: {exc}") from None
            latency = getattr(instance, "latency_s", (0.0, 0.0))
            controller = AsyncController(instance, dt, mode, expected_latency_s=sum(latency) / 2 or dt)
            loop = ActionLoop(session_id, controller, lambda chunk: session.notify("action.chunk", chunk.public()))
            for chunk in reversed(session.chunks):  # the newest observation already in the log
                observation = json_object(chunk.text)
                if observation is not None:
                    loop.observe(observation, chunk.ts)
                    break
            session.actions = loop.start()
            return session.state()["actions"]

        return self._call(start)

    def stop_actions(self, session_id: str) -> Future:
        def stop():
            session = self._live(session_id)
            if session.actions is None:
                raise InvalidRequest(f"session {session_id} runs no action policy")
            loop, session.actions = session.actions, None
            loop.stop(wait=False)  # a slow policy must not hold up the engine thread
            return {"last_seq": loop.controller.seq}

        return self._call(stop)

    def robot_state(self, session_id: str, state: list[float], ts: float | None = None) -> None:
        """Thread-safe and immediate (robot state arrives at control rate): raises
        SessionNotFound, InvalidRequest (no policy running, or a malformed state)."""
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r}")
        loop = session.actions
        if loop is None:
            raise InvalidRequest(f"session {session_id} runs no action policy", code="invalid_robot_state")
        loop.robot_state(state, time.time() if ts is None else ts)

    def close_session(self, session_id: str) -> Future:
        def close():
            session = self._live(session_id)
            session.closed = True
            for job, fut in self._queues.pop(session_id, ()):
                job.abort()
                _settle(fut, exc=SessionClosed(f"session {session_id} was closed"))
            del self.sessions[session_id]
            if session.actions is not None:
                session.actions.stop(wait=False)
                session.actions = None
            self._flash.pop(session_id, None)
            self._think.pop(session_id, None)
            session.cache.release()
            if session.thinking is not None and session.thinking.cache is not None:
                session.thinking.cache = None
            self._retry_admissions()
            return session.state()

        return self._call(close)

    def session_state(self, session_id: str) -> Future:
        return self._call(lambda: self._live(session_id).state())

    def metrics(self) -> dict:
        """Counters and gauges for /metrics (read from other threads: values may be a step old)."""
        queues: dict[str, int] = {}
        for queue in list(self._queues.values()):
            for job, _ in list(queue):
                name = job.priority.name.lower()
                queues[name] = queues.get(name, 0) + 1
        queues["flash"] = queues.get("flash", 0) + len(self._flash)
        queues["thinking"] = queues.get("thinking", 0) + len(self._think)
        queues["admission"] = len(self._admission)
        sessions = {sid: (s.cache.length, s.cache.nbytes) for sid, s in list(self.sessions.items())}
        parked = sum(1 for s in list(self.sessions.values()) if s.cache.parked is not None)
        stale = [s.data_version - q.answer.data_version for s in list(self.sessions.values())
                 for q in list(s.flash.values()) if q.answer is not None]
        now = time.time()  # how long the answers that are behind their data have been behind (at most)
        stale_s = [now - q.answer.evaluated_at for s in list(self.sessions.values()) for q in list(s.flash.values())
                   if q.answer is not None and q.answer.data_version < s.data_version]
        return {"stats": self.snapshot_stats(), "pool": self.pool.stats(), "queues": queues,
                "sessions": sessions, "parked": parked, "flash_staleness_versions_max": max(stale, default=0),
                "flash_staleness_seconds_max": round(max(stale_s, default=0.0), 3),
                "kv_bytes_per_token": self.runner.kv_shape.bytes_per_token,
                "attention_backend": self.runner.attention_backend}

    def snapshot_stats(self) -> dict:
        s = self.stats
        return {"sessions": len(self.sessions), "steps": s.steps, "step_tokens": s.step_tokens,
                "step_sequences": s.step_sequences,
                "step_seconds": s.step_seconds, "tokens_ingested": s.tokens_ingested,
                "queries": s.queries, "queries_cached": s.queries_cached, "sessions_created": s.sessions_created,
                "flash_evaluations": s.flash_evaluations, "flash_questions_evaluated": s.flash_questions_evaluated,
                "flash_pushed": s.flash_pushed, "flash_cancelled": s.flash_cancelled,
                "parked": s.parked, "restored": s.restored, "admissions_queued": s.admissions_queued,
                "admissions_refused": s.admissions_refused,
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
            if self._admission:
                self._retry_admissions()
            if self._stopping:
                break
            try:
                batch = self._schedule()
                if batch:
                    self._execute(batch)
            except Exception:  # a bug in scheduling must not kill the engine: drop that work
                log.exception("engine step failed; failing the jobs at the heads of the queues")
                self._fail_heads()
                continue
            if not batch and not self._control and not any(self._queues.values()):
                self._wake.wait(self._next_wakeup())
                self._wake.clear()
        self._fail_all(EngineStopped())

    def _fail_heads(self) -> None:
        error = EngineError("internal error in the engine step; the request was dropped", code="internal_error")
        for queue in self._queues.values():
            if queue:
                job, fut = queue.popleft()
                if not job.done:
                    job.abort()
                _settle(fut, exc=error)
        self._flash.clear()
        self._think.clear()

    def _schedule(self) -> list[tuple[Job, Future | None, list[SeqStep]]]:
        """The whole policy: the head job of each session's queue plus each session's flash
        evaluation, by priority then arrival, packed into the step's token budget. Jobs that
        finish without a forward resolve here."""
        self._start_thinking()
        self._start_flash()
        candidates = [q[0] for q in self._queues.values() if q]
        candidates += [(job, None) for job in self._flash.values()]
        candidates += [(job, None) for job in self._think.values()]
        now = time.monotonic()
        candidates.sort(key=lambda jf: self._rank(jf[0], now))
        budget = self.limits.step_tokens
        if any(job.priority <= Priority.ACTION for job, _ in candidates):
            # Someone waits on each of these steps: pack only a little prefill with them.
            budget = min(budget, max(self.limits.query_step_tokens,
                                     sum(_need(job) for job, _ in candidates if job.priority <= Priority.ACTION)))
        batch = []
        for job, fut in candidates:
            if budget <= 0:
                break
            for job, fut in self._with_followers(job, fut):
                try:
                    self._resident(job.session)
                    steps = job.plan(budget)
                    for step in steps:  # take blocks now, so a full pool fails this job, not the step
                        self._with_room(lambda: step.cache.reserve(step.start + step.n), job.session)
                except Exception as exc:
                    self._resolve(job, fut, exc)
                    break
                job.session.last_active = time.monotonic()
                if steps:
                    batch.append((job, fut, steps))
                    budget -= sum(step.n for step in steps)
                elif job.done:
                    self._resolve(job, fut)
                if budget <= 0 or not _finishes(job, steps):
                    break
        return batch

    def _rank(self, job: Job, now: float) -> tuple[float, int]:
        """Priority class, raised one class per `aging_s` waited (so low classes are never
        starved by a stream of high ones), then arrival order."""
        return job.priority - (now - job.submitted_at) // self.limits.aging_s, job.order

    def _resident(self, session: Session) -> None:
        """Bring a parked session back into the pool before its work runs."""
        cache = session.cache
        if cache.parked is not None:
            self._with_room(cache.restore, session)
            self.stats.restored += 1
            session.log.info("restored from parking")

    def _with_followers(self, job: Job, fut: Future | None):
        """The job, then, while each one finishes within this step, the appends queued right
        behind it on the same session: a backlog of small appends is prefilled in one step,
        each written after the previous one (the attention hook processes them in order)."""
        yield job, fut
        if type(job) is not PrefillJob:
            return
        queue = self._queues.get(job.session.id, ())
        for nxt, nxt_fut in list(queue)[1:]:
            if type(nxt) is not PrefillJob or nxt.start is not None:
                return
            nxt.start = job.start + len(job.tokens)
            yield nxt, nxt_fut
            job = nxt

    def _execute(self, batch: list[tuple[Job, Future | None, list[SeqStep]]]) -> None:
        started = time.perf_counter()
        steps = [step for _, _, job_steps in batch for step in job_steps]
        try:
            logits = self.runner.forward(steps, logits="last")
        except Exception as exc:
            log.exception("forward failed for %d jobs", len(batch))
            for job, fut, _ in batch:
                self._resolve(job, fut, EngineError(f"model step failed: {exc}", code="internal_error"))
            return
        self.stats.steps += 1
        self.stats.step_tokens += sum(step.n for step in steps)
        self.stats.step_sequences += len(steps)
        self.stats.step_seconds += time.perf_counter() - started
        rows = iter(logits)
        for job, fut, job_steps in batch:
            job_rows = [next(rows) for _ in job_steps]
            try:
                job.complete_many(job_rows)
            except Exception as exc:
                log.exception("job %s failed", type(job).__name__)
                self._resolve(job, fut, exc)
                continue
            if isinstance(job, PrefillJob) and job.text is not None:
                self.stats.tokens_ingested += sum(step.n for step in job_steps)
            if job.done:
                self._resolve(job, fut)

    # ---- flash questions -------------------------------------------------------------------

    def _start_thinking(self) -> None:
        """Start a reasoning unit where one is due. Dual units run beside the session's queue
        (they only append to the thinking cache) but never while a question or flash fork is
        reading the notes, since a unit may drop old ones; interleaved units write the reading
        cache, so they queue behind the session's other work."""
        for sid, session in self.sessions.items():
            if sid in self._think or session.cache.parked is not None or not thinking_due(session):
                continue
            queue = self._queues[sid]
            if session.thinking.config.mode == "dual":
                if sid in self._flash or any(isinstance(job, QueryJob) and job.base is not None for job, _ in queue):
                    continue
                job = ThinkJob(session, self.stop_ids)
                try:
                    job.begin()  # now, while no fork reads the notes: it may drop old ones
                except EngineError as exc:
                    session.log.warning("reasoning unit skipped: %s", exc)
                    session.thinking.seen_tokens = session.cache.length
                    continue
                job.order = next(self._order)
                self._think[sid] = job
            elif not queue:
                self._enqueue(ThinkJob(session, self.stop_ids))

    def _start_flash(self) -> None:
        """Start one batched evaluation for each session that is idle (no input waiting) and
        has questions due (their last evaluation is older than the data and their interval)."""
        now = time.monotonic()
        for sid, session in self.sessions.items():
            if sid in self._flash or not session.flash or session.pending_tokens:
                continue
            if session.cache.parked is not None or sid in self._think or thinking_due(session):
                continue  # reasoning (a higher class) first: a unit may drop notes a flash fork would read
            if any(isinstance(job, PrefillJob) for job, _ in self._queues[sid]):
                continue
            due = [q for q in session.flash.values() if q.due(session.data_version, now)]
            if due:
                job = FlashJob(session, due, self.stop_ids)
                job.order = next(self._order)
                self._flash[sid] = job
                self.stats.flash_evaluations += 1

    def _next_wakeup(self) -> float | None:
        """Seconds until something timed is due: a flash interval or an admission deadline."""
        waits = [w for w in (self._next_flash_due(),) if w is not None]
        if self._admission:
            waits.append(max(0.0, self._admission[0][0] - time.monotonic()) + 0.001)
        return min(waits) if waits else None

    def _next_flash_due(self) -> float | None:
        """Seconds until a flash question waiting on its min interval becomes due (or None)."""
        now, soonest = time.monotonic(), None
        for session in self.sessions.values():
            if session.cache.parked is not None:
                continue  # evaluated when it comes back
            for q in session.flash.values():
                if q.evaluated_version < session.data_version:
                    wait = max(0.0, q.last_eval_at + q.min_interval_s - now)
                    soonest = wait if soonest is None else min(soonest, wait)
        return soonest

    def _finish_flash(self, job: FlashJob, exc: BaseException | None) -> None:
        session = job.session
        if self._flash.get(session.id) is job:
            del self._flash[session.id]
        if exc is not None:
            log.error("flash evaluation on session %s failed: %s", session.id, exc)
            for f in job.forks:  # do not retry the same data in a loop
                f.q.evaluated_version = max(f.q.evaluated_version, job.version)
            return
        if job.cancelled:
            self.stats.flash_cancelled += 1
            return
        for q in job.skipped:  # no room to answer at this length: not retried until the data changes
            q.evaluated_version = max(q.evaluated_version, job.version)
        for q, answer in job.results:
            if session.flash.get(q.flash_id) is not q:
                continue  # unregistered while it ran
            self.stats.flash_questions_evaluated += 1
            if q.observe(answer):
                self.stats.flash_pushed += 1
                session.notify("flash.updated", {"flash_id": q.flash_id, "question": q.question, **answer.public()})
                self._fire_rules(session, q.flash_id, answer)

    def _fire_rules(self, session: Session, flash_id: str, answer) -> None:
        now = time.monotonic()
        for rule in list(session.rules.values()):
            if rule.flash_id == flash_id and rule.observe(normalize(answer.text), now):
                session.notify("action.command", {"rule_id": rule.rule_id, "flash_id": flash_id, "command": rule.command,
                                                  "answer": answer.text, "data_version": answer.data_version,
                                                  "fired": rule.fired})

    def _cached_answer(self, session: Session, question: str, params: SamplingParams,
                       query_id: str | None) -> QueryResult | None:
        """A query that asks a registered question whose answer is current needs no model."""
        if params.temperature != 0 or params.stop or session.pending_tokens:
            return None
        key = normalize(question)
        for q in session.flash.values():
            a = q.answer
            if normalize(q.question) != key or a is None or a.data_version != session.data_version:
                continue
            complete = params.max_tokens == q.max_tokens or (a.finish_reason == "stop" and len(a.tokens) < params.max_tokens)
            if not complete:
                return None
            self.stats.queries_cached += 1
            session.queries_answered += 1
            return QueryResult(session.id, query_id or secrets.token_hex(6), a.text, list(a.tokens), a.finish_reason,
                               a.data_version, session.cache.length, len(q.question_ids), 0.0, 0.0, 0.0, 0.0,
                               cached=True)
        return None

    def _resolve(self, job: Job, fut: Future | None, exc: BaseException | None = None) -> None:
        if isinstance(job, FlashJob):
            self._finish_flash(job, exc)
            return
        if fut is None:  # a dual reasoning unit
            self._think.pop(job.session.id, None)
            if exc is not None:
                log.error("reasoning unit on session %s failed: %s", job.session.id, exc)
                job.session.thinking.seen_tokens = job.session.cache.length  # no retry loop on the same input
            return
        queue = self._queues.get(job.session.id)
        if queue:
            if queue[0][0] is job:
                queue.popleft()
            else:  # a follower that failed while planned beside its head
                for i, (queued, _) in enumerate(queue):
                    if queued is job:
                        del queue[i]
                        break
        if isinstance(job, QueryJob):
            if exc is None:
                self.stats.queries += 1
            if not job.session.closed:
                job.session.cache.trim()  # the fork's blocks go back to the pool
        if exc is not None:
            if not job.done:
                job.abort()
            _settle(fut, exc=exc)
        else:
            _settle(fut, job.result())

    def _fail_all(self, exc: BaseException) -> None:
        while self._control:
            self._control.popleft()()
        for queue in self._queues.values():
            for job, fut in queue:
                _settle(fut, exc=exc)
            queue.clear()


def _thinking_config(settings: dict) -> ThinkingConfig:
    try:
        return ThinkingConfig(**settings)
    except TypeError as exc:
        raise InvalidRequest(f"bad thinking settings: {exc}") from None


def _need(job: Job) -> int:
    """Tokens a question wants in the next step: its whole question, or one to decode."""
    if isinstance(job, QueryJob):
        return max(1, len(job.question_ids) - job.fed) if job.fed < len(job.question_ids) else 1
    return 1


def _finishes(job: Job, steps: list[SeqStep]) -> bool:
    """Whether a prefill job's planned steps take all its remaining tokens."""
    return isinstance(job, PrefillJob) and job.pos + sum(s.n for s in steps) >= len(job.tokens)


def _settle(fut: Future, result: object = None, exc: BaseException | None = None) -> None:
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


def _chain(src: Future, dst: Future, transform: Callable | None = None) -> None:
    if dst.done():
        return
    exc = src.exception() if not src.cancelled() else EngineError("cancelled", code="cancelled")
    if exc is not None:
        _settle(dst, exc=exc)
    else:
        try:
            _settle(dst, transform(src.result()) if transform else src.result())
        except Exception as error:
            _settle(dst, exc=error)
