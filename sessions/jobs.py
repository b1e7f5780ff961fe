"""Units of model work, the lanes they wait in, and the input commands that make them.

A job says how many tokens it could use next (`want`, no side effects), what it runs with the
tokens it is given (`plan`) and what it does with the logits (`complete`), until `done`; then
`finish` says what finishing means (resolve the caller's future, push answers, ...). The engine
packs the plans of many jobs into one forward.

Every job runs in a *lane* of its session. `beside = False`: the session's FIFO, in submission
order (appends, revises, questions: each may depend on everything before it). `beside = True`:
next to the FIFO, one job per kind (flash evaluations and dual-mode reasoning units: they never
write the reading cache, so they need not wait for input). A job's own flags state its rules:
`writes_input` (flash waits while such a job is queued), `reads_notes` (a dual reasoning unit
waits while such a job runs), `joins` (an append that finishes in a step takes the next append of
its FIFO into the same step), `background` (idle-time work, never aged above questions).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

from .errors import Code, ContextOverflow, InputEnded, InvalidRequest, SessionClosed
from .futures import settle
from .multimodal import encode_frames
from .room import Room
from .runner import SeqStep
from .session import AppendResult, Session, cut_tail, mark_ended, note_segment, queue_tokens
from .window import check_input, make_room, set_window, take_evicted, unbound

if TYPE_CHECKING:
    from .engine import EngineCore

UNBOUNDED = 1 << 30  # `want` of a job that can use any budget (it learns its size when it starts)


class Priority(IntEnum):
    """Lower runs first (DESIGN: interactive query > action > ingest > thinking > flash)."""

    QUERY = 0
    ACTION = 1
    INGEST = 2
    THINKING = 3
    FLASH = 4


class Job:
    """Base: `want` -> `plan` -> forward -> `complete`, until `done`; then `finish`. Most jobs run
    one sequence a step (`plan_one`/`complete_one`); a job may run several (`plan`/`complete_many`)."""

    priority: Priority = Priority.INGEST
    kind = "job"
    beside = False  # runs beside the session's FIFO instead of in it
    background = False  # idle-time work: aging never lifts it above interactive work
    writes_input = False  # changes what the reading cache holds (input is waiting while it is queued)
    joins = False  # the next FIFO job of the same kind may run right after it in the same step
    urgent = False  # takes the budget right after interactive work (a stale flash evaluation)

    def __init__(self, session: Session) -> None:
        self.session = session
        self.done = False
        self.submitted_at = self.waiting_since = time.monotonic()
        self.order = 0  # arrival order, set by the lanes: FIFO within a priority
        self.future: Future | None = None  # set when submitted on behalf of a caller
        self._planned = 0
        # its share of the engine's work (`stepped`): steps it ran in, steps that ran before its first
        # while it waited, and the most tokens one of its steps carried in all
        self.submitted_step = self.steps = self.steps_waited = self.max_step_tokens = 0

    @property
    def can_join(self) -> bool:
        """Whether it may be written right after the FIFO job in front of it, in one step."""
        return False

    @property
    def begun(self) -> bool:
        """Whether it has started (it ran in a step, or wrote to a cache): a question asked over
        what has been read goes behind it, never ahead (Lanes.submit, `ahead`)."""
        return self.steps > 0

    @property
    def is_input(self) -> bool:
        """Whether it is a client's input to the session (text, a revise, a transcript, a frame)."""
        return False

    @property
    def reads_notes(self) -> bool:
        """Whether it is reading the session's thinking notes now (a reasoning unit, which may
        drop old notes, waits until no job does)."""
        return False

    def want(self) -> int:
        """Tokens it could run in the next step (0: it finishes without a forward)."""
        return UNBOUNDED

    def room(self) -> Room | None:
        """What it needs of the session's reading cache as it starts (None: nothing, or it has
        started); the core makes it before the job plans (`window.make_room`)."""
        return None

    def ready(self, lanes: "Lanes") -> bool:
        """Whether it may run now (a FIFO head that is not ready holds its queue for a step)."""
        return True

    def plan(self, budget: int) -> list[SeqStep]:
        step = self.plan_one(budget)
        return [] if step is None else [step]

    def complete_many(self, rows: list[torch.Tensor]) -> None:
        self.complete_one(rows[0])

    def plan_one(self, budget: int) -> SeqStep | None:
        raise NotImplementedError

    def complete_one(self, logits: torch.Tensor) -> None:
        raise NotImplementedError

    def stepped(self, step: int, tokens: int) -> None:
        """It ran in engine step number `step`, which carried `tokens` tokens in all."""
        if not self.steps:
            self.steps_waited = max(0, step - 1 - self.submitted_step)
        self.steps += 1
        self.max_step_tokens = max(self.max_step_tokens, tokens)

    def abort(self) -> None:
        """Called when the job is dropped unfinished (session closed, engine error)."""

    def result(self):
        return None

    def finish(self, core: EngineCore, exc: BaseException | None = None) -> None:
        """What finishing means; the default resolves the caller's future. `core` is the engine
        core (its `stats`, its sessions); `exc` is why the job failed, if it did."""
        if exc is not None and not self.done:
            self.abort()
        if self.future is not None:
            settle(self.future, exc=exc) if exc is not None else settle(self.future, self.result())


