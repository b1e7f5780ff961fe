"""Questions: a fork over the session's caches that decodes an answer and leaves no trace.

A `QueryJob` writes the framed question and each generated token past the session's committed
length and never commits them, so the session is unchanged when it ends (no copy, no crop). With
dual thinking the fork keeps its tokens in a private cache over two read-only ranges (the reading
cache and the notes) instead.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .detok import TextStream
from .errors import Code, ContextOverflow, InvalidRequest
from .forks import fork_view
from .jobs import Job, Priority
from .kvcache import KVCache
from .room import Room
from .runner import SeqStep
from .sampling import Sampler, SamplingParams
from .session import Session, normalize

if TYPE_CHECKING:
    from .engine import EngineCore


def adopt(session: Session, answered: int) -> None:
    """A handed-off session's count of answered questions (sessions/handoff.py)."""
    session.queries_answered = answered


@dataclass(slots=True)
class QueryResult:
    session_id: str
    query_id: str
    text: str
    tokens: list[int]
    finish_reason: str
    data_version: int
    context_tokens: int
    question_tokens: int
    queue_s: float
    prefill_s: float
    first_token_s: float
    total_s: float
    cached: bool = False  # answered from a current flash answer, without running the model
    steps: int = 0  # engine steps it ran in
    steps_waited: int = 0  # engine steps that ran after it was asked and before its first
    max_step_tokens: int = 0  # the most tokens (its own and other work's) one of its steps carried
    over: str = "sent"  # what it was asked over: "sent" (all input sent before it) or "read" (what was read)
    unread_inputs: int = 0  # inputs sent before it that it did not see (still being read): 0 for "sent"
    commands_waited: int = 0  # engine commands (any session's) run after it was asked and before its first step

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.total_s - self.first_token_s
        return (len(self.tokens) - 1) / decode if len(self.tokens) > 1 and decode > 0 else 0.0


class QueryHandle:
    """A running question: `future` resolves to a QueryResult; `cancel()` stops it at its next
    step (or before it starts), and it then finishes with finish_reason "cancelled"."""

    def __init__(self, future: Future, cancelled: threading.Event) -> None:
        self.future = future
        self._cancelled = cancelled

    def cancel(self) -> None:
        self._cancelled.set()


