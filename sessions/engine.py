"""The engine: a synchronous core that packs many sessions' work into model steps, and the
thread that runs it for a server.

`EngineCore` owns the model runner, every session, their lanes of jobs, KV memory and the
scheduler. It has no thread: `submit(job)` queues work, `step()` runs one schedule -> forward
-> complete, `run_until_idle()` steps until nothing can run. Tests drive it by hand.

`Engine` is the thread around it for a server: commands called from any thread go through a
control queue to the engine thread, which runs them between steps; each returns a
`concurrent.futures.Future`. All model work and all session mutation happen on that one
thread, so sessions need no locks. An Engine that is not started runs commands on the calling
thread and is stepped by hand (`step()`, `run_until_idle()`), like the core.

The control queue is fair (`FairQueue`): each session's commands wait in their own queue, in
their order; owners (the API key, else the client) take turns, and each owner's sessions take
turns within its turns. A turn runs at most `command_burst` commands of one session (fewer once
it has used `command_quantum_s`); a round has a turn for each session waiting (owners
alternating, so one with many sessions never goes twice while another waits; an owner's turns
stop for the round once they took `command_quantum_s` in all), ends early after
`command_round_s`, and the engine steps after every round, so a flood of commands from one
client delays another session's command by at most one turn per session ahead of it, and many
sessions of one client (one API key, or feeds behind one address) each get a turn before every
step rather than one of them a step. While only one session has commands waiting, rounds go on
(up to `command_burst` x `command_quantum_s` of command time): a fast feed's queued inputs are
read together. The text of inputs and questions is tokenized before the engine thread, by the
tokenizer's workers (`tokenizer_threads`, served from a FairQueue the same way); the command
waits in its session's queue until its tokens are ready, then checks their size on the engine
thread (O(1)), so an input refused for size never costs the engine thread a tokenization. An
input's text is tokenized in growing prefixes (`bounded_tokens`): one whose prefix already has
more tokens than the model's window is refused without tokenizing the rest of it.

The commands themselves live beside the jobs they make: input in `jobs`, questions in `query`,
flash questions in `flash`, windows in `window`, thinking in `thinking`, rules and policies in
`actions`, listeners in `session`; session lifecycle here. `Engine`'s command table lists them.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass

from . import actions, background, flash, jobs, session as session_commands, thinking, window
from .errors import Code, ContextOverflow, EngineError, EngineStopped, InvalidRequest, SessionNotFound
from .futures import chain, release_old_wakes, settle, wakes_held
from .jobs import Job, Lanes
from .memory import Memory
from .multimodal import vision_step
from .query import QueryHandle, end_queries, query
from .runner import ModelRunner, SeqStep
from .sampling import SamplingParams, stop_token_ids
from .scheduler import Scheduler, StepPlan
from .session import Session

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineLimits:
    """Engine-side limits; the server lists them with the protocol limits."""

    step_tokens: int = 512  # token budget of one forward (chunked prefill size)
    query_step_tokens: int = 64  # budget while a question is running: keeps its decode steps short
    query_step_cost: float = 2.0  # ... and within this many times what a step of the question alone costs (0: off)
    max_step_s: float = 0.25  # a step is planned to take at most about this long, by the fitted step cost (0: off)
    max_sessions: int = 64
    max_question_tokens: int = 1024
    max_answer_tokens: int = 1024
    max_context_tokens: int | None = None  # per session; default: the model's window
    max_flash_per_session: int = 16
    window_tokens: int = 4096  # default bound of a session's reading cache (window.default_size)
    flash_stale_versions: int = 0  # a flash answer this many versions behind its data is pushed as flash.stale (0: off)
    flash_stale_s: float = 5.0  # ... or this many seconds behind, or 4x what an evaluation of it takes if longer
    kv_budget_bytes: int | None = None  # the KV pool; default: half the memory available at start
    block_size: int = 16  # tokens per pool block
    share_prefix: bool = True  # sessions with the same system prompt share its full blocks
    admission: str = "refuse"  # when the pool is full: "refuse" new sessions, or "queue" them
    admission_timeout_s: float = 30.0  # how long a queued session may wait for memory
    park_idle_s: float = 1.0  # a session idle this long may be parked to free blocks
    park_to_disk: bool = False  # park to files under the cache directory instead of host memory
    aging_s: float = 2.0  # a job waiting this long is scheduled one priority class higher (no starvation)
    share_half_life_s: float = 2.0  # fair share: recent tokens per owner and session halve this often
    attention_backend: str | None = None  # auto | reference | triton; None: $STREAMER_ATTENTION_BACKEND, else auto
    command_burst: int = 8  # engine commands one session runs in its turn (the control queue's fair share)
    command_quantum_s: float = 0.002  # ... a turn ends early once its commands took this long
    command_round_s: float = 0.05  # a round of turns (one per session waiting) ends early after this long
    tokenizer_threads: int = 2  # workers that tokenize inputs and questions before the engine thread


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
    commands: int = 0  # engine commands run on the engine thread
    tokenized_off_engine: int = 0  # inputs and questions tokenized by the tokenizer's workers
    tokenized_on_engine: int = 0  # inputs and questions the engine thread tokenized itself (an engine not started)


class FairQueue:
    """Items waiting per owner and per key (a session), served round robin: owners take turns,
    and an owner's keys take turns within its turns; one key's items keep their order. An item
    that is not `ready` holds its key's queue (the keys behind it in the rotation go first).
    Thread-safe: any thread puts, the engine thread or the tokenizer's workers take."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._queues: dict[str, deque] = {}  # key -> its items, in order
        self._owner_of: dict[str, str] = {}  # key -> the owner it queues under while it has items
        self._keys: dict[str, deque[str]] = {}  # owner -> its keys with items, in turn order
        self._owners: deque[str] = deque()  # owners with items, in turn order
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def keys(self) -> int:
        """How many keys have items waiting."""
        return len(self._queues)

    def put(self, owner: str, key: str, item: object) -> None:
        """Queue `item` behind `key`'s items (a key with items keeps the owner it has)."""
        with self.cond:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()
                self._owner_of[key] = owner
                keys = self._keys.get(owner)
                if keys is None:
                    keys = self._keys[owner] = deque()
                    self._owners.append(owner)
                keys.append(key)
            queue.append(item)
            self._size += 1
            self.cond.notify()

    def next_key(self, ready: Callable[[object], bool], skip: Collection[str] = ()) -> tuple[str, str] | None:
        """(owner, key) whose turn it is: the first owner in turn order, not in `skip`, with a key
        whose first item is ready, and that owner's first such key; both go to the back of their
        turn orders."""
        with self.cond:
            for owner in list(self._owners):
                if owner in skip:
                    continue
                keys = self._keys[owner]
                for key in list(keys):
                    if ready(self._queues[key][0]):
                        keys.remove(key)
                        keys.append(key)
                        self._owners.remove(owner)
                        self._owners.append(owner)
                        return owner, key
            return None

    def pop(self, key: str, ready: Callable[[object], bool]) -> object | None:
        """`key`'s first item if it is ready (None otherwise, or when it has none)."""
        with self.cond:
            queue = self._queues.get(key)
            if not queue or not ready(queue[0]):
                return None
            item = queue.popleft()
            self._size -= 1
            if not queue:
                del self._queues[key]
                owner = self._owner_of.pop(key)
                keys = self._keys[owner]
                keys.remove(key)
                if not keys:
                    del self._keys[owner]
                    self._owners.remove(owner)
            return item