class Lanes:
    """Each session's FIFO and the jobs running beside it. Only the engine thread uses it."""

    def __init__(self) -> None:
        self.fifo: dict[str, deque[Job]] = {}
        self.side: dict[str, dict[str, Job]] = {}
        self._order = 0

    def open(self, session_id: str) -> None:
        self.fifo[session_id] = deque()
        self.side[session_id] = {}

    def submit(self, job: Job, ahead: bool = False) -> Job:
        """Queue `job` in its session's lane: at the end of its FIFO, or with `ahead` in front of
        every FIFO job that is only waiting (the backlog: a question asked over what has been
        read). It still goes behind the job that has begun (an input half read is read to its
        end first, so nothing sees half an input) and behind the framing of a new session."""
        self._order += 1
        job.order = self._order
        sid = job.session.id
        if job.beside:
            self.side[sid][job.kind] = job
        elif ahead:
            queue = self.fifo[sid]
            at = 0
            while at < len(queue) and (queue[at].begun or (queue[at].kind == "prefill" and not queue[at].is_input)):
                at += 1
            queue.insert(at, job)
        else:
            self.fifo[sid].append(job)
        return job

    def inputs_behind(self, job: Job) -> int:
        """Inputs queued behind `job` in its session's FIFO that were submitted before it (the
        backlog a question asked over what has been read did not wait for)."""
        queue = list(self.fifo.get(job.session.id, ()))
        behind = queue[queue.index(job) + 1:] if job in queue else []
        return sum(1 for other in behind if other.is_input and other.order < job.order)

    def remove(self, job: Job) -> None:
        sid = job.session.id
        if job.beside:
            if self.side.get(sid, {}).get(job.kind) is job:
                del self.side[sid][job.kind]
            return
        queue = self.fifo.get(sid)
        if queue and queue[0] is job:
            queue.popleft()
            if queue and not queue[0].steps:
                # The next job becomes runnable only now: its age (the scheduler's aging) counts
                # from here, not from the time it spent queued behind its own session's work.
                queue[0].waiting_since = max(queue[0].waiting_since, time.monotonic())
        elif queue and job in queue:  # a follower that failed while planned beside its head
            queue.remove(job)

    def close(self, session_id: str) -> list[Job]:
        """Forget a session's lanes; returns the jobs that were waiting or running."""
        return list(self.fifo.pop(session_id, ())) + list(self.side.pop(session_id, {}).values())

    def heads(self) -> Iterator[Job]:
        """Every job that may run now: each FIFO's head (if it is ready) and every job beside a FIFO."""
        for queue in self.fifo.values():
            if queue and queue[0].ready(self):
                yield queue[0]
        for side in self.side.values():
            yield from side.values()

    def followers(self, job: Job) -> list[Job]:
        """FIFO jobs right behind `job` that may join it in one step (appends behind an append;
        in a windowed session only as far as they fit the window without an eviction)."""
        queue = self.fifo.get(job.session.id, ())
        if not job.joins or len(queue) < 2:
            return []
        window = job.session.window
        end = job.planned_end() if window is not None else 0
        out = []
        for nxt in itertools.islice(queue, 1, None):
            if end is None or not (nxt.joins and nxt.can_join):
                break
            if window is not None:
                end += len(nxt.tokens)
                if end > window.max_tokens:
                    break
            out.append(nxt)
        return out

    def running(self, session_id: str, kind: str) -> bool:
        return kind in self.side.get(session_id, {})

    def busy(self, session_id: str) -> bool:
        return bool(self.fifo.get(session_id)) or bool(self.side.get(session_id))

    def input_waiting(self, session_id: str) -> bool:
        return any(job.writes_input for job in self.fifo.get(session_id, ()))

    def notes_read(self, session_id: str) -> bool:
        jobs = list(self.fifo.get(session_id, ())) + list(self.side.get(session_id, {}).values())
        return any(job.reads_notes for job in jobs)

    def queued(self) -> int:
        return sum(len(q) for q in self.fifo.values())

    def counts(self) -> dict[str, int]:
        """Queued and running jobs by priority class, for metrics."""
        out: dict[str, int] = {}
        for job in [j for q in list(self.fifo.values()) for j in list(q)] + \
                   [j for s in list(self.side.values()) for j in list(s.values())]:
            name = job.priority.name.lower()
            out[name] = out.get(name, 0) + 1
        return out


