"""Thinking while reading: reasoning units written while input still streams.

Modes (per session):
- `off`: no reasoning.
- `interleaved`: one cache. A unit closes the data turn, asks for notes, decodes them into the
  reading cache and reopens the data turn, so input and reasoning sit in arrival order (the
  baseline of the published work).
- `dual`: a reading cache and a thinking cache. The reading cache is prefilled as input
  arrives and never sees reasoning. A unit's tokens attend to `reading[0:visible)` plus all
  earlier reasoning, where `visible` is the reading length when the unit starts; written
  reasoning is frozen. The thinking stream has its own positions: `positions="after"` (stock
  models) places each token after the input it can see (`visible + t`, monotone because
  `visible` only grows; on a vision-language model `visible` is the reading's next position,
  which a frame puts below its length); `positions="group"` (checkpoints trained for streaming) uses
  `offset + t`.

A unit runs after input arrives (each chunk, or every `every_tokens` new tokens), with a
token budget and a stop rule (sentence end, newline, or the budget alone), and is skipped when
nothing new arrived. `input.end` triggers a final deliberation of `final_tokens` that continues
the notes. Questions in dual mode see reading + thinking, so the answer builds on the notes.

Notes do not repeat themselves. In dual mode every unit after the first is its own turn about
the input that arrived since the previous note: its prompt names those inputs' seqs and quotes
their tokens (the tail of at most `quote_tokens`, copied from the reading cache's chunks, never
re-tokenized), so a note is about fresh data instead of a copy of the notes above it. Decoding
subtracts penalties (`presence_penalty`, `frequency_penalty`, `repetition_penalty`, as on
questions) counted over the tokens of the earlier notes (not the unit's own, so the first note
is plain greedy). A finished dual note equal to an earlier one after whitespace normalisation is
refused (a blank one, only whitespace, is kept: it states nothing): its tokens are cropped from
the thinking cache (later units and answers never read it), `reasoning.done` says
`repeated: true` (with the tokens it wrote), and `repeated_units` counts it. All of it depends
only on the session's inputs, so replaying the same inputs on the same schedule rebuilds the same
notes; the reading cache is never written.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .detok import TextStream
from .errors import EngineError, InvalidRequest
from .forks import fork_view
from .jobs import UNBOUNDED, Job, Lanes, Priority
from .kvcache import KVCache, own_slots
from .room import Room
from .rope import rotate_keys
from .runner import SeqStep
from .sampling import Penalties, greedy
from .session import Session

if TYPE_CHECKING:
    from .engine import EngineCore

log = logging.getLogger(__name__)

MODES = ("off", "interleaved", "dual")
STOPS = ("sentence", "newline", "budget")
POSITIONS = ("after", "group")
DEFAULT_PROMPT = "Read what has arrived so far and write brief notes: key facts, names, numbers, changes."
SENTENCE_ENDS = (".", "!", "?")
PENALTY_NOTES = 64  # penalties count the tokens of at most this many earlier notes
REMEMBERED_NOTES = 1024  # notes (normalized) a new note must differ from, dropped ones included


def ends_sentence(text: str) -> bool:
    """Whether `text` ends a sentence: '.', '!' or '?' at its end (trailing whitespace aside),
    except a '.' right after a digit, which may be a decimal point ('temp=19.'): that one ends a
    sentence only once whitespace follows it ('... was 19. ')."""
    body = text.rstrip()
    if not body.endswith(SENTENCE_ENDS):
        return False
    if body.endswith(".") and len(body) > 1 and body[-2].isdigit():
        return len(body) < len(text)
    return True


def normalize_note(text: str) -> str:
    """A note as compared for repeats: whitespace runs collapsed, ends stripped."""
    return " ".join(text.split())


@dataclass(slots=True)
class ThinkingConfig:
    mode: str = "off"
    every_tokens: int = 0  # 0: a unit after every input chunk; N: once N new input tokens arrived
    unit_tokens: int = 32  # budget of one unit
    stop: str = "sentence"
    final_tokens: int = 64  # budget of the final deliberation at input.end
    max_tokens: int | None = None  # bound on the thinking cache (dual; default min(1024, window / 4))
    positions: str = "after"
    offset: int = 0  # first position of the thinking stream with positions="group"
    question: str | None = None  # a question known in advance, to steer the notes
    prompt: str | None = None  # the instruction (default: DEFAULT_PROMPT)
    quote_tokens: int = 64  # dual: tokens of the new input quoted in a later unit's prompt (0: seqs only)
    repetition_penalty: float = 1.0  # penalties on the earlier notes' tokens (sampling.Penalties)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @property
    def penalties(self) -> Penalties:
        return Penalties(self.repetition_penalty, self.presence_penalty, self.frequency_penalty)

    def validate(self, context_window: int) -> None:
        if self.max_tokens is None:
            self.max_tokens = min(1024, context_window // 4)
        if self.mode not in MODES:
            raise InvalidRequest(f"thinking mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.stop not in STOPS:
            raise InvalidRequest(f"thinking stop must be one of {', '.join(STOPS)}, got {self.stop!r}")
        if self.positions not in POSITIONS:
            raise InvalidRequest(f"thinking positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        for name, lo, hi in (("unit_tokens", 1, 1024), ("final_tokens", 0, 4096), ("every_tokens", 0, 1 << 20),
                             ("max_tokens", 16, context_window), ("offset", 0, context_window),
                             ("quote_tokens", 0, 4096)):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise InvalidRequest(f"thinking {name} must be in [{lo}, {hi}], got {value}")
        try:
            self.penalties.validate()
        except InvalidRequest as exc:
            raise InvalidRequest(f"thinking {exc}", param=exc.param) from None

    def instruction(self) -> str:
        text = self.prompt or DEFAULT_PROMPT
        return f"{text} Focus on what helps answer: {self.question}" if self.question else text

    def follow_up(self) -> str:
        """What a later dual unit adds after the input it quotes (short: it is paid per unit)."""
        return f"\nFocus on what helps answer: {self.question}" if self.question else ""


@dataclass(slots=True)
class Unit:
    index: int
    seqs: tuple[int, int]  # input seqs [first, last] visible to it
    visible: int  # reading tokens it could see
    start: int  # first slot in the thinking cache (dual) or reading cache (interleaved)
    end: int = 0
    positions: tuple[int, int] = (0, 0)  # first and last position of its tokens
    text: str = ""
    final: bool = False
    started_at: float = 0.0
    done_at: float = 0.0
    visible_pos: int = 0  # the reading's next position when it started (= visible on a text model)
    ids: list[int] = field(default_factory=list)  # the note's own tokens (what later penalties count)
    repeated: bool = False  # equal to an earlier note: refused, its tokens cropped

    def public(self) -> dict:
        return {"unit": self.index, "seq_range": list(self.seqs), "visible_tokens": self.visible,
                "tokens": self.end - self.start, "positions": list(self.positions), "text": self.text,
                "final": self.final, "repeated": self.repeated}


@dataclass(slots=True)
class ThinkingState:
    config: ThinkingConfig
    cache: KVCache | None = None  # dual only
    units: list[Unit] = field(default_factory=list)
    written: int = 0  # reasoning tokens ever written (never reduced by drops)
    last_position: int = -1
    seen_tokens: int = 0  # reading length the last unit saw
    seen_seq: int = 0
    final_requested: bool = False
    final_done: bool = False
    dropped_units: int = 0
    repeated_units: int = 0  # finished notes refused as equal to an earlier one (dual)
    notes: OrderedDict[str, int] = field(default_factory=OrderedDict)  # normalized note -> unit index

    @property
    def tokens(self) -> int:
        return self.cache.length if self.cache is not None else sum(u.end - u.start for u in self.units)

    def public(self) -> dict:
        c = self.config
        return {"mode": c.mode, "every_tokens": c.every_tokens, "unit_tokens": c.unit_tokens, "stop": c.stop,
                "final_tokens": c.final_tokens, "max_tokens": c.max_tokens, "positions": c.positions,
                "quote_tokens": c.quote_tokens, "repetition_penalty": c.repetition_penalty,
                "presence_penalty": c.presence_penalty, "frequency_penalty": c.frequency_penalty,
                "units": len(self.units), "dropped_units": self.dropped_units,
                "repeated_units": self.repeated_units, "thinking_tokens": self.tokens,
                "visible_tokens": self.seen_tokens, "final_done": self.final_done,
                "recent": [u.public() for u in self.units[-3:]]}

    def input_ended(self) -> None:
        """input.end: with thinking on, a final deliberation continues the notes."""
        if self.config.mode != "off" and self.config.final_tokens:
            self.final_requested = True

    def release(self) -> None:
        """The session closed: its dual notes' cache goes."""
        self.cache = None

    def reanchor(self, gone: list, inv_freq: torch.Tensor) -> None:
        """The window evicted the chunks `gone` (sessions/window.py). The notes of a dual thinking
        cache sit after the reading positions they saw: a unit that saw evicted inputs moves down
        with the reading cache by what it saw of them (their tokens in the reading, their
        positions in its own: a VL frame takes fewer positions than tokens), so thinking positions
        stay bounded too. Eviction takes whole inputs, and a unit starts between inputs, so it saw
        each evicted input whole or not at all."""
        if self.cache is None:
            return

        def seen(upto: int) -> tuple[int, int]:  # tokens and positions of the evicted inputs before `upto`
            saw = [c for c in gone if c.end <= upto]
            return sum(len(c.tokens) for c in saw), sum(c.span for c in saw)

        for unit in self.units:
            tokens, turn = seen(unit.visible)
            if tokens:
                unit.visible -= tokens
                unit.visible_pos -= turn
                rotate_keys(self.cache, unit.start, unit.end - unit.start, -turn, inv_freq)
                unit.positions = (unit.positions[0] - turn, unit.positions[1] - turn)
        self.last_position = self.units[-1].positions[1] if self.units else -1
        self.seen_tokens -= seen(self.seen_tokens)[0]


