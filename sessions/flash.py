"""Flash queries: registered questions, re-answered in idle time after each data update.

All of a session's due questions are evaluated together by one `FlashJob`: each question is
a fork with a small cache of its own on top of the session's reading cache, so the forks
never touch the session, run beside its ingest, and read the shared prefix once per step
(`kernels.forked_attention`). One forward prefills every question; then each step decodes one
token for every unfinished question.

An evaluation is labelled with the `data_version` it started on. Input that lands while it
runs does not change that label (the prefix it reads is frozen: appends only write past it);
a revise, which rewrites the prefix, cancels it.

Answers never go stale in silence. Questions are first evaluated after the first input (never
on the bare framing). Each `flash.updated` carries `staleness_ms`: from the moment the data it
saw was accepted to the push. Behind is measured in time and in the question's own cost: an
evaluation waits for the session's input queue to drain until its question is overdue (behind
its data longer than 0.25 s or than an evaluation of it takes), then runs beside the feed, on
what each step leaves after the input; a question behind longer than
`EngineLimits.flash_stale_s` or four times its cost (or more than `flash_stale_versions`
versions, where that is set) gets one `flash.stale` (reason `behind`) and from then on goes
ahead of queued input. A fast feed whose answers keep up is many versions behind at every
moment and is never reported stale for it. A question that cannot be evaluated says why at
once (`no_room`: question and answer do not fit the model's window of an unbounded session;
`failed`: the evaluation raised). The next
evaluation clears the mark. A windowed session always answers: an evaluation evicts old input
first where its questions would not fit (`FlashJob.room`, as a question asked does), also when
dual notes take the positions after the data.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .actions import fire_rules
from .errors import Code, EngineError, InvalidRequest
from .forks import fork_view
from .jobs import Job, Lanes, Priority
from .kvcache import KVCache
from .room import Room
from .runner import SeqStep
from .sampling import Penalties, greedy
from .session import Session, normalize

if TYPE_CHECKING:
    from .engine import EngineCore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FlashAnswer:
    text: str
    tokens: list[int]
    data_version: int
    logit_gap: float  # top-1 minus top-2 logit of the first answer token
    mean_prob: float  # mean probability of the chosen tokens
    eval_s: float
    evaluated_at: float
    finish_reason: str
    media_s: float | None = None  # media time of the newest frame it saw (video on a VL model)

    def public(self) -> dict:
        out = {"answer": self.text, "data_version": self.data_version,
               "confidence": {"logit_gap": round(self.logit_gap, 4), "mean_prob": round(self.mean_prob, 4)},
               "eval_ms": round(self.eval_s * 1000, 2), "evaluated_at": self.evaluated_at,
               "finish_reason": self.finish_reason}
        if self.media_s is not None:
            out["media_s"] = round(self.media_s, 3)
        return out


@dataclass(slots=True)
class FlashQuestion:
    """A registered question and what it last said."""

    flash_id: str
    question: str
    question_ids: list[int]
    max_tokens: int = 32
    priority: int = 0  # higher first, when a step's budget cannot take every question
    min_interval_s: float = 0.0  # at least this long between evaluations
    confirm: int = 1  # consecutive identical answers needed before a change is pushed
    penalties: Penalties = field(default_factory=Penalties)  # on the answer's own tokens (sampling.py)
    answer: FlashAnswer | None = None  # the last pushed answer
    candidate: str | None = None  # a changed answer waiting for confirmation
    candidate_count: int = 0
    evaluated_version: int = -1
    last_eval_at: float = 0.0
    evaluations: int = 0
    cost_s: float = 0.0  # what an evaluation of it takes, from queued to answered (smoothed)
    stale: str | None = None  # why it is marked stale (behind | no_room | failed), until its next evaluation
    history: deque = field(default_factory=lambda: deque(maxlen=32))

    def due(self, version: int, now: float) -> bool:
        return 0 < version and self.evaluated_version < version and now - self.last_eval_at >= self.min_interval_s

    def observe(self, result: FlashAnswer) -> bool:
        """Record an evaluation; True when it is to be pushed (first answer, or a change seen
        `confirm` times in a row)."""
        self.evaluated_version = max(self.evaluated_version, result.data_version)
        self.last_eval_at = time.monotonic()
        self.evaluations += 1
        self.cost_s = result.eval_s if self.evaluations == 1 else 0.7 * self.cost_s + 0.3 * result.eval_s
        self.history.append((result.data_version, result.logit_gap, result.mean_prob, result.evaluated_at))
        new = normalize(result.text)
        if self.answer is not None and new == normalize(self.answer.text):
            self.candidate, self.candidate_count = None, 0
            self.answer = result  # same answer, fresher version and confidence: not pushed
            return False
        if self.answer is not None and self.confirm > 1:
            self.candidate_count = self.candidate_count + 1 if new == self.candidate else 1
            self.candidate = new
            if self.candidate_count < self.confirm:
                return False
        self.candidate, self.candidate_count = None, 0
        self.answer = result
        return True

    def state(self, data_version: int) -> dict:
        out = {"flash_id": self.flash_id, "question": self.question, "max_tokens": self.max_tokens,
               "priority": self.priority, "min_interval_ms": self.min_interval_s * 1000, "confirm": self.confirm,
               "evaluations": self.evaluations, "stale": self.stale, **self.penalties.public()}
        if self.answer is not None:
            out.update(self.answer.public())
            out["staleness"] = {"versions": data_version - self.answer.data_version,
                                "seconds": round(time.time() - self.answer.evaluated_at, 3)}
        out["history"] = [{"data_version": v, "logit_gap": round(g, 4), "mean_prob": round(p, 4), "at": t}
                          for v, g, p, t in self.history]
        return out


class _Fork:
    __slots__ = ("q", "cache", "fed", "generated", "gap", "probs", "done", "finish_reason", "planned")

    def __init__(self, q: FlashQuestion, cache: KVCache) -> None:
        self.q = q
        self.cache = cache
        self.fed = 0
        self.generated: list[int] = []
        self.gap = 0.0
        self.probs: list[float] = []
        self.done = False
        self.finish_reason = ""
        self.planned = 0


class FlashJob(Job):
    """One evaluation of several flash questions of a session, batched."""

    kind = "flash"
    beside = True
    background = True

    def __init__(self, session: Session, questions: list[FlashQuestion], stop_ids: frozenset[int]) -> None:
        super().__init__(session)
        self.stop_ids = stop_ids
        self.questions = sorted(questions, key=lambda q: -q.priority)
        self.cancelled = False
        self.opened = False  # its forks were laid out where the session stood when it started
        self.results: list[tuple[FlashQuestion, FlashAnswer]] = []
        self._lay_out()

    def _lay_out(self) -> None:
        """Where its forks read (the reading cache, dual notes) and which questions fit there."""
        session = self.session
        view = fork_view(session)  # the reading cache (and dual notes), positions after them
        self.base = view.base
        self.prefixes: tuple = view.prefixes
        self.pos0: int | None = view.position if view.notes or session.position_offset else None
        self.version = session.data_version
        self.media_s = session.media_s
        self.data_at = session.last_input_at or time.time()  # when the data it reads was accepted
        self.epoch = session.crop_epoch
        self.started = time.monotonic()
        self.forks: list[_Fork] = []
        self.skipped: list[FlashQuestion] = []
        room = session.context_window - self._at()
        for q in self.questions:
            if len(q.question_ids) + 1 > room:
                self.skipped.append(q)  # no room to answer at this length
                continue
            need = len(q.question_ids) + min(q.max_tokens, room - len(q.question_ids))
            self.forks.append(_Fork(q, session.runner.new_cache(need)))
        self.done = not self.forks

    def _at(self) -> int:
        """The position of the questions' first token."""
        return self.base if self.pos0 is None else self.pos0

    def room(self) -> Room | None:
        """A windowed session always answers (sessions/window.py): before it starts, old input is
        evicted until its longest question and answer fit after the notes and the reading cache in
        the model's window, as for a question asked (a dual session's notes take positions too)."""
        if self.opened or self.session.window is None:
            return None
        return Room(max(len(q.question_ids) + q.max_tokens for q in self.questions), answer_at=self._at())

    @property
    def reads_notes(self) -> bool:
        return True  # its forks may read the thinking cache for as long as it runs

    @property
    def urgent(self) -> bool:
        """A question it evaluates is marked stale: it is as urgent as the input it is behind
        (ranked first in the ingest class), even if it was queued before the mark. (An overdue
        one only stops waiting for the input queue to drain: it takes what a step leaves after
        the input, so an evaluation that costs seconds never crowds out the feed.)"""
        return any(f.q.stale == "behind" for f in self.forks if not f.done)

    @property
    def priority(self) -> Priority:
        return Priority.INGEST if self.urgent else Priority.FLASH

    def want(self) -> int:
        return sum(len(f.q.question_ids) - f.fed if f.fed < len(f.q.question_ids) else 1
                   for f in self.forks if not f.done)

    def plan(self, budget: int) -> list[SeqStep]:
        s = self.session
        if not self.opened:
            self.opened = True
            if s.crop_epoch != self.epoch and not s.closed:  # its room was made since it was queued
                self._lay_out()
        if s.closed or s.crop_epoch != self.epoch:
            self.cancelled = self.done = True  # the prefix it read was rewritten: drop it
            return []
        steps = []
        for f in self.forks:
            if f.done or budget <= 0:
                continue
            if f.fed < len(f.q.question_ids):
                n = min(budget, len(f.q.question_ids) - f.fed)
                tokens = f.q.question_ids[f.fed:f.fed + n]
            else:
                n, tokens = 1, f.generated[-1:]
            f.planned = n
            budget -= n
            steps.append(SeqStep(f.cache, f.fed, tokens, prefixes=self.prefixes, pos0=self.pos0))
        return steps

    def complete_many(self, rows: list[torch.Tensor]) -> None:
        planned = [f for f in self.forks if f.planned]
        for f, logits in zip(planned, rows):
            f.fed += f.planned
            f.cache.commit(f.fed)
            f.planned = 0
            if f.fed < len(f.q.question_ids):
                continue
            self._take(f, logits)
        if all(f.done for f in self.forks):
            self._finish()

    def _take(self, f: _Fork, logits: torch.Tensor) -> None:
        logits = f.q.penalties.apply(logits, f.generated, self.stop_ids)
        token = greedy(logits)
        probs = torch.softmax(logits.float(), dim=-1)
        if not f.generated:
            top = torch.topk(logits, 2).values
            f.gap = float(top[0] - top[1])
        f.probs.append(float(probs[token]))
        limit = min(f.q.max_tokens, f.cache.max_tokens - len(f.q.question_ids))
        if token in self.stop_ids:
            f.done, f.finish_reason = True, "stop"
        else:
            f.generated.append(token)
            if len(f.generated) >= limit:
                f.done = True
                f.finish_reason = "length" if limit == f.q.max_tokens else "context_window"

    def finish(self, core: EngineCore, exc: BaseException | None = None) -> None:
        """Each answer passes its question's hysteresis; changed answers go to the session's
        listeners as `flash.updated` (and fire the rules on them)."""
        session = self.session
        if exc is not None:
            log.error("flash evaluation on session %s failed: %s", session.id, exc)
            for f in self.forks:  # do not retry the same data in a loop; say so
                f.q.evaluated_version = max(f.q.evaluated_version, self.version)
                mark_stale(session, f.q, "failed", f"the evaluation failed: {exc}")
            return
        if self.cancelled:
            core.stats.flash_cancelled += 1
            return
        for q in self.skipped:  # no room to answer at this length: not retried until the data changes
            q.evaluated_version = max(q.evaluated_version, self.version)
            mark_stale(session, q, "no_room", f"question of {len(q.question_ids)} tokens does not fit beside "
                       f"{self.base} tokens of context in the model's window of {session.context_window}")
        staleness_s = max(0.0, time.time() - self.data_at)
        for q, answer in self.results:
            if session.flash.questions.get(q.flash_id) is not q:
                continue  # unregistered while it ran
            core.stats.flash_questions_evaluated += 1
            q.stale = None
            session.flash.staleness.observe(staleness_s)
            if q.observe(answer):
                core.stats.flash_pushed += 1
                session.notify("flash.updated", {"flash_id": q.flash_id, "question": q.question, **answer.public(),
                                                 "staleness_ms": round(staleness_s * 1000, 1)})
                fire_rules(session, q.flash_id, answer)
            else:  # not a change, but the answer is current for newer data: state watchers refresh
                session.notify("flash.evaluated", {"flash_id": q.flash_id, "data_version": answer.data_version,
                                                   "staleness_ms": round(staleness_s * 1000, 1)})

    def _finish(self) -> None:
        now, wall = time.monotonic(), time.time()
        tok = self.session.tokenizer
        for f in self.forks:
            text = tok.decode(f.generated, skip_special_tokens=True)
            mean = sum(f.probs) / len(f.probs) if f.probs else 0.0
            self.results.append((f.q, FlashAnswer(text, f.generated, self.version, f.gap, mean,
                                                  now - self.started, wall, f.finish_reason, self.media_s)))
        self.done = True