class PrefillJob(Job):
    """Commit tokens to the session cache, at most `budget` per step (chunked prefill, so a
    long append never blocks other sessions' decoding for long)."""

    kind = "prefill"
    writes_input = True
    joins = True

    def __init__(self, session: Session, tokens: list[int], text: str | None, cache=None) -> None:
        super().__init__(session)
        self.tokens = tokens
        self.text = text  # None for the framing prefix, which is not an input
        self.cache = session.cache if cache is None else cache  # or a shared prefix being filled
        self.pos = 0
        self.ran = 0  # tokens run through the model
        self.start: int | None = 0 if cache is not None else None
        self.chunk = None
        self.counted = cache is None  # a shared prefix fill does not add to the session's tokens
        self.evict_first: list[int] = []  # replay: the inputs the original evicted before this one
        if self.counted:
            queue_tokens(session, len(tokens))

    @property
    def can_join(self) -> bool:
        """Not started yet, so it can be written right after the job in front of it (replay's
        evictions run as a job starts: such a job starts on its own)."""
        return self.start is None and not self.evict_first

    @property
    def begun(self) -> bool:
        return self.start is not None or self.steps > 0

    @property
    def is_input(self) -> bool:
        return self.text is not None  # None: the framing of a new session, not an input

    def ready(self, lanes: Lanes) -> bool:
        """An input whose start will evict waits while an urgent (stale) flash evaluation of its
        session runs: the eviction would cancel it, and a feed that evicts often would keep a
        stale answer from ever catching up. The evaluation is short; then the input goes."""
        if self.start is not None or self.session.window is None or self.planned_end() is not None:
            return True
        evaluation = lanes.side.get(self.session.id, {}).get("flash")
        return evaluation is None or not evaluation.urgent

    def planned_end(self) -> int | None:
        """Where its last token will go if nothing is evicted first (None: it will evict, or
        it is not an input of the session's cache)."""
        if self.start is not None:
            return self.start + len(self.tokens)
        end = self.cache.length + len(self.tokens)
        window = self.session.window
        if self.evict_first or (window is not None and end > window.max_tokens):
            return None
        return end

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def want(self) -> int:
        return len(self.tokens) - self.pos

    def room(self) -> Room | None:
        """An input to a windowed session evicts old inputs first if it would not fit (replay:
        exactly the inputs the original evicted)."""
        if self.start is not None or self.text is None:
            return None
        return Room(len(self.tokens), tuple(self.evict_first))

    def begin(self, after: "PrefillJob | None" = None) -> None:
        """Runs once, when the job first reaches the head of its session's queue (after its room
        was made), or joins the job `after` it in one step: then it is written right after that
        one's tokens."""
        self.start = self.cache.length if after is None else after.end

    def plan_one(self, budget: int) -> SeqStep | None:
        if self.start is None:
            self.begin()
        n = min(budget, len(self.tokens) - self.pos)
        if n <= 0:  # nothing to run (an empty revise): finish without a forward
            self.finish_input()
            return None
        self._planned = n
        return SeqStep(self.cache, self.start + self.pos, self.tokens[self.pos:self.pos + n],
                       pos0=self.session.position_offset, head=False)

    def complete_one(self, logits: torch.Tensor) -> None:
        self.pos += self._planned
        self.ran += self._planned
        self.cache.commit(self.start + self.pos)
        if self.counted:
            queue_tokens(self.session, -self._planned)
        self.session.last_logits = logits
        if self.pos >= len(self.tokens):
            self.finish_input()

    def finish_input(self) -> None:
        if self.text is not None:
            self.chunk = self.session.record(self.text, self.start, self.tokens)
        self.done = True

    def abort(self) -> None:
        if self.counted:
            queue_tokens(self.session, self.pos - len(self.tokens))

    def result(self) -> AppendResult | None:
        if self.chunk is None:
            return None
        s = self.session
        return AppendResult(s.id, self.chunk.seq, len(self.tokens), s.cache.length, s.data_version,
                            time.monotonic() - self.submitted_at, evicted_seqs=take_evicted(s))

    def finish(self, core: EngineCore, exc: BaseException | None = None) -> None:
        if exc is None and self.text is not None:
            core.stats.tokens_ingested += self.ran
        super().finish(core, exc)


