"""Session: the unit of state. A live reading cache, the log of accepted input, clocks."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .errors import ContextOverflow, InvalidRequest
from .framing import Framing
from .kvcache import SessionCache
from .pool import PagedCache
from .runner import ModelRunner, resolve_logits

if TYPE_CHECKING:
    from .engine import EngineCore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Chunk:
    """One accepted input: its text, where its tokens sit in the cache, and when it came."""

    seq: int  # 0 for reasoning written into the reading cache (interleaved thinking)
    ts: float
    text: str
    start: int
    tokens: list[int]
    digest: str
    extent: int | None = None  # positions it advances, when not one per token (a frame on a VL model)
    media_s: float | None = None  # a frame's media time

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def span(self) -> int:
        """How far it advances the session's next position."""
        return len(self.tokens) if self.extent is None else self.extent


@dataclass(slots=True)
class AppendResult:
    session_id: str
    seq: int
    tokens: int
    total_tokens: int
    data_version: int
    lag_s: float
    kept_tokens: int | None = None  # revise: tokens of the replaced tail reused from the cache
    replaced_seqs: list[int] = field(default_factory=list)
    frozen_partial: bool = False  # a transcript appended because its segment's partial is no longer last
    evicted_seqs: list[int] = field(default_factory=list)  # inputs the window evicted since the last input


STALENESS_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


class Histogram:
    """Cumulative-bucket histogram (Prometheus style) of flash staleness in seconds."""

    __slots__ = ("counts", "count", "sum")

    def __init__(self) -> None:
        self.counts = [0] * (len(STALENESS_BUCKETS_S) + 1)  # the last bucket is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(STALENESS_BUCKETS_S, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, total = [], 0
        for bound, n in zip([*map(str, STALENESS_BUCKETS_S), "+Inf"], self.counts):
            total += n
            out.append((bound, total))
        return out


class FlashBoard:
    """A session's flash state; only sessions/flash.py assigns its fields. Defined here, beside
    `Session`, which creates one (flash.py imports this module)."""

    __slots__ = ("questions", "next_id", "staleness")

    def __init__(self) -> None:
        self.questions: dict = {}  # flash_id -> FlashQuestion, in registration order
        self.next_id = 1  # the number of the next default id (`f<n>`)
        self.staleness = Histogram()  # seconds from accepted data to its evaluated answer


class ActionsState:
    """A session's actions state; only sessions/actions.py assigns its fields. Defined here,
    beside `Session`, which creates one (actions.py imports this module)."""

    __slots__ = ("loop", "rules", "next_rule_id")

    def __init__(self) -> None:
        self.loop = None  # ActionLoop, while a policy runs
        self.rules: dict = {}  # rule_id -> FlashRule
        self.next_rule_id = 0


def normalize(text: str) -> str:
    """What counts as the same answer: case, surrounding punctuation and spacing ignored."""
    return re.sub(r"\s+", " ", text).strip().strip(".!?,;:").strip().lower()


