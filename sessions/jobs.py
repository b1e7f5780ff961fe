"""Units of model work. A job says what tokens it wants to run next (`plan`) and takes the
logits after the forward (`complete`); the engine packs the plans of many jobs into one
forward. Jobs of one session run in submission order; across sessions, by priority.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch

from .errors import ContextOverflow
from .kvcache import KVCache
from .runner import SeqStep
from .sampling import Sampler, SamplingParams
from .session import AppendResult, Session


class Priority(IntEnum):
    """Lower runs first (DESIGN: interactive query > action > ingest > thinking > flash)."""

    QUERY = 0
    ACTION = 1
    INGEST = 2
    THINKING = 3
    FLASH = 4


class Job:
    """Base: `plan` -> forward -> `complete`, until `done`. Most jobs run one sequence a step
    (`plan_one`/`complete_one`); a job may run several (`plan`/`complete_many`)."""

    priority: Priority = Priority.INGEST

    def __init__(self, session: Session) -> None:
        self.session = session
        self.done = False
        self.submitted_at = time.monotonic()
        self.order = 0  # arrival order, set by the engine: FIFO within a priority
        self._planned = 0

    def plan(self, budget: int) -> list[SeqStep]:
        step = self.plan_one(budget)
        return [] if step is None else [step]

    def complete_many(self, rows: list[torch.Tensor]) -> None:
        self.complete_one(rows[0])

    def plan_one(self, budget: int) -> SeqStep | None:
        raise NotImplementedError

    def complete_one(self, logits: torch.Tensor) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        """Called when the job is dropped unfinished (session closed, engine error)."""

    def result(self):
        return None


class PrefillJob(Job):
    """Commit tokens to the session cache, at most `budget` per step (chunked prefill, so a
    long append never blocks other sessions' decoding for long)."""

    def __init__(self, session: Session, tokens: list[int], text: str | None, cache=None) -> None:
        super().__init__(session)
        self.tokens = tokens
        self.text = text  # None for the framing prefix, which is not an input
        self.cache = session.cache if cache is None else cache  # or a shared prefix being filled
        self.pos = 0
        self.start: int | None = 0 if cache is not None else None
        self.chunk = None
        self.counted = cache is None  # a shared prefix fill does not add to the session's tokens
        if self.counted:
            session.pending_tokens += len(tokens)

    def begin(self) -> None:
        """Runs once, when the job first reaches the head of its session's queue."""
        self.start = self.cache.length

    def plan_one(self, budget: int) -> SeqStep | None:
        if self.start is None:
            self.begin()
        n = min(budget, len(self.tokens) - self.pos)
        if n <= 0:  # nothing to run (an empty revise): finish without a forward
            self.finish()
            return None
        self._planned = n
        return SeqStep(self.cache, self.start + self.pos, self.tokens[self.pos:self.pos + n])

    def complete_one(self, logits: torch.Tensor) -> None:
        self.pos += self._planned
        self.cache.commit(self.start + self.pos)
        if self.counted:
            self.session.pending_tokens -= self._planned
        self.session.last_logits = logits
        if self.pos >= len(self.tokens):
            self.finish()

    def finish(self) -> None:
        if self.text is not None:
            self.chunk = self.session.record(self.text, self.start, self.tokens)
        self.done = True

    def abort(self) -> None:
        if self.counted:
            self.session.pending_tokens -= len(self.tokens) - self.pos

    def result(self) -> AppendResult | None:
        if self.chunk is None:
            return None
        s = self.session
        return AppendResult(s.id, self.chunk.seq, len(self.tokens), s.cache.length, s.data_version,
                            time.monotonic() - self.submitted_at)


class ReviseJob(PrefillJob):
    """Replace the tail of the input (chunks from `from_seq` on, default the last one) with new
    text: crop the cache to the longest common token prefix of old and new tail, prefill the
    rest. The tail is resolved when the job runs, after every input queued before it."""

    def __init__(self, session: Session, text: str, from_seq: int | None) -> None:
        super().__init__(session, session.tokenize(text), text)
        self.from_seq = from_seq
        self.kept = 0
        self.replaced: list[int] = []

    def begin(self) -> None:
        s = self.session
        first = s.tail_from(self.from_seq)
        tail = s.chunks[first:]
        base = tail[0].start
        if base + len(self.tokens) > s.context_window:
            raise ContextOverflow(
                f"revised input of {len(self.tokens)} tokens would bring session {s.id} to "
                f"{base + len(self.tokens)} tokens; the context window is {s.context_window} tokens")
        old = [t for c in tail for t in c.tokens]
        lcp = 0
        for a, b in zip(old, self.tokens):
            if a != b:
                break
            lcp += 1
        if lcp == len(self.tokens) and lcp > 0:
            lcp -= 1  # re-run one token so the session's last logits stay current
        if not self.tokens:
            s.last_logits = None  # the tail is deleted; known again after the next input
        self.kept = lcp
        self.replaced = [c.seq for c in tail]
        del s.chunks[first:]
        s.cache.crop(base + self.kept)
        s.crop_epoch += 1  # forks reading the old tail (flash evaluations) are now stale
        self.start, self.pos = base, self.kept
        s.pending_tokens -= self.kept

    def finish(self) -> None:
        s = self.session
        if self.tokens:
            self.chunk = s.record(self.text, self.start, self.tokens)
        else:  # revised to nothing: the tail is deleted
            s.data_version += 1
            s.last_input_at = time.time()
        self.done = True

    def result(self) -> AppendResult:
        s = self.session
        seq = self.chunk.seq if self.chunk else 0
        return AppendResult(s.id, seq, len(self.tokens), s.cache.length, s.data_version,
                            time.monotonic() - self.submitted_at, self.kept, self.replaced)


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

    @property
    def decode_tokens_per_s(self) -> float:
        decode = self.total_s - self.first_token_s
        return (len(self.tokens) - 1) / decode if len(self.tokens) > 1 and decode > 0 else 0.0


class QueryJob(Job):
    """A question as a fork: its tokens are written past the session's committed length and
    never committed, so the session is unchanged when it ends (no copy, no crop)."""

    priority = Priority.QUERY

    def __init__(self, session: Session, query_id: str, question: str, params: SamplingParams,
                 stop_ids: frozenset[int], on_delta: Callable[[str], None] | None = None,
                 cancelled: threading.Event | None = None) -> None:
        super().__init__(session)
        self.query_id = query_id
        self.question_ids = session.question_ids(question)
        self.params = params
        self.sampler = Sampler(params)
        self.stop_ids = stop_ids
        self.on_delta = on_delta
        self.cancelled = cancelled or threading.Event()
        self.base: int | None = None
        self.fed = 0  # fork tokens already in the cache (question + generated)
        self.generated: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self.started_at = self.first_token_at = self.prefilled_at = self.done_at = 0.0
        self.data_version = 0
        self.max_new = params.max_tokens
        self.own: KVCache | None = None  # dual thinking: the fork's tokens live here
        self.prefixes: tuple = ()
        self.pos0 = 0

    def begin(self) -> None:
        s = self.session
        self.base = s.cache.length
        self.data_version = s.data_version
        self.started_at = time.monotonic()
        thinking = s.thinking
        self.pos0 = self.base
        if thinking is not None and thinking.cache is not None and thinking.cache.length:
            # Dual thinking: the question sees the reading cache and the notes, and its
            # positions come after both streams.
            self.prefixes = ((s.cache, self.base), (thinking.cache, thinking.cache.length))
            self.pos0 = max(self.base, thinking.last_position + 1)
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
        return SeqStep(self.session.cache, self.base + self.fed, tokens)

    def complete_one(self, logits: torch.Tensor) -> None:
        self.fed += self._planned
        if self.own is not None:
            self.own.commit(self.fed)
        if self.fed < len(self.question_ids):
            return  # more question tokens to prefill
        now = time.monotonic()
        if not self.generated:
            self.prefilled_at = now
        token = self.sampler(logits)
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
        text = self.session.tokenizer.decode(self.generated, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return  # an incomplete UTF-8 sequence: wait for the next token
        for stop in self.params.stop:
            cut = text.find(stop)
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
        )


def drive(runner, job: Job, budget: int = 512):
    """Run one job to completion on the calling thread (tests, benchmarks, replay)."""
    while not job.done:
        steps = job.plan(budget)
        if steps:
            job.complete_many(runner.forward(steps, logits="last"))
    return job.result()