class ReviseJob(PrefillJob):
    """Replace the tail of the input (chunks from `from_seq` on, default the last one) with new
    text: crop the cache to the longest common token prefix of old and new tail, prefill the
    rest. The tail is resolved when the job runs, after every input queued before it."""

    kind = "revise"
    joins = False

    def __init__(self, session: Session, text: str, from_seq: int | None, tokens: list[int] | None = None) -> None:
        super().__init__(session, session.tokenize(text) if tokens is None else tokens, text)
        self.from_seq = from_seq
        self.kept = 0
        self.replaced: list[int] = []

    def _tail(self) -> int:
        """Index of the first chunk it replaces (refused, before any eviction, if a frame is in it)."""
        s = self.session
        first = s.tail_from(self.from_seq)
        if any(c.extent is not None for c in s.chunks[first:]):
            raise InvalidRequest(f"session {s.id}: a revise cannot replace a frame (revise text after the last frame)")
        return first

    def room(self) -> Room | None:
        """A longer tail evicts older input first (never the tail itself)."""
        if self.start is not None:
            return None
        return Room(len(self.tokens), tuple(self.evict_first), replace_from=self._tail())

    def begin(self, after: PrefillJob | None = None) -> None:
        s = self.session
        first = self._tail()
        bound = s.context_window if s.window is None else s.window.max_tokens
        tail = s.chunks[first:]
        base = tail[0].start
        if base + len(self.tokens) > bound:
            raise ContextOverflow(
                f"revised input of {len(self.tokens)} tokens would bring session {s.id} to "
                f"{base + len(self.tokens)} tokens; the {'context window' if s.window is None else 'window'} "
                f"is {bound} tokens")
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
        self.replaced = [c.seq for c in cut_tail(s, first, base + self.kept)]  # forks over it are stale
        self.start, self.pos = base, self.kept
        queue_tokens(s, -self.kept)

    def finish_input(self) -> None:
        s = self.session
        if self.tokens:
            self.chunk = s.record(self.text, self.start, self.tokens)
        else:  # revised to nothing: the tail is deleted
            s.new_version(time.time())
        self.done = True

    def result(self) -> AppendResult:
        s = self.session
        seq = self.chunk.seq if self.chunk else 0
        return AppendResult(s.id, seq, len(self.tokens), s.cache.length, s.data_version,
                            time.monotonic() - self.submitted_at, self.kept, self.replaced,
                            evicted_seqs=take_evicted(s))