def validate_registration(session: Session, question: str, flash_id: str | None, max_tokens: int,
                          priority: int, min_interval_s: float, confirm: int, limit: int,
                          answer_limit: int, penalties: Penalties | None = None) -> FlashQuestion:
    """Check a registration against the session's registry and the limits; build it."""
    if len(session.flash.questions) >= limit:
        raise EngineError(f"session {session.id} already has {limit} flash questions (the limit)",
                          code=Code.FLASH_LIMIT)
    if not question.strip():
        raise InvalidRequest("flash question is empty")
    key = normalize(question)
    for existing in session.flash.questions.values():
        if normalize(existing.question) == key:
            raise EngineError(f"question already registered as {existing.flash_id!r}", code=Code.FLASH_DUPLICATE)
    if flash_id is not None and flash_id in session.flash.questions:
        raise EngineError(f"flash id {flash_id!r} is already in use", code=Code.FLASH_DUPLICATE)
    if not 1 <= max_tokens <= answer_limit:
        raise InvalidRequest(f"max_tokens must be in [1, {answer_limit}], got {max_tokens}", param="max_tokens",
                             code=Code.MAX_TOKENS_TOO_LARGE if max_tokens > answer_limit else None)
    if not 1 <= confirm <= 100:
        raise InvalidRequest(f"confirm must be in [1, 100], got {confirm}")
    if min_interval_s < 0:
        raise InvalidRequest(f"min_interval must be >= 0, got {min_interval_s}")
    penalties = penalties or Penalties()
    penalties.validate()
    fid = flash_id or f"f{session.flash.next_id}"
    session.flash.next_id += 1
    return FlashQuestion(fid, question, session.question_ids(question), max_tokens, priority,
                         min_interval_s, confirm, penalties)