def json_object(text: str) -> dict | None:
    """The input as a JSON object, if it is one (observations for action policies)."""
    text = text.strip()
    if not text.startswith("{"):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Session:
    """State of one session. Only the engine thread mutates it."""

    def __init__(self, session_id: str, runner: ModelRunner, system_prompt: str | None = None,
                 max_tokens: int | None = None, pool=None, share_prefix: bool = True) -> None:
        self.id = session_id
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.framing = Framing.for_tokenizer(self.tokenizer, system_prompt)
        self.system_prompt = system_prompt
        self.prefix_ids = self.tokenize(self.framing.prefix)
        if pool is None:  # a private cache (tests, tools)
            self.cache: SessionCache = runner.new_cache(max_tokens)
        else:  # blocks of the engine's pool; the system prompt's full blocks shared
            shared = pool.prefix_for(self.prefix_ids) if share_prefix else None
            self.cache = PagedCache(pool, max_tokens or runner.context_window, shared)
        self.last_active = time.monotonic()
        self.chunks: list[Chunk] = []
        self.data_version = 0
        self.next_seq = 1
        self.pending_tokens = 0  # tokens queued for append but not yet in the cache
        self.position_offset = 0  # next position - cache length (frames on a VL model: sessions/multimodal.py)
        self.frames = 0  # frames read into the cache (VL model)
        self.media_s: float | None = None  # media time of the newest frame read
        self.ended = False
        self.closed = False
        self.created_at = time.time()
        self.last_input_at: float | None = None
        self._last_logits = None  # logits after the newest committed token (maybe `DeferredLogits`)
        self.queries_answered = 0
        self.crop_epoch = 0  # bumped when tokens already in the cache are replaced (revise)
        self.flash = FlashBoard()  # questions, next id, staleness (sessions/flash.py)
        self.listeners: list = []  # callables (event_type, payload) on the engine thread
        self.thinking = None  # ThinkingState, when a thinking mode is set
        self.actions = ActionsState()  # the running policy, rules, next rule id (sessions/actions.py)
        self.window = None  # TextWindow, when the cache is bounded (sessions/window.py)
        self.segments: dict[str, int] = {}  # audio segment -> seq of its chunk, while a partial may be revised
        self.version_times: deque[tuple[int, float]] = deque(maxlen=1024)  # (data_version, when it was reached)
        self.owner = session_id  # whose work it is for the fair share: the API key, else the client
        self.idle_turn = "flash"  # whose turn it is when a reasoning unit and a flash evaluation are both due
        self.log = logging.LoggerAdapter(log, {"session": session_id})

    @property
    def context_window(self) -> int:
        return self.cache.max_tokens

    @property
    def total_tokens(self) -> int:
        return self.cache.length

    @property
    def next_position(self) -> int:
        """The (M-RoPE t) position of the next token after the reading cache."""
        return self.cache.length + self.position_offset

    def tokenize(self, text: str) -> list[int]:
        """Tokenize one piece on its own (ModelRunner.tokenize)."""
        return self.runner.tokenize(text)

    def context_ids(self) -> list[int]:
        """The token ids the reading cache holds, from the log (what a replay would prefill)."""
        ids = list(self.prefix_ids)
        for chunk in self.chunks:
            ids.extend(chunk.tokens)
        return ids

    def question_ids(self, question: str) -> list[int]:
        return self.tokenize(self.framing.question_text(question))

    def check_room(self, new_tokens: int, what: str = "input") -> None:
        total = self.cache.length + self.pending_tokens + new_tokens
        if total > self.context_window:
            raise ContextOverflow(
                f"{what} of {new_tokens} tokens would bring session {self.id} to {total} tokens; "
                f"the context window is {self.context_window} tokens "
                f"({self.cache.length + self.pending_tokens} used)")

    def new_version(self, ts: float) -> None:
        self.data_version += 1
        self.last_input_at = ts
        self.version_times.append((self.data_version, ts))

    def staleness_since(self, version: int) -> float:
        """Seconds since the data moved past `version` (0 if it has not)."""
        if version >= self.data_version or not self.version_times:
            return 0.0
        first = self.version_times[0][1]
        for v, ts in reversed(self.version_times):  # O(versions behind)
            if v <= version:
                break
            first = ts
        return max(0.0, time.time() - first)

    def record(self, text: str, start: int, tokens: list[int], frame=None) -> Chunk:
        """Log an input now in the cache (`frame`: the FrameInput it was read from)."""
        digest = hashlib.sha256(text.encode()).hexdigest()[:16] if frame is None else frame.digest
        chunk = Chunk(self.next_seq, time.time(), text, start, tokens, digest)
        if frame is not None:
            chunk.extent, chunk.media_s = frame.extent, frame.media_s
            self.position_offset += frame.extent - len(tokens)
            self.frames += 1
            self.media_s = frame.media_s if frame.media_s is not None else self.media_s
        self.next_seq += 1
        self.chunks.append(chunk)
        self.new_version(chunk.ts)
        if self.actions.loop is not None:  # JSON inputs are observations for the action policy
            observation = json_object(text)
            if observation is not None:
                self.actions.loop.observe(observation, chunk.ts)
        return chunk

    def record_reasoning(self, start: int, tokens: list[int], text: str) -> None:
        """Reasoning written into the reading cache (interleaved mode): logged in place, so the
        log still replays to the same cache; it is not input and bumps no version."""
        self.chunks.append(Chunk(0, time.time(), text, start, tokens, hashlib.sha256(text.encode()).hexdigest()[:16]))

    def tail_from(self, from_seq: int | None) -> int:
        """Index in `chunks` of the first chunk a revise replaces (default: the last one)."""
        if self.thinking is not None and any(c.seq == 0 for c in self.chunks):
            raise InvalidRequest(f"session {self.id} holds interleaved reasoning; revise needs thinking mode "
                                 "'off' or 'dual' from the start")
        if not self.chunks:
            raise InvalidRequest(f"session {self.id} has no input to revise")
        if from_seq is None:
            return len(self.chunks) - 1
        for i, chunk in enumerate(self.chunks):
            if chunk.seq == from_seq:
                return i
        known = ", ".join(str(c.seq) for c in self.chunks[-5:])
        raise InvalidRequest(f"from_seq {from_seq} is not a live input of session {self.id} (latest: {known})")

    @property
    def last_logits(self):
        """Logits after the newest committed token (None when unknown). A prefill leaves them
        deferred: the output head runs here, on first read."""
        self._last_logits = resolve_logits(self._last_logits)
        return self._last_logits

    @last_logits.setter
    def last_logits(self, logits) -> None:
        self._last_logits = logits

    def state(self) -> dict:
        return {
            "session_id": self.id,
            "data_version": self.data_version,
            "tokens": self.cache.length,
            "prefix_tokens": len(self.prefix_ids),
            "context_window": self.context_window,
            "cache_bytes": self.cache.nbytes,
            "shared_prefix_tokens": self.cache.prefix_len,
            "parked": self.cache.parked is not None,
            "kv_bytes_per_token": self.cache.shape.bytes_per_token,
            "attention_backend": self.runner.attention_backend,
            "weights": self.runner.weights.format,
            "inputs": len(self.chunks),
            "frames": self.frames,
            "next_position": self.next_position,
            "last_seq": self.chunks[-1].seq if self.chunks else 0,
            "unread_tokens": self.pending_tokens,  # accepted input not read yet: the backlog
            "ended": self.ended,
            "closed": self.closed,
            "created_at": self.created_at,
            "last_input_at": self.last_input_at,
            "queries_answered": self.queries_answered,
            "flash": [q.state(self.data_version) for q in self.flash.questions.values()],
            "thinking": self.thinking.public() if self.thinking is not None else {"mode": "off"},
            "rules": [{"rule_id": r.rule_id, "flash_id": r.flash_id, "pattern": r.pattern, "fired": r.fired}
                      for r in self.actions.rules.values()],
            "window": self.window.public() if self.window is not None else None,
            "actions": {"running": True, "mode": loop.controller.mode, "last_seq": loop.controller.seq,
                        "errors": loop.errors} if (loop := self.actions.loop) is not None else {"running": False},
        }

    def notify(self, event: str, payload: dict) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, payload)
            except Exception:  # a broken subscriber never breaks the session
                self.log.exception("listener failed on %s", event)