class SegmentJob(ReviseJob):
    """One transcript of an audio segment (streaming ASR: partials, then the final). The first
    transcript of a segment is appended; a later one revises the segment's chunk while that is
    still the session's last input, and is appended after the newer input otherwise (the partial
    stays, labelled partial). Decided when the job runs, after everything queued before it, so the
    caller never waits for one transcript before sending the next. An empty final deletes its
    segment's partial; an empty transcript with nothing to revise writes nothing."""

    kind = "segment"

    def __init__(self, session: Session, segment: str, text: str, final: bool) -> None:
        super().__init__(session, text, None)
        self.segment, self.final = segment, final
        self.revising = False
        self.frozen = False
        self.decided = False

    def _decide(self) -> None:
        """Revise or append: decided once, as it starts (before its room is made)."""
        if self.decided:
            return
        s = self.session
        seq = s.segments.get(self.segment)
        self.revising = seq is not None and bool(s.chunks) and s.chunks[-1].seq == seq
        self.frozen = seq is not None and not self.revising
        if self.revising:
            self.from_seq = seq
        self.decided = True

    def room(self) -> Room | None:
        if self.start is not None:
            return None
        self._decide()
        return super().room() if self.revising else PrefillJob.room(self)

    def begin(self, after: PrefillJob | None = None) -> None:
        self._decide()
        if self.revising:
            super().begin(after)
        else:
            PrefillJob.begin(self, after)
            self.kept, self.replaced = 0, []

    def finish_input(self) -> None:
        s = self.session
        if self.revising:
            super().finish_input()
        elif self.tokens:
            self.chunk = s.record(self.text, self.start, self.tokens)
        self.done = True
        note_segment(s, self.segment, None if self.final or self.chunk is None else self.chunk.seq)

    def result(self) -> AppendResult | None:
        if not self.revising and self.chunk is None:
            return None  # nothing was written
        out = super().result()
        out.frozen_partial = self.frozen
        return out


class FrameJob(PrefillJob):
    """A frame into the reading cache of a session on a VL model: first the vision tower (the
    frame comes patched; `needs_vision` until its embeddings exist: the core runs the tower for
    every such job of a step in one call, `multimodal.vision_step`), then a prefill of the
    frame's embeddings (`multimodal.FrameInput`) at M-RoPE positions that continue from the
    session's next position, chunked and batched like text. It starts on its own (never joins
    another input in a step: the next position moves by the frame's extent when it is in)."""

    kind = "frame"
    joins = False

    def __init__(self, session: Session, frame, text: str) -> None:
        super().__init__(session, frame.ids, text)
        self.frame = frame
        self.mpos: torch.Tensor | None = None

    @property
    def can_join(self) -> bool:
        return False

    @property
    def needs_vision(self) -> bool:
        """The frame's embeddings are not made yet (the vision tower is this job's first part)."""
        return self.frame.embeds is None

    def room(self) -> Room | None:
        """A vision bound evicts old frames first (replay: exactly the inputs the original evicted)."""
        return None if self.start is not None else Room(len(self.tokens), tuple(self.evict_first), frame=True)

    def begin(self, after: "PrefillJob | None" = None) -> None:
        super().begin(None)
        self.mpos = self.frame.rel + self.session.next_position  # after any eviction it made

    def plan_one(self, budget: int) -> SeqStep | None:
        if self.needs_vision:  # not encoded with the step's other frames: on its own
            encode_frames(self.session.runner.vl, [self.frame])
        if self.start is None:
            self.begin()
        n = min(budget, len(self.tokens) - self.pos)
        self._planned = n
        lo, hi = self.pos, self.pos + n
        return SeqStep(self.cache, self.start + lo, self.tokens[lo:hi], embeds=self.frame.embeds[lo:hi],
                       mpos=self.mpos[:, lo:hi], head=False)

    def finish_input(self) -> None:
        self.chunk = self.session.record(self.text, self.start, self.tokens, frame=self.frame)
        self.done = True


# ---- the input commands (run on the engine thread; `core` is the EngineCore) ----------------


def append(core: EngineCore, session_id: str, text: str, evict_first: list[int] | None = None,
           tokens: list[int] | None = None) -> Future:
    """Resolves to an AppendResult once the text's tokens are in the cache. The text is
    tokenized on its own (never with earlier text): `tokens`, by the tokenizer's workers before
    the engine thread (`Engine.append`), else here. Input that can never fit is refused now; a
    windowed session evicts old inputs when this one starts, if it must (`evict_first`: replay
    evicts exactly the inputs the original session evicted before this one)."""
    session = core.writable(session_id)
    if tokens is None:
        tokens = core.runner.tokenize(text)
        core.stats.tokenized_on_engine += 1
    if not tokens:
        raise InvalidRequest("text is empty")
    check_input(session, len(tokens))
    job = PrefillJob(session, tokens, text)
    job.evict_first = list(evict_first or ())
    return core.submit(job)