# How far behind its data a question may fall, in time and in its own evaluation cost (a
# question that takes 2 s to answer is always ~2 s behind a fast feed and still keeps up):
OVERDUE_MIN_S = 0.25  # overdue past max(this, OVERDUE_COST x its cost): evaluated beside queued input
OVERDUE_COST = 1.0  # (so on a steady feed a question is re-evaluated about as often as it can be)
STALE_COST = 4.0  # flash.stale (behind) past max(flash_stale_s, this x its cost)


def behind_limit_s(q: FlashQuestion, factor: float, floor_s: float) -> float:
    """How long `q` may stay behind its data: `floor_s`, or `factor` times its evaluation cost
    (plus the interval it asked for), whichever is longer."""
    return max(floor_s, factor * q.cost_s + q.min_interval_s)


def overdue(session: Session, q: FlashQuestion) -> bool:
    """Whether `q` fell so far behind that its evaluation no longer waits for the input queue
    to drain (it runs beside the feed, on what each step leaves): marked stale, or behind longer
    than `behind_limit_s(q, OVERDUE_COST, OVERDUE_MIN_S)`."""
    if q.stale == "behind":
        return True
    if q.evaluated_version >= session.data_version:
        return False
    return session.staleness_since(q.evaluated_version) > behind_limit_s(q, OVERDUE_COST, OVERDUE_MIN_S)