def configure(session: Session, config: ThinkingConfig) -> None:
    """Set (or change) a session's thinking mode. Switching modes keeps written reasoning
    where it is; a dual thinking cache is created on first use. On a vision-language model the
    notes are text after the reading's next position (sessions/multimodal.py), as questions are."""
    config.validate(session.context_window)
    state = session.thinking
    if state is None or state.config.mode != config.mode:
        session.thinking = ThinkingState(config)
        if config.mode == "dual":
            session.thinking.cache = session.runner.new_cache(config.max_tokens + 64)
        session.thinking.seen_tokens = session.cache.length if state is None else state.seen_tokens
    else:
        state.config = config


def configure_command(core: EngineCore, session_id: str, settings: dict) -> dict:
    """Set or change the session's thinking mode and settings (ThinkingConfig fields); returns
    the session state."""
    session = core.live(session_id)
    configure(session, parse_config(settings))
    return session.state()


def parse_config(settings: dict) -> ThinkingConfig:
    try:
        return ThinkingConfig(**settings)
    except TypeError as exc:
        raise InvalidRequest(f"bad thinking settings: {exc}") from None


def next_unit(session: Session, lanes: Lanes, stop_ids: frozenset[int]) -> "ThinkJob | None":
    """The reasoning unit to start now, if one is due. Dual units run beside the session's
    queue (they only append to the thinking cache) but never while a question or flash fork is
    reading the notes, since a unit may drop old ones; interleaved units write the reading
    cache, so they queue behind the session's other work and start only when it is empty."""
    if lanes.running(session.id, "think") or session.cache.parked is not None or not due(session):
        return None
    if session.thinking.config.mode != "dual":
        return None if lanes.fifo.get(session.id) else ThinkJob(session, stop_ids)
    if lanes.notes_read(session.id):
        return None
    job = ThinkJob(session, stop_ids)
    try:
        job.begin()  # now, while no fork reads the notes: it may drop old ones
    except EngineError as exc:
        session.log.warning("reasoning unit skipped: %s", exc)
        session.thinking.seen_tokens = session.cache.length
        return None
    return job