class QueryJob(Job):
    """A question as a fork: its tokens are written past the session's committed length and
    never committed, so the session is unchanged when it ends (no copy, no crop)."""

    priority = Priority.QUERY
    kind = "query"

    def __init__(self, session: Session, query_id: str, question: str, params: SamplingParams,
                 stop_ids: frozenset[int], on_delta: Callable[[str], None] | None = None,
                 cancelled: threading.Event | None = None, over: str = "sent",
                 question_ids: list[int] | None = None) -> None:
        super().__init__(session)
        self.query_id = query_id
        self.over = over
        self.unread_inputs = 0  # "read": the inputs queued before it that it went ahead of
        self.question_ids = session.question_ids(question) if question_ids is None else question_ids
        self.stats = None  # the engine's stats, and its `commands` count when asked (`commands_waited`)
        self.commands_asked: int | None = None
        self.commands_waited = 0
        self.params = params
        self.sampler = Sampler(params, stop_ids)
        self.stop_ids = stop_ids
        self.on_delta = on_delta
        self.cancelled = cancelled or threading.Event()
        self.base: int | None = None
        self.fed = 0  # fork tokens already in the cache (question + generated)
        self.generated: list[int] = []
        self.stream = TextStream(session.tokenizer)  # the answer's text, a few tokens decoded a token
        self.text = ""
        self.finish_reason = ""
        self.started_at = self.first_token_at = self.prefilled_at = self.done_at = 0.0
        self.data_version = 0
        self.max_new = params.max_tokens
        self.own: KVCache | None = None  # dual thinking: the fork's tokens live here
        self.prefixes: tuple = ()
        self.pos0 = 0

    @property
    def reads_notes(self) -> bool:
        return self.base is not None and bool(self.prefixes)

    @property
    def begun(self) -> bool:
        return self.base is not None or self.steps > 0

    def want(self) -> int:
        """Its whole question, then one token per step."""
        q = len(self.question_ids)
        return q - self.fed if self.fed < q else 1

    def room(self) -> Room | None:
        """A windowed session always answers: it evicts old input first, until question and
        answer fit after the question's position in the model's window."""
        s = self.session
        if self.base is not None or s.window is None:
            return None
        view = fork_view(s)  # the question's first token goes after the reading cache (and dual notes)
        at = view.base if view.notes_end is None else max(view.base, view.notes_end)
        return Room(len(self.question_ids) + self.params.max_tokens, answer_at=at)

    def begin(self) -> None:
        s = self.session
        if self.stats is not None and self.commands_asked is not None:  # its own command aside
            self.commands_waited = max(0, self.stats.commands - self.commands_asked - 1)
        view = fork_view(s)
        self.base = view.base
        self.data_version = s.data_version
        self.started_at = time.monotonic()
        self.pos0 = self.base
        if view.notes:  # dual thinking: the question sees the reading cache and the notes, and its
            # positions come after both streams (without notes it writes past the reading cache itself)
            self.prefixes = view.prefixes
            self.pos0 = view.position
        room = s.context_window - self.pos0 - len(self.question_ids)
        if room < 1:
            raise ContextOverflow(
                f"question of {len(self.question_ids)} tokens on {self.base} tokens of context leaves "
                f"no room to answer; the context window is {s.context_window} tokens")
        self.max_new = min(self.params.max_tokens, room)
        if self.prefixes:
            self.own = s.runner.new_cache(len(self.question_ids) + self.max_new)
        else:
            s.cache.reserve(self.base + len(self.question_ids) + self.max_new)

    def plan_one(self, budget: int) -> SeqStep | None:
        if self.base is None:
            self.begin()
        if self.cancelled.is_set():
            self._finish("cancelled")
            return None
        q = len(self.question_ids)
        if self.fed < q:
            n = min(budget, q - self.fed)
            tokens = self.question_ids[self.fed:self.fed + n]
        else:
            n, tokens = 1, self.generated[-1:]
        self._planned = n
        if self.own is not None:
            return SeqStep(self.own, self.fed, tokens, prefixes=self.prefixes, pos0=self.pos0)
        return SeqStep(self.session.cache, self.base + self.fed, tokens, pos0=self.session.position_offset)

    def complete_one(self, logits: torch.Tensor) -> None:
        self.fed += self._planned
        if self.own is not None:
            self.own.commit(self.fed)
        if self.fed < len(self.question_ids):
            return  # more question tokens to prefill
        now = time.monotonic()
        if not self.generated:
            self.prefilled_at = now
        token = self.sampler(logits, self.generated)
        if token in self.stop_ids:
            self._finish("stop")
            return
        self.generated.append(token)
        if len(self.generated) == 1:
            self.first_token_at = now
        self._emit_text()
        if self.done:
            return
        if len(self.generated) >= self.max_new:
            self._finish("length" if self.max_new == self.params.max_tokens else "context_window")

    def _emit_text(self) -> None:
        self.stream.push(self.generated[-1])
        text, before = self.stream.text, len(self.text)
        if text == self.text:
            return  # no new text (an incomplete UTF-8 character waits for the next token)
        for stop in self.params.stop:
            cut = text.find(stop, max(0, before - len(stop) + 1))  # a stop string ends in the new text
            if cut >= 0:
                self._push(text[:cut])
                self._finish("stop_string")
                return
        self._push(text)

    def _push(self, text: str) -> None:
        if len(text) > len(self.text) and text.startswith(self.text):
            delta, self.text = text[len(self.text):], text
            if self.on_delta is not None:
                self.on_delta(delta)
        elif text != self.text:  # detokenization changed earlier text (rare): resend nothing
            self.text = text

    def _finish(self, reason: str) -> None:
        if reason != "stop_string":  # the final text is the whole decode's (once, not a token)
            self._push(self.stream.finish())
        self.finish_reason = reason
        self.done_at = time.monotonic()
        self.done = True
        self.session.queries_answered += 1

    def result(self) -> QueryResult:
        started = self.started_at or self.done_at
        return QueryResult(
            session_id=self.session.id, query_id=self.query_id, text=self.text,
            tokens=list(self.generated), finish_reason=self.finish_reason,
            data_version=self.data_version, context_tokens=self.base or 0,
            question_tokens=len(self.question_ids),
            queue_s=started - self.submitted_at,
            prefill_s=(self.prefilled_at or self.done_at) - started,
            first_token_s=(self.first_token_at or self.done_at) - self.submitted_at,
            total_s=self.done_at - self.submitted_at,
            steps=self.steps, steps_waited=self.steps_waited, max_step_tokens=self.max_step_tokens,
            over=self.over, unread_inputs=self.unread_inputs, commands_waited=self.commands_waited,
        )

    def finish(self, core: EngineCore, exc: BaseException | None = None) -> None:
        if exc is None:
            core.stats.queries += 1
        if not self.session.closed and self.base is not None:  # it began: its fork may hold blocks
            self.session.cache.trim()  # the fork's blocks go back to the pool
        super().finish(core, exc)