def next_evaluation(session: Session, lanes: Lanes, stop_ids: frozenset[int]) -> FlashJob | None:
    """One batched evaluation of the session's due questions (their last evaluation is older
    than the data and their interval), when the session is idle: no input waiting (unless a
    question is overdue: then it runs beside the input), no reasoning unit running
    (a unit may drop notes a flash fork would read). Whether a due unit goes first is the
    background rule's choice (`background.start`)."""
    sid = session.id
    if lanes.running(sid, "flash") or not session.flash.questions:
        return None
    if session.cache.parked is not None or lanes.running(sid, "think"):
        return None
    now = time.monotonic()
    due = [q for q in session.flash.questions.values() if q.due(session.data_version, now)]
    if not due:
        return None
    if (session.pending_tokens or lanes.input_waiting(sid)) and not any(overdue(session, q) for q in due):
        return None
    return FlashJob(session, due, stop_ids)


def mark_stale(session: Session, q: FlashQuestion, reason: str, message: str) -> None:
    """Push `flash.stale` for one question (once per reason, until its next evaluation)."""
    if q.stale == reason:
        return
    q.stale = reason
    behind_s = session.staleness_since(q.evaluated_version)
    session.notify("flash.stale", {
        "flash_id": q.flash_id, "question": q.question, "reason": reason, "message": message,
        "data_version": session.data_version, "answer": q.answer.text if q.answer is not None else None,
        "answer_version": q.answer.data_version if q.answer is not None else None,
        "versions_behind": session.data_version - max(0, q.evaluated_version),
        "seconds_behind": round(behind_s, 3)})