def due(session: Session) -> bool:
    """Whether a new unit should start now: enough new input since the last one, or the final
    deliberation after input.end."""
    state = session.thinking
    if state is None or state.config.mode == "off" or session.closed:
        return False
    if state.final_requested and not state.final_done:
        return True
    new = session.cache.length - state.seen_tokens
    if session.data_version == 0 or new <= 0 or session.ended:
        return False
    every = state.config.every_tokens
    return new >= every if every else session.chunks and session.chunks[-1].seq > state.seen_seq


class ThinkJob(Job):
    """One reasoning unit. Dual: a fork with the thinking cache as its own cache (committed:
    reasoning is frozen once written), runs beside ingest. Interleaved: writes into the
    reading cache and so runs in the session's queue."""

    priority = Priority.THINKING
    kind = "think"
    background = True

    def __init__(self, session: Session, stop_ids: frozenset[int]) -> None:
        super().__init__(session)
        state = session.thinking
        self.state = state
        self.config = state.config
        self.stop_ids = stop_ids
        self.dual = self.config.mode == "dual"
        self.beside = self.dual  # dual units only write the thinking cache: they run beside the FIFO
        self.writes_input = not self.dual  # interleaved notes go into the reading cache
        self.final = state.final_requested and not state.final_done
        self.budget = self.config.final_tokens if self.final else self.config.unit_tokens
        self.epoch = session.crop_epoch
        self.generated: list[int] = []
        self.stream = TextStream(session.tokenizer)  # the unit's text, a few tokens decoded a token
        self.to_feed: list[int] = []  # tokens to write before sampling again
        self.phase = "header"  # header -> decode -> closing (feed the last token) -> reopen -> done
        self.cancelled = False
        self.unit: Unit | None = None
        self.first_pos: int | None = None
        self.fed: list[int] = []  # every token written by this unit
        self.earlier: list[int] = []  # the earlier notes' tokens, which the penalties count

    def begin(self) -> None:
        s, state, c = self.session, self.state, self.config
        view = fork_view(s)  # it reads the reading cache as it is now; its notes follow its next position
        visible = view.base
        last = s.chunks[-1].seq if s.chunks else 0
        first = min(state.seen_seq + 1, last)
        if not state.units or not self.dual:
            self.to_feed = s.tokenize(s.framing.question_text(c.instruction()))
        elif visible > state.seen_tokens:  # a turn about the input since the last note
            self.to_feed = self._new_input_turn(first, last)
        else:  # the final deliberation with nothing new: it continues the notes
            self.to_feed = s.tokenize("\n")
        if self.dual:
            self._make_room(len(self.to_feed) + self.budget + 1)
        self.earlier = [t for u in state.units[-PENALTY_NOTES:] for t in u.ids]
        start = state.cache.length if self.dual else visible
        index = len(state.units) + state.dropped_units + state.repeated_units
        self.unit = Unit(index, (first, last), visible, start, start,
                         final=self.final, started_at=time.monotonic(), visible_pos=view.reading_position)
        state.seen_tokens, state.seen_seq = visible, last

    def _new_input_turn(self, first: int, last: int) -> list[int]:
        """A later dual unit's prompt: a new turn naming the inputs since the last note and
        quoting the tail of their tokens, then the assistant's turn (the first unit's instruction
        stays above). The quote takes at most `quote_tokens`, fewer where three such units would
        not fit the thinking cache beside the first one (a small cache keeps several notes, not
        one long quote). The quoted ids are the chunks' own tokens; frames are named, not quoted."""
        s, state, c = self.session, self.state, self.config
        label = f"input {first}" if first == last else f"inputs {first}-{last}"
        head = s.tokenize(s.framing.between + f"New ({label}):\n")
        tail = s.tokenize(c.follow_up() + s.framing.suffix)
        cut = s.tokenize("...")
        first_unit = state.units[0].end - state.units[0].start if state.units else 0
        share = (state.cache.max_tokens - first_unit) // 3
        limit = max(0, min(c.quote_tokens, share - len(head) - len(tail) - len(cut) - self.budget - 1))
        pieces: list[list[int]] = []
        have = 0
        for chunk in reversed(s.chunks):
            if chunk.seq <= state.seen_seq or have >= limit:
                break
            if chunk.seq and chunk.extent is None:  # text (a frame's ids are vision placeholders)
                pieces.append(chunk.tokens)
                have += len(chunk.tokens)
        quoted = [t for piece in reversed(pieces) for t in piece]
        if len(quoted) > limit:
            quoted = cut + quoted[len(quoted) - limit:]
        return head + quoted + tail

    def want(self) -> int:
        return UNBOUNDED if self.unit is None else len(self.to_feed)

    def finish(self, core: EngineCore, exc: BaseException | None = None) -> None:
        if exc is not None:
            log.error("reasoning unit on session %s failed: %s", self.session.id, exc)
            self.state.seen_tokens = self.session.cache.length  # no retry loop on the same input
        super().finish(core, exc)

    def room(self) -> Room | None:
        """Interleaved: the reading cache must have room for the prompt, the unit and the reopened
        data turn (a window evicts old input to make it; an unbounded session refuses)."""
        if self.dual or self.unit is not None:
            return None
        s = self.session
        need = len(s.tokenize(s.framing.question_text(self.config.instruction())))
        need += self.budget + len(s.tokenize(s.framing.between)) + 1
        return Room(need, what="reasoning")

    def _make_room(self, need: int) -> None:
        """Dual: drop the oldest units (never the first, which holds the header) until `need`
        more tokens fit in the thinking cache."""
        state = self.state
        gap_start, gap = None, 0
        while state.cache.length + need > state.cache.max_tokens and len(state.units) > 1:
            victim = state.units.pop(1)
            width = victim.end - victim.start
            gap_start = victim.start if gap_start is None else gap_start
            state.cache.remove(victim.start, victim.end)
            for u in state.units[1:]:
                u.start -= width
                u.end -= width
                u.positions = (u.positions[0] - width, u.positions[1] - width)
            state.last_position -= width
            state.dropped_units += 1
            gap += width
        if gap:  # the later notes moved down into the gap: turn their keys once by its whole width, so
            # positions stay bounded by the reading window plus the thinking cache, however long it runs
            rotate_keys(state.cache, gap_start, state.cache.length - gap_start, -gap, self.session.runner.inv_freq)
        if state.cache.length + need > state.cache.max_tokens:
            raise InvalidRequest(f"thinking cache of {state.cache.max_tokens} tokens cannot hold a unit of {need}")

    def _position(self) -> int:
        """Position of the next reasoning token."""
        state, c = self.state, self.config
        if not self.dual:
            return self.session.next_position
        if c.positions == "group":
            return c.offset + state.cache.length
        return max(self.unit.visible_pos + state.cache.length, state.last_position + 1)

    def plan(self, budget: int) -> list[SeqStep]:
        s = self.session
        if self.unit is None:
            self.begin()
        if s.closed or (self.dual and s.crop_epoch != self.epoch):
            self.cancelled = self.done = True  # the input it read was rewritten
            if self.dual:
                self.state.cache.crop(self.unit.start)
            return []
        tokens = self.to_feed[:max(1, budget)]
        self._planned = len(tokens)
        if self.dual:
            cache = self.state.cache
            return [SeqStep(cache, cache.length, tokens, prefixes=((s.cache, self.unit.visible),),
                            pos0=self._position() - cache.length)]
        return [SeqStep(s.cache, s.cache.length, tokens, pos0=s.position_offset)]

    def complete_many(self, rows: list[torch.Tensor]) -> None:
        n, position = self._planned, self._position()
        cache = self.state.cache if self.dual else self.session.cache
        cache.commit(cache.length + n)
        self.state.written += n
        self.state.last_position = position + n - 1
        self.fed.extend(self.to_feed[:n])
        del self.to_feed[:n]
        if self.phase in ("decode", "closing") and self.first_pos is None:
            self.first_pos = position
        if self.to_feed:
            return
        if self.phase == "closing":
            self._close()
        elif self.phase == "reopen":
            self._done()
        else:
            self.phase = "decode"
            self._take(greedy(self.config.penalties.apply(rows[0], self.earlier)))

    def _take(self, token: int) -> None:
        if token in self.stop_ids:
            self._close()
            return
        self.generated.append(token)
        delta = self.stream.push(token)
        text = self.unit.text = self.stream.text
        if delta:
            self.session.notify("reasoning.delta", {"unit": self.unit.index, "delta": delta})
        self.to_feed = [token]
        stop, stripped = self.config.stop, text.rstrip(" ")
        if (len(self.generated) >= self.budget
                or (stop == "newline" and stripped.endswith("\n") and stripped.strip())
                or (stop == "sentence" and len(self.generated) > 2 and ends_sentence(text))):
            self.phase = "closing"  # write this last token, then stop

    def _close(self) -> None:
        unit = self.unit
        last = self.state.last_position
        unit.positions = (last if self.first_pos is None else self.first_pos, last)
        if not self.dual:  # close the notes and reopen the data turn, so input continues there
            self.to_feed = self.session.tokenize(self.session.framing.between)
            self.phase = "reopen"
            return
        self._done()

    def _done(self) -> None:
        unit, state = self.unit, self.state
        unit.done_at = time.monotonic()
        unit.end = (state.cache if self.dual else self.session.cache).length
        unit.ids = list(self.generated)
        unit.text = self.stream.finish()  # the whole decode's text (once, not a token)
        if self.final:
            state.final_done = True
        if self.dual and self._refuse_repeat():
            return
        if not self.dual:  # its own notes are in the reading cache: they are not new input
            state.seen_tokens = self.session.cache.length
            self.session.record_reasoning(unit.start, self.fed, unit.text)
        state.units.append(unit)
        self.session.notify("reasoning.done", unit.public())
        self.done = True

    def _refuse_repeat(self) -> bool:
        """A dual note equal to an earlier one (whitespace-normalized; notes dropped for room
        count too, up to REMEMBERED_NOTES; blank notes are never compared) is rolled back: the
        thinking cache is cropped to where the unit started, so later units and answers never
        read it. Otherwise it is remembered."""
        unit, state = self.unit, self.state
        key = normalize_note(unit.text)
        if not key:  # a blank note (whitespace only) states nothing that could repeat: kept as before
            return False
        earlier = state.notes.get(key)
        if earlier is None:
            state.notes[key] = unit.index
            while len(state.notes) > REMEMBERED_NOTES:
                state.notes.popitem(last=False)
            return False
        state.cache.crop(unit.start)
        state.last_position = state.units[-1].positions[1] if state.units else -1  # as window re-anchoring
        state.repeated_units += 1
        unit.repeated = True  # its reasoning.done tells how many tokens were written, then cropped
        self.session.log.info("reasoning unit %d repeats unit %d (%r): refused", unit.index, earlier, key[:80])
        self.session.notify("reasoning.done", unit.public())
        self.done = True
        return True


def adopt(session: Session, state: ThinkingState | None) -> None:
    """A handed-off session's thinking state, its dual cache included (sessions/handoff.py)."""
    session.thinking = state


def restore(session: Session, data: dict | None, think: torch.Tensor | None) -> None:
    """A checkpoint's thinking state and dual notes' K/V (sessions/checkpoint.py)."""
    if data is None:
        session.thinking = None
        return
    config = ThinkingConfig(**data["config"])
    state = session.thinking = ThinkingState(config)
    if config.mode == "dual":
        state.cache = session.runner.new_cache(config.max_tokens + 64)
        if think is not None and think.shape[3]:
            state.cache.reserve(think.shape[3])
            own_slots(state.cache)[:, :, :, :think.shape[3]] = think.to(state.cache.shape.device)
            state.cache.commit(think.shape[3])
    for u in data["units"]:
        state.units.append(Unit(**{**u, "seqs": tuple(u["seqs"]), "positions": tuple(u["positions"])}))
    for name in ("written", "last_position", "seen_tokens", "seen_seq", "final_requested", "final_done",
                 "dropped_units", "repeated_units"):
        setattr(state, name, data[name])
    state.notes.update((k, v) for k, v in data["notes"])