def cached_answer(session: Session, question: str, params, query_id: str | None):
    """A query that asks a registered question whose answer is current needs no model: its
    QueryResult, or None."""
    if params.temperature != 0 or params.stop or session.pending_tokens:
        return None
    penalties = params.penalties
    key = normalize(question)
    for q in session.flash.questions.values():
        a = q.answer
        if normalize(q.question) != key or a is None or a.data_version != session.data_version:
            continue
        if q.penalties != penalties:
            return None  # decoded with other penalties: a different answer
        complete = params.max_tokens == q.max_tokens or (a.finish_reason == "stop" and len(a.tokens) < params.max_tokens)
        if not complete:
            return None
        session.queries_answered += 1
        return QueryResult(session.id, query_id or secrets.token_hex(6), a.text, list(a.tokens), a.finish_reason,
                           a.data_version, session.cache.length, len(q.question_ids), 0.0, 0.0, 0.0, 0.0,
                           cached=True)
    return None


def end_queries(core: EngineCore, reason: str = "shutdown") -> int:
    """Every question still running or queued ends now, between steps, with `finish_reason`
    `reason` and the text it has so far: the server's shutdown gives each its final `query.done`
    instead of cutting it. The sessions are unchanged (a question never commits). Returns how many."""
    ended = [job for queue in core.lanes.fifo.values() for job in queue if job.kind == "query" and not job.done]
    for job in ended:
        job._finish(reason)
        core.lanes.remove(job)
        job.finish(core)
    return len(ended)


OVER = ("sent", "read")  # what a question may be asked over (docs/protocol.md, query.create `over`)


def query(core: EngineCore, session_id: str, question: str, params: SamplingParams | None = None,
          on_delta: Callable[[str], None] | None = None, query_id: str | None = None,
          cancelled: threading.Event | None = None, over: str = "sent", question_ids: list[int] | None = None,
          commands_asked: int | None = None) -> Future | QueryResult:
    """Ask a question; resolves to a QueryResult. A registered question whose answer is current
    is answered from it, without the model.

    `over="sent"` (the default): the answer waits its turn in the session's FIFO, so it sees every
    input queued before it. `over="read"`: it answers over what the session has read so far: it
    goes ahead of the session's backlog of unread input (behind the one input being read now, if
    any, which is read to its end first: an answer never sees half an input), and its result says
    how many inputs queued before it it did not see (`unread_inputs`). Either way the session is
    unchanged: a question never commits. `question_ids`: the framed question tokenized before the
    engine thread (`Engine.query`), else here; `commands_asked`: the engine's command count when
    it was asked (its result's `commands_waited`)."""
    if over not in OVER:
        raise InvalidRequest(f"over must be one of {', '.join(map(repr, OVER))}, got {over!r}", param="over")
    params = params or SamplingParams()
    session = core.live(session_id)
    params.validate(core.limits.max_answer_tokens)
    cached = cached_answer(session, question, params, query_id)
    if cached is not None:  # current for every input: nothing is unread
        cached.over = over
        core.stats.queries_cached += 1
        if on_delta is not None and cached.text:
            on_delta(cached.text)
        return cached
    if question_ids is None:
        core.stats.tokenized_on_engine += 1
    job = QueryJob(session, query_id or secrets.token_hex(6), question, params, core.stop_ids, on_delta, cancelled,
                   over, question_ids)
    job.stats, job.commands_asked = core.stats, commands_asked
    if len(job.question_ids) > core.limits.max_question_tokens:
        raise InvalidRequest(f"question of {len(job.question_ids)} tokens exceeds the limit "
                             f"of {core.limits.max_question_tokens} tokens", code=Code.QUESTION_TOO_LONG)
    future = core.submit(job, ahead=over == "read")
    if over == "read":
        job.unread_inputs = core.lanes.inputs_behind(job)
    return future