def check_stale(session: Session, max_versions: int, max_seconds: float) -> None:
    """Mark the questions whose last evaluation is too far behind the data (`flash.stale`): more
    than `behind_limit_s(q, STALE_COST, max_seconds)` in time, or more than `max_versions`
    versions where that limit is set (0: time only, the default: a fast feed whose answers keep
    up is many versions behind at every moment, and that says nothing)."""
    version = session.data_version
    for q in session.flash.questions.values():
        if q.stale is not None or q.evaluated_version >= version or version == 0:
            continue
        versions = version - max(0, q.evaluated_version)
        seconds = session.staleness_since(q.evaluated_version)
        limit_s = behind_limit_s(q, STALE_COST, max_seconds)
        if (max_versions and versions > max_versions) or seconds > limit_s:
            limits = f"{max_versions} versions, {limit_s:.3g} s" if max_versions else f"{limit_s:.3g} s"
            mark_stale(session, q, "behind", f"the answer is {versions} versions and {seconds:.1f} s behind the "
                       f"data (limit: {limits}; an evaluation of it takes {q.cost_s:.3g} s)")


def next_stale_s(session: Session, max_seconds: float) -> float | None:
    """Seconds until a question that is behind crosses the staleness limit in time."""
    soonest = None
    for q in session.flash.questions.values():
        if q.stale is None and 0 < session.data_version and q.evaluated_version < session.data_version:
            limit_s = behind_limit_s(q, STALE_COST, max_seconds)
            wait = max(0.0, limit_s - session.staleness_since(q.evaluated_version))
            soonest = wait if soonest is None else min(soonest, wait)
    return soonest


def next_due_s(session: Session) -> float | None:
    """Seconds until a question waiting on its min interval becomes due (None: none waits)."""
    if session.cache.parked is not None:
        return None  # evaluated when it comes back
    now, soonest = time.monotonic(), None
    for q in session.flash.questions.values():
        if q.evaluated_version < session.data_version:
            wait = max(0.0, q.last_eval_at + q.min_interval_s - now)
            soonest = wait if soonest is None else min(soonest, wait)
    return soonest


# ---- commands (run on the engine thread; `core` is the EngineCore) -----------------------------


def register(core: EngineCore, session_id: str, question: str, flash_id: str | None = None, max_tokens: int = 32,
             priority: int = 0, min_interval_s: float = 0.0, confirm: int = 1, **penalties: float) -> dict:
    """Register a flash question; returns its state. It is evaluated in idle time after every
    data update, and `flash.updated` goes to the session's listeners on a change. `penalties`:
    repetition_penalty, presence_penalty, frequency_penalty, end_bias (sampling.Penalties)."""
    session = core.live(session_id)
    q = add_question(core, session, question, flash_id, max_tokens, priority, min_interval_s, confirm, **penalties)
    return q.state(session.data_version)


def add_question(core: EngineCore, session: Session, question: str, flash_id: str | None = None, max_tokens: int = 32,
                 priority: int = 0, min_interval_s: float = 0.0, confirm: int = 1, **penalties: float) -> FlashQuestion:
    """A flash question checked against the engine's limits and added to the session."""
    limits = core.limits
    q = validate_registration(session, question, flash_id, max_tokens, priority, min_interval_s,
                              confirm, limits.max_flash_per_session, limits.max_answer_tokens, Penalties(**penalties))
    if len(q.question_ids) > limits.max_question_tokens:
        raise InvalidRequest(f"question of {len(q.question_ids)} tokens exceeds the limit of "
                             f"{limits.max_question_tokens} tokens", code=Code.QUESTION_TOO_LONG)
    session.flash.questions[q.flash_id] = q
    return q


def unregister(core: EngineCore, session_id: str, flash_id: str) -> dict:
    session = core.live(session_id)
    q = session.flash.questions.pop(flash_id, None)
    if q is None:
        raise EngineError(f"no flash question {flash_id!r} on session {session_id}", code=Code.FLASH_NOT_FOUND)
    return q.state(session.data_version)


def adopt(session: Session, questions: dict, next_id: int) -> None:
    """A handed-off session's flash questions, as exported (sessions/handoff.py)."""
    session.flash.questions, session.flash.next_id = questions, next_id


def restore(core: EngineCore, session: Session, items: list[dict], next_id: int) -> None:
    """A checkpoint's flash questions, with their answers and marks (sessions/checkpoint.py)."""
    session.flash.next_id = next_id
    session.flash.questions = {}
    for item in items:
        args = {k: v for k, v in item["args"].items() if v is not None}
        q = add_question(core, session, **args)
        if item["answer"] is not None:
            q.answer = FlashAnswer(**item["answer"])
        q.candidate, q.candidate_count = item["candidate"], item["candidate_count"]
        q.evaluated_version, q.evaluations, q.stale = item["evaluated_version"], item["evaluations"], item["stale"]