def append_frame(core: EngineCore, session_id: str, frame, text: str, evict_first: list[int] | None = None) -> Future:
    """Read one frame (a `multimodal.FrameInput`, built from the engine's own VL model) into the
    session's cache; `text` names it in the log. Resolves to an AppendResult like `append`."""
    session = core.writable(session_id)
    if core.runner.vl is None:
        raise InvalidRequest(f"the engine's model {core.runner.name} reads no images (serve a vision-language "
                             "model to put frames into a session's cache)", code=Code.UNSUPPORTED_MEDIA)
    check_input(session, len(frame.ids))
    job = FrameJob(session, frame, text)
    job.evict_first = list(evict_first or ())
    return core.submit(job)


def revise(core: EngineCore, session_id: str, text: str, from_seq: int | None = None,
           evict_first: list[int] | None = None, tokens: list[int] | None = None) -> Future:
    """Replace the input from `from_seq` on (default: the last input); resolves to an AppendResult.
    `tokens`: the text tokenized before the engine thread, as for `append`."""
    session = core.writable(session_id)
    if tokens is None:
        core.stats.tokenized_on_engine += 1
    job = ReviseJob(session, text, from_seq, tokens)
    job.evict_first = list(evict_first or ())
    return core.submit(job)


def transcribe(core: EngineCore, session_id: str, segment: str, text: str, final: bool) -> Future:
    """Write one transcript of an audio segment (see SegmentJob); resolves to an AppendResult,
    or None when there was nothing to write."""
    session = core.writable(session_id)
    tokens = len(session.tokenize(text))
    if tokens:
        check_input(session, tokens)
    return core.submit(SegmentJob(session, segment, text, final))


def end_input(core: EngineCore, session_id: str) -> dict:
    """No more input. With thinking on, a final deliberation continues the notes."""
    session = core.writable(session_id)
    mark_ended(session)
    if session.thinking is not None:
        session.thinking.input_ended()
    return session.state()


def writable(session: Session) -> Session:
    if session.ended:
        raise InputEnded(f"session {session.id} got input.end; it takes no more input")
    return session


def closed_error(session_id: str) -> SessionClosed:
    return SessionClosed(f"session {session_id} was closed")


def configure_window(core: EngineCore, session_id: str, max_tokens: int | None = None, keep_tokens: int = 0,
                     sink_inputs: int = 1, unbounded: bool = False, vision_tokens: int = 0) -> dict | Future:
    """Bound the session's reading cache (sinks + recent inputs, `window.set_window`), or with
    `unbounded` lift the bound (input past the model's window is then refused with
    `context_overflow`). A cache already past the new bound is evicted down to it at the
    ResizeJob's turn. Returns the session state (or a future of it)."""
    session = core.live(session_id)
    if unbounded:
        unbound(session)
        return session.state()
    if max_tokens is None:
        raise InvalidRequest("window needs 'max_tokens' (or null for an unbounded session)", param="max_tokens")
    set_window(session, max_tokens, keep_tokens, sink_inputs, vision_tokens=vision_tokens)
    return core.submit(ResizeJob(session))  # in the FIFO: after the input queued before it


class ResizeJob(Job):
    """A new bound takes effect at its turn in the session's FIFO: a cache past it is evicted
    down to `keep_tokens` then (its room, so a replay that queues the same records evicts the
    same inputs). Runs no forward; resolves to the session state."""

    kind = "resize"

    def want(self) -> int:
        return 0

    def room(self) -> Room | None:
        return None if self.done else Room(bound=True)

    def plan(self, budget: int) -> list:
        self.done = True
        return []

    def result(self) -> dict:
        return self.session.state()


def drive(runner, job: Job, budget: int = 512):
    """Run one job to completion on the calling thread (tests, benchmarks): its room is made as
    the engine's step makes it, then it plans and runs."""
    while not job.done:
        make_room(job.session, job.room())
        steps = job.plan(budget)
        if steps:
            job.complete_many(runner.forward(steps, logits="last"))
    return job.result()