# ---- the log's own changes (the only writers of the log's fields outside `Session`) -------------
# Who assigns a Session field: this module the input log, the reading and the clocks (`chunks`,
# `next_seq`, `data_version`, `position_offset`, `crop_epoch`, `segments`, `pending_tokens`,
# `ended`, ...); engine.py the lifecycle (`closed`, `last_active`, `owner`); each feature its own
# state: window.py `window`, thinking.py `thinking`, flash.py `flash` (a FlashBoard: its fields
# too), actions.py `actions` (an ActionsState: its fields too), query.py `queries_answered`,
# background.py `idle_turn`.


def queue_tokens(session: Session, n: int) -> None:
    """`n` tokens accepted but not in the cache yet (negative: read, or dropped)."""
    session.pending_tokens += n


def mark_ended(session: Session) -> None:
    session.ended = True


def note_segment(session: Session, segment: str, seq: int | None) -> None:
    """An audio segment's partial is now input `seq` (it may still be revised); None: the segment
    is final (or wrote nothing) and is forgotten."""
    if seq is None:
        session.segments.pop(segment, None)
    else:
        session.segments[segment] = seq


def cut_tail(session: Session, first: int, keep: int) -> list[Chunk]:
    """A revise: forget `chunks[first:]` and crop the cache to `keep` tokens; forks reading the
    old tail (flash evaluations) are now stale. Returns the chunks cut."""
    tail = session.chunks[first:]
    del session.chunks[first:]
    session.cache.crop(keep)
    session.crop_epoch += 1
    return tail


def drop_inputs(session: Session, first: int, drop: int, turn: int) -> list[int]:
    """The window removed the K/V of `chunks[first:drop]` (they took `turn` positions): forget
    them, move the later chunks down, and mark forks over the old positions stale. Returns the
    evicted input seqs."""
    gone = session.chunks[first:drop]
    shift = gone[-1].end - gone[0].start
    session.position_offset += shift - turn
    del session.chunks[first:drop]
    for chunk in session.chunks[first:]:
        chunk.start -= shift
    session.crop_epoch += 1  # forks reading the old positions (flash, dual units) are now stale
    seqs = [c.seq for c in gone if c.seq]
    if session.segments:
        session.segments = {k: v for k, v in session.segments.items() if v not in seqs}
    return seqs


RESTORED = ("data_version", "next_seq", "position_offset", "frames", "media_s", "ended", "crop_epoch")


def restore_log(session: Session, state: dict, logits) -> None:
    """A checkpoint's log and clocks back into a session just created (sessions/checkpoint.py)."""
    session.chunks = [Chunk(**c) for c in state["chunks"]]
    for name in RESTORED:
        setattr(session, name, state[name])
    session.segments = dict(state["segments"])
    if session.chunks:
        session.last_input_at = session.chunks[-1].ts
    session.last_logits = logits


def adopt(session: Session, fields: dict, logits) -> None:
    """A handed-off session's fields, all at once, into a session just created (sessions/handoff.py)."""
    for name, value in fields.items():
        setattr(session, name, value)
    if logits is not None:
        session.last_logits = logits


# ---- commands (run on the engine thread; `core` is the EngineCore) -----------------------------


def add_listener(core: EngineCore, session_id: str, listener) -> None:
    """`listener(event_type, payload)` is called on the engine thread for session events
    (`flash.updated`, `reasoning.*`, `action.*`, and `flash.evaluated` for an evaluation that
    changed no answer, which is not sent to clients); it must not block."""
    core.live(session_id).listeners.append(listener)


def remove_listener(core: EngineCore, session_id: str, listener) -> None:
    session = core.sessions.get(session_id)
    if session is not None and listener in session.listeners:
        session.listeners.remove(listener)