@dataclass(slots=True)
class Command:
    """A command waiting for the engine thread: `run` once `ready` (its input's tokens) is done."""

    run: Callable[[], None]
    ready: Future | None = None

    def is_ready(self) -> bool:
        return self.ready is None or self.ready.done()


class EngineCore:
    """Every session and its work, stepped by hand. Not thread-safe: one thread drives it."""

    def __init__(self, runner: ModelRunner, limits: EngineLimits | None = None) -> None:
        self.runner = runner
        self.limits = limits or EngineLimits()
        if self.limits.admission not in ("refuse", "queue"):
            raise ValueError(f"admission must be 'refuse' or 'queue', got {self.limits.admission!r}")
        self.stats = EngineStats()
        self.stop_ids = stop_token_ids(runner.tokenizer, runner.model)
        runner.set_attention_backend(self.limits.attention_backend)
        self.sessions: dict[str, Session] = {}
        self.lanes = Lanes()
        self.memory = Memory(runner.kv_shape, self.limits, self.stats,
                             lambda: [s for sid, s in self.sessions.items() if not self.lanes.busy(sid)])
        self.scheduler = Scheduler(self.limits.step_tokens, self.limits.query_step_tokens, self.limits.aging_s,
                                   self.limits.share_half_life_s, self.limits.query_step_cost,
                                   self.limits.max_step_s)

    @property
    def context_window(self) -> int:
        return self.limits.max_context_tokens or self.runner.context_window

    def live(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {session_id!r} (never created, or closed)")
        return session

    def writable(self, session_id: str) -> Session:
        return jobs.writable(self.live(session_id))

    # ---- the loop ------------------------------------------------------------------------------

    def submit(self, job: Job, ahead: bool = False) -> Future:
        """Queue a job in its lane (`ahead`: in front of its session's waiting backlog, see
        `Lanes.submit`); the future resolves with its result when it finishes."""
        job.future = Future()
        job.submitted_step = self.stats.steps
        self.lanes.submit(job, ahead)
        return job.future

    def step(self) -> bool:
        """One step: ask the scheduler what to run, run it in one forward, hand the logits back
        to the jobs. Returns False when there was nothing to run."""
        try:
            self.memory.retry_admissions()
            self._start_background()
            plan = self.scheduler.schedule(list(self.lanes.heads()), self.lanes.followers, time.monotonic())
            batch = self._prepare(plan)
            if batch:
                self._forward(batch)
        except Exception:  # a bug in scheduling must not kill the engine: drop that work
            log.exception("engine step failed; failing the jobs at the heads of the queues")
            self._fail_heads()
            return True
        return bool(plan)

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Step until nothing can run now (timed work, such as a flash question's interval, may
        still be due later: see `next_wakeup`). Returns the number of steps taken."""
        steps = 0
        while steps < max_steps and self.step():
            steps += 1
        return steps

    def next_wakeup(self) -> float | None:
        """Seconds until something timed is due: a flash interval or an admission deadline."""
        waits = [w for s in self.sessions.values() if (w := background.next_wakeup(s, self.limits)) is not None]
        if (deadline := self.memory.next_deadline()) is not None:
            waits.append(deadline)
        return min(waits, default=None)

    def _start_background(self) -> None:
        """Idle-time work (reasoning units, flash evaluations) where due: `background.start`."""
        background.start(self)

    def _prepare(self, plan: StepPlan) -> list[tuple[Job, list[SeqStep]]]:
        """Turn the plan into sequences: each job plans its tokens and the pool blocks they need
        are taken now, so a failure costs that job (and the appends joined behind it) only.
        First, the vision tower for the step's frame jobs that need it, in one call."""
        vision_step(getattr(self.runner, "vl", None), [entry.job for entry in plan.entries])
        batch, dropped = [], set()
        for entry in plan.entries:
            job = entry.job
            if entry.after is not None and id(entry.after) in dropped:
                dropped.add(id(job))
                continue
            try:
                self.memory.resident(job.session)
                if entry.after is not None:
                    job.begin(after=entry.after)
                window.make_room(job.session, job.room())  # the one place a job's room is made
                steps = job.plan(entry.tokens)
                for step in steps:
                    self.memory.reserve(step, job.session)
            except Exception as exc:
                self._finish(job, exc)
                dropped.add(id(job))
                continue
            job.session.last_active = job.waiting_since = now = time.monotonic()
            self.scheduler.charge(job, sum(step.n for step in steps), now)
            if steps:
                batch.append((job, steps))
            elif job.done:
                self._finish(job)
        return batch

    def _forward(self, batch: list[tuple[Job, list[SeqStep]]]) -> None:
        started = time.perf_counter()
        steps = [step for _, job_steps in batch for step in job_steps]
        try:
            logits = self.runner.forward(steps, logits="last")
        except Exception as exc:
            log.exception("forward failed for %d jobs", len(batch))
            for job, _ in batch:
                self._finish(job, EngineError(f"model step failed: {exc}", code=Code.INTERNAL_ERROR))
            return
        s, tokens = self.stats, sum(step.n for step in steps)
        s.steps += 1
        s.step_tokens += tokens
        s.step_sequences += len(steps)
        s.step_seconds += time.perf_counter() - started
        rows = iter(logits)
        for job, job_steps in batch:
            job.stepped(s.steps, tokens)
            try:
                job.complete_many([next(rows) for _ in job_steps])
            except Exception as exc:
                log.exception("job %s failed", job.kind)
                self._finish(job, exc)
                continue
            if job.done:
                self._finish(job)
        # what the step cost, its jobs' sampling included: on a GPU the forward returns before
        # its kernels end, and reading the logits waits for them
        self.scheduler.observe(tokens, time.perf_counter() - started)

    def _finish(self, job: Job, exc: BaseException | None = None) -> None:
        self.lanes.remove(job)
        job.finish(self, exc)

    def _fail_heads(self) -> None:
        error = EngineError("internal error in the engine step; the request was dropped", code=Code.INTERNAL_ERROR)
        for job in list(self.lanes.heads()):
            self._finish(job, error)

    def fail_all(self, exc: BaseException) -> None:
        """The engine stops: every waiting request fails with `exc`."""
        self.memory.fail_waiting(exc)
        for sid in list(self.lanes.fifo):
            for job in self.lanes.close(sid):
                job.abort()
                if job.future is not None:
                    settle(job.future, exc=exc)

    # ---- session lifecycle (commands) -------------------------------------------------------

    def create_session(self, system_prompt: str | None = None, session_id: str | None = None,
                       flash: list[dict] | None = None, thinking: dict | None = None,
                       window: dict | None | str = "default", owner: str | None = None):
        """Resolves to the new session's state once its system prompt is in the cache. `flash`
        lists questions to register (keyword arguments of `flash.register`); if one is refused,
        no session is created. `window`: "default" (the documented bound, `window.default_size`),
        the window's settings (`jobs.configure_window` keywords), or None for an unbounded session.
        `owner`: whose session it is for the scheduler's fair share (the API key, else the
        client); by default the session is its own owner."""
        if len(self.sessions) >= self.limits.max_sessions:
            raise EngineError(f"session limit reached ({self.limits.max_sessions} sessions)",
                              code=Code.TOO_MANY_SESSIONS)
        sid = session_id or secrets.token_hex(12)
        if sid in self.sessions:
            raise InvalidRequest(f"session id {sid!r} is already in use")
        return self.memory.admit(lambda: self._open_session(sid, system_prompt, flash, thinking, window, owner))

    def _open_session(self, sid: str, system_prompt: str | None, flash_items: list[dict] | None,
                      thinking_settings: dict | None, window_settings: dict | None | str = "default",
                      owner: str | None = None) -> Future | dict:
        """Build the session (its shared prefix may need blocks: OutOfBlocks propagates) and
        queue the prefill of its framing; resolves to its state."""
        if sid in self.sessions:  # checked again: it may have waited in the admission queue
            raise InvalidRequest(f"session id {sid!r} is already in use")
        if len(self.sessions) >= self.limits.max_sessions:
            raise EngineError(f"session limit reached ({self.limits.max_sessions} sessions)", code=Code.TOO_MANY_SESSIONS)
        session = Session(sid, self.runner, system_prompt, self.context_window, self.memory.pool,
                          self.limits.share_prefix)
        session.owner = owner or sid
        try:
            if len(session.prefix_ids) >= session.context_window:
                raise InvalidRequest(f"system prompt of {len(session.prefix_ids)} tokens does not fit "
                                     f"the context window of {session.context_window} tokens")
            for item in flash_items or ():
                flash.add_question(self, session, **item)
            if thinking_settings:
                thinking.configure(session, thinking.parse_config(thinking_settings))
            if window_settings == "default":
                window.set_window(session, window.default_size(self.limits, session.context_window, len(session.prefix_ids)),
                                  default=True)
            elif window_settings is not None:
                window.set_window(session, **window.window_args(window_settings))
            session.cache.reserve(len(session.prefix_ids))  # admission: its framing must fit now
        except BaseException:
            session.cache.release()
            raise
        self.sessions[sid] = session
        self.lanes.open(sid)
        self.stats.sessions_created += 1
        shared = session.cache.prefix
        done = None
        if shared is not None and not shared.filled:
            done = self.submit(jobs.PrefillJob(session, shared.tokens, None, cache=shared))
        rest = session.prefix_ids[session.cache.length:]
        if rest:
            done = self.submit(jobs.PrefillJob(session, rest, None))
        if done is None:
            return session.state()
        out: Future = Future()
        chain(done, out, lambda _: session.state())
        return out

    def close_session(self, session_id: str) -> dict:
        """Close the session: its queued work fails with `session_closed`, its memory is freed."""
        session = self.live(session_id)
        session.closed = True
        for job in self.lanes.close(session_id):
            job.abort()
            if job.future is not None:
                settle(job.future, exc=jobs.closed_error(session_id))
        del self.sessions[session_id]
        actions.halt(session)
        session.cache.release()
        if session.thinking is not None:
            session.thinking.release()
        self.memory.retry_admissions()
        return session.state()

    def session_state(self, session_id: str) -> dict:
        return self.live(session_id).state()

    def metrics(self) -> dict:
        """Counters and gauges for /metrics (read from other threads: values may be a step old)."""
        sessions = list(self.sessions.values())
        queues = self.lanes.counts()
        queues["admission"] = len(self.memory.admission)
        answered = [(s, q) for s in sessions for q in list(s.flash.questions.values()) if q.answer is not None]
        now = time.time()  # how long the answers that are behind their data have been behind (at most)
        stale_s = [now - q.answer.evaluated_at for s, q in answered if q.answer.data_version < s.data_version]
        return {"stats": snapshot_stats(self), "pool": self.memory.pool.stats(), "queues": queues,
                "sessions": {s.id: (s.cache.length, s.cache.nbytes) for s in sessions},
                "parked": sum(1 for s in sessions if s.cache.parked is not None),
                "flash_staleness_versions_max": max((s.data_version - q.answer.data_version for s, q in answered),
                                                    default=0),
                "flash_staleness_seconds_max": round(max(stale_s, default=0.0), 3),
                "flash_staleness": {s.id: (h.cumulative(), h.count, round(h.sum, 6))
                                    for s in sessions if (h := s.flash.staleness).count},
                "flash_stale_marked": sum(1 for s in sessions for q in list(s.flash.questions.values()) if q.stale),
                "kv_bytes_per_token": self.runner.kv_shape.bytes_per_token,
                "attention_backend": self.runner.attention_backend,
                "weights": self.runner.weights.public(),
                **({"threads": threads} if (threads := self.runner.threads()) else {})}


def snapshot_stats(core: EngineCore) -> dict:
    s = core.stats
    return {"sessions": len(core.sessions), "steps": s.steps, "step_tokens": s.step_tokens,
            "step_sequences": s.step_sequences, "step_seconds": s.step_seconds, "tokens_ingested": s.tokens_ingested,
            "queries": s.queries, "queries_cached": s.queries_cached, "sessions_created": s.sessions_created,
            "flash_evaluations": s.flash_evaluations, "flash_questions_evaluated": s.flash_questions_evaluated,
            "flash_pushed": s.flash_pushed, "flash_cancelled": s.flash_cancelled,
            "parked": s.parked, "restored": s.restored, "admissions_queued": s.admissions_queued,
            "admissions_refused": s.admissions_refused, "queued_jobs": core.lanes.queued(), "commands": s.commands,
            "tokenized_off_engine": s.tokenized_off_engine, "tokenized_on_engine": s.tokenized_on_engine}


@dataclass(slots=True, frozen=True)
class TooLong:
    """What `bounded_tokens` returns for a text longer than any input can be: a prefix of
    `chars` characters already has more than `tokens` tokens."""
    tokens: int
    chars: int


PREFIX_CHARS_PER_TOKEN = 4  # the first prefix tokenized: this many characters per token of the limit
CUT_SLACK_TOKENS = 64  # a prefix's last word may be cut into more tokens than it has in the whole text


def bounded_tokens(tokenize: Callable[[str], list[int]], text: str, limit: int) -> list[int] | TooLong:
    """`tokenize(text)`, or `TooLong` once a prefix of it shows it has more than `limit` tokens:
    prefixes of 4, 8, 16, ... characters per token of `limit` are tokenized until one has more
    than `limit` tokens beyond a slack for its cut (an over-long input costs a bounded prefix,
    about 4-12 characters per token of the limit for prose, never its whole text) or the prefix
    is the whole text (at most ~2x the work of one tokenization, for a text of very long tokens)."""
    cut = PREFIX_CHARS_PER_TOKEN * (limit + CUT_SLACK_TOKENS)
    while cut < len(text):
        head = tokenize(text[:cut])
        if len(head) > limit + limit // 16 + CUT_SLACK_TOKENS:
            return TooLong(len(head) - CUT_SLACK_TOKENS, cut)
        cut *= 2
    return tokenize(text)


def input_tokens(core: EngineCore, session_id: str, tokens: list[int] | TooLong) -> list[int]:
    """An input's tokens from `bounded_tokens`, or its refusal (on the engine thread, O(1))."""
    if isinstance(tokens, TooLong):
        core.writable(session_id)  # a missing or ended session is refused as such first
        raise ContextOverflow(
            f"input of more than {tokens.tokens} tokens (counted in its first {tokens.chars} characters) "
            f"does not fit session {session_id}: no input can be longer than the context window of "
            f"{core.context_window} tokens")
    return tokens


def _command(fn: Callable, keyed: bool = True) -> Callable:
    """A command of the core (a function taking the EngineCore first) as an Engine method: it
    runs on the engine thread and returns a Future of its result. `then` is attached to the
    future before any work is queued (see `Engine.call`). `keyed`: its first argument is the
    session id, whose queue it waits in (`FairQueue`)."""

    @functools.wraps(fn)
    def method(self: "Engine", *args, then: Callable[[Future], None] | None = None, **kwargs) -> Future:
        sid = (args[0] if args else kwargs.get("session_id")) if keyed else None
        return self.call(lambda: fn(self.core, *args, **kwargs), then, session_id=sid)

    return method


class Engine:
    """The engine thread: a fair control queue and futures around an `EngineCore`, and the
    tokenizer's workers that tokenize inputs and questions before it."""

    # The commands: what each does is documented where it is defined.
    close_session = _command(EngineCore.close_session)
    session_state = _command(EngineCore.session_state)
    add_listener = _command(session_commands.add_listener)
    remove_listener = _command(session_commands.remove_listener)
    append_frame = _command(jobs.append_frame)
    end_input = _command(jobs.end_input)
    transcribe = _command(jobs.transcribe)
    configure_window = _command(jobs.configure_window)
    ensure_window = _command(window.ensure)
    configure_thinking = _command(thinking.configure_command)
    end_queries = _command(end_queries, keyed=False)
    register_flash = _command(flash.register)
    unregister_flash = _command(flash.unregister)
    add_rule = _command(actions.add_rule)
    remove_rule = _command(actions.remove_rule)
    start_actions = _command(actions.start_actions)
    stop_actions = _command(actions.stop_actions)

    def __init__(self, runner: ModelRunner, limits: EngineLimits | None = None) -> None:
        self.core = EngineCore(runner, limits)
        self.runner, self.limits, self.stats = runner, self.core.limits, self.core.stats
        self.sessions, self.pool = self.core.sessions, self.core.memory.pool
        if self.limits.command_burst < 1 or self.limits.tokenizer_threads < 1:
            raise ValueError("command_burst and tokenizer_threads must be at least 1")
        self._control = FairQueue()  # Commands, per owner and session
        self._tokenizing = FairQueue()  # (work, future) for the tokenizer's workers
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._workers: list[threading.Thread] = []
        self._workers_stop = False

    @property
    def context_window(self) -> int:
        return self.core.context_window

    def start(self) -> "Engine":
        self._workers = [threading.Thread(target=self._tokenizer_worker, name=f"streamer-tokenizer-{i}", daemon=True)
                         for i in range(self.limits.tokenizer_threads)]
        for worker in self._workers:
            worker.start()
        self._thread = threading.Thread(target=self._run, name="streamer-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread is None:
            self.core.fail_all(EngineStopped())
        with self._tokenizing.cond:
            self._workers_stop = True
            self._tokenizing.cond.notify_all()
        for worker in self._workers:
            worker.join(timeout)

    def call(self, fn: Callable[[], object], then: Callable[[Future], None] | None = None,
             session_id: str | None = None, owner: str | None = None, ready: Future | None = None) -> Future:
        """Run `fn` on the engine thread; its return value (a value, or a future it chains to) or
        its exception resolves the future. `then` is attached to the future before any work is
        queued, so callers on other threads see completions in the order the engine made them
        (the event log relies on it). It waits in `session_id`'s queue (else `owner`'s), behind
        that session's earlier commands, and runs in its turn once `ready` (its input's tokens)
        is done. Before `start()`, `fn` runs now, on the calling thread."""
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
                settle(fut, exc=exc)
            else:
                chain(result, fut)

        if self._thread is None:
            run()
            self.stats.commands += 1
        else:
            self._control.put(*self._key(session_id, owner), Command(run, ready))
            if ready is not None:
                ready.add_done_callback(lambda _: self._wake.set())
            self._wake.set()
        return fut

    def _key(self, session_id: str | None, owner: str | None) -> tuple[str, str]:
        """(owner, key) of a command: its session's owner and the session; a command of no
        session (a new session without an id, end_queries) waits in its owner's own queue."""
        if session_id is None:
            return owner or "", "\0" + (owner or "")
        if owner is None:
            session = self.core.sessions.get(session_id)  # read from another thread: the owner never changes
            owner = session.owner if session is not None else session_id
        return owner, session_id

    def create_session(self, system_prompt: str | None = None, session_id: str | None = None,
                       flash: list[dict] | None = None, thinking: dict | None = None,
                       window: dict | None | str = "default", owner: str | None = None,
                       then: Callable[[Future], None] | None = None) -> Future:
        """`EngineCore.create_session` as a command in the new session's (or its owner's) queue."""
        return self.call(lambda: self.core.create_session(system_prompt, session_id, flash, thinking, window, owner),
                         then, session_id=session_id, owner=owner)

    def _tokenize(self, session_id: str, work: Callable[[], object]) -> Future:
        """Run `work` (tokenizing an input or a question) on the tokenizer's workers, in the
        session's turn among the sessions waiting for them."""
        fut: Future = Future()
        self._tokenizing.put(*self._key(session_id, None), (work, fut))
        return fut

    def _tokenizer_worker(self) -> None:
        queue, any_item = self._tokenizing, lambda _: True
        while True:
            with queue.cond:
                while not len(queue) and not self._workers_stop:
                    queue.cond.wait()
                if not len(queue):
                    return
                work, fut = queue.pop(queue.next_key(any_item)[1], any_item)
            try:
                result = work()
            except BaseException as exc:  # handed to the command, which raises it
                fut.set_exception(exc)
                continue
            with queue.cond:
                self.stats.tokenized_off_engine += 1
            fut.set_result(result)

    def append(self, session_id: str, text: str, evict_first: list[int] | None = None,
               then: Callable[[Future], None] | None = None) -> Future:
        """`jobs.append`; on a started engine the text is tokenized by the tokenizer's workers,
        and the command runs (and checks its size) once its tokens are ready."""
        if self._thread is None:
            return self.call(lambda: jobs.append(self.core, session_id, text, evict_first), then, session_id)
        limit = self.context_window
        tokens = self._tokenize(session_id, lambda: bounded_tokens(self.runner.tokenize, text, limit))
        return self.call(lambda: jobs.append(self.core, session_id, text, evict_first,
                                             tokens=input_tokens(self.core, session_id, tokens.result())),
                         then, session_id, ready=tokens)

    def revise(self, session_id: str, text: str, from_seq: int | None = None, evict_first: list[int] | None = None,
               then: Callable[[Future], None] | None = None) -> Future:
        """`jobs.revise`, its text tokenized like `append`'s."""
        if self._thread is None:
            return self.call(lambda: jobs.revise(self.core, session_id, text, from_seq, evict_first), then, session_id)
        limit = self.context_window
        tokens = self._tokenize(session_id, lambda: bounded_tokens(self.runner.tokenize, text, limit))
        return self.call(lambda: jobs.revise(self.core, session_id, text, from_seq, evict_first,
                                             tokens=input_tokens(self.core, session_id, tokens.result())),
                         then, session_id, ready=tokens)

    def query(self, session_id: str, question: str, params: SamplingParams | None = None,
              on_delta: Callable[[str], None] | None = None, query_id: str | None = None,
              over: str = "sent") -> QueryHandle:
        """Ask a question (see `query.query`; `over`: "sent" or "read"); the handle's future
        resolves to a QueryResult. On a started engine the framed question is tokenized by the
        tokenizer's workers (with its session's framing; a session not there yet: by the command)."""
        cancelled = threading.Event()
        asked = self.stats.commands

        def framed() -> list[int] | None:
            session = self.core.sessions.get(session_id)  # its framing never changes
            return None if session is None else session.question_ids(question)

        ids = None if self._thread is None else self._tokenize(session_id, framed)
        fut = self.call(lambda: query(self.core, session_id, question, params, on_delta, query_id, cancelled, over,
                                      question_ids=None if ids is None else ids.result(), commands_asked=asked),
                        session_id=session_id, ready=ids)
        return QueryHandle(fut, cancelled)

    def robot_state(self, session_id: str, state: list[float], ts: float | None = None) -> None:
        """Thread-safe and immediate (see `actions.robot_state`)."""
        actions.robot_state(self.core.sessions, session_id, state, ts)

    def step(self) -> bool:
        """One step, on the calling thread (an engine that is not started)."""
        self._drain()
        return self.core.step()

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        self._drain()
        return self.core.run_until_idle(max_steps)

    def metrics(self) -> dict:
        return self.core.metrics()

    def snapshot_stats(self) -> dict:
        """The core's counters, and `queued_commands`: commands handed to the engine thread that
        it has not run yet (a snapshot)."""
        return {**snapshot_stats(self.core), "queued_commands": len(self._control)}

    def _commands(self) -> int:
        """Commands to run before the next step, in rounds: each session with a command ready
        gets a turn of up to `command_burst` commands (fewer once they took `command_quantum_s`),
        owners alternating (`FairQueue.next_key`); an owner whose turns in the round took
        `command_quantum_s` in all gets no more in it (so a round delays the next step by about a
        quantum per owner, as when an owner had one turn), and the round is cut short once
        it has run for `command_round_s` (the sessions not served go first next time). One round
        while several sessions have commands waiting (each gets its turn, then the engine steps,
        so no flood delays another session's step by more than an owner's share of a round; a
        round had one turn per owner, so sessions sharing an owner, feeds behind one address, got
        a turn one step in N); more
        rounds while only one has (nobody waits behind it: a fast feed's queued inputs are all
        read by the next step, not `command_burst` a step), for at most `command_burst` x
        `command_quantum_s` of command time. Returns how many ran. Their waiters are woken once
        per round, not once per command (`_run` holds them: `wakes_held`), or after the first
        command to end 2 ms into the hold."""
        ready, total = Command.is_ready, 0
        started = time.perf_counter()
        quantum = self.limits.command_quantum_s  # a turn's time, and an owner's share of a round
        budget = self.limits.command_burst * quantum
        while True:
            ran, round_started, spent = 0, time.perf_counter(), {}
            for _ in range(max(1, self._control.keys())):
                if ran and time.perf_counter() - round_started >= self.limits.command_round_s:
                    break
                found = self._control.next_key(ready, [o for o, t in spent.items() if t >= quantum])
                if found is None:
                    break
                owner, key = found
                turn = time.perf_counter()
                for _ in range(self.limits.command_burst):
                    command = self._control.pop(key, ready)
                    if command is None:
                        break
                    command.run()
                    release_old_wakes()  # a reply held 2 ms goes now, not after the round
                    self.stats.commands += 1
                    ran += 1
                    if time.perf_counter() - turn >= quantum:
                        break
                spent[owner] = spent.get(owner, 0.0) + time.perf_counter() - turn
            total += ran
            if not ran or self._control.keys() != 1 or time.perf_counter() - started >= budget:
                return total

    def _drain(self) -> None:
        """Run every queued command (in turn order, each waiting for its tokens if it must)."""
        anything = lambda _: True  # noqa: E731
        while len(self._control):
            command = self._control.pop(self._control.next_key(anything)[1], anything)
            command.run()
            self.stats.commands += 1

    def _run(self) -> None:
        while not self._stopping:
            with wakes_held():
                ran = self._commands()
            if not self.core.step() and not ran:
                self._wake.wait(self.core.next_wakeup())
                self._wake.clear()
        self._drain()
        self.core.fail_all(EngineStopped())
