"""Bounded reading caches for endless input: attention sinks + the most recent inputs.

A live feed never stops, but a session's cache must. Every session has a `TextWindow` unless
it asks for none (`window: null`): its framing prefix and first `sink_inputs` inputs stay (the
attention sinks: StreamingLLM shows a model needs its first tokens to stay stable, and they
hold the stream's preamble), and the oldest inputs after them are evicted when something new
needs room:

- an input that would take the cache past `max_tokens` first evicts down to `keep_tokens`
  (minus its own size), so one eviction buys room for many inputs;
- a question (or an interleaved reasoning unit) that would leave no room to answer in the
  model's window evicts just enough first. A windowed session always answers.

Eviction costs a copy, not a forward. The kept inputs move down over the evicted ones in
every layer (one copy of their K/V) and their keys are turned back by the gap with the RoPE
rotation (`rope.rotate_keys`, exact: a key computed at position p and rotated by d equals the
key computed at p + d), so positions stay contiguous and never pass `max_tokens`, however long
the stream runs. Nothing is run through the model again: the kept tokens keep the deeper-layer
states they were read with (the StreamingLLM trade), which for a one-layer model is exactly
what a fresh prefill of the kept inputs at their new positions holds (tests/sessions/
test_window.py). A dual thinking cache is re-anchored with its reading cache: its notes turn
down by the same gap.

Evictions happen when the job that needs the room starts: each job declares the `Room` it needs
(`Job.room`) and one step of the core makes it (`make_room`) before the job plans, so they
follow the session's FIFO and depend only on what was accepted before, never on timing:
replaying the same log evicts the same inputs (the event log's records carry the evicted seqs,
and replay checks them). Other sessions never wait behind an
eviction: it runs inside its own job's step, in a few milliseconds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .errors import ContextOverflow, InvalidRequest
from .room import Room
from .rope import rotate_keys
from .session import Session, drop_inputs

if TYPE_CHECKING:
    from .engine import EngineCore

DEFAULT_WINDOW_TOKENS = 4096  # the documented default bound of a session's reading cache


@dataclass(slots=True)
class TextWindow:
    """Bounds of a session's reading cache (tokens, the framing prefix included)."""

    max_tokens: int
    keep_tokens: int = 0  # tokens left after an eviction for input (0: three quarters of max_tokens)
    sink_inputs: int = 1  # first inputs that are never evicted
    vision_tokens: int = 0  # frames (VL model) after the sinks keep at most this many tokens (0: no own bound)
    default: bool = False  # the default window (media may resize it), not one the client chose
    slides: int = 0
    dropped_inputs: int = 0
    dropped_tokens: int = 0
    moved_tokens: int = 0
    slide_ms_total: float = 0.0
    last_slide_ms: float = 0.0
    last_evicted_seq: int = 0
    evicted: list[int] = field(default_factory=list)  # seqs evicted since the last input took them

    def __post_init__(self) -> None:
        if not self.keep_tokens:
            self.keep_tokens = self.max_tokens * 3 // 4
        if not 0 < self.keep_tokens <= self.max_tokens:
            raise InvalidRequest(f"window keep_tokens {self.keep_tokens} must be in [1, max_tokens={self.max_tokens}]",
                                 param="keep_tokens")
        if self.sink_inputs < 0:
            raise InvalidRequest(f"window sink_inputs must be >= 0, got {self.sink_inputs}", param="sink_inputs")
        if not 0 <= self.vision_tokens <= self.max_tokens:
            raise InvalidRequest(f"window vision_tokens {self.vision_tokens} must be in [0, max_tokens="
                                 f"{self.max_tokens}]", param="vision_tokens")

    def public(self) -> dict:
        return {"max_tokens": self.max_tokens, "keep_tokens": self.keep_tokens, "sink_inputs": self.sink_inputs,
                "vision_tokens": self.vision_tokens, "default": self.default, "slides": self.slides, "dropped_inputs": self.dropped_inputs,
                "dropped_tokens": self.dropped_tokens, "moved_tokens": self.moved_tokens,
                "last_evicted_seq": self.last_evicted_seq,
                "last_slide_ms": round(self.last_slide_ms, 3),
                "slide_ms_mean": round(self.slide_ms_total / self.slides, 3) if self.slides else 0.0}

    def take_evicted(self) -> list[int]:
        """The input seqs evicted since the last call (reported with the input that caused it)."""
        out, self.evicted = self.evicted, []
        return out


def take_evicted(session: Session) -> list[int]:
    """Input seqs the session's window evicted since the last input reported them."""
    return session.window.take_evicted() if session.window is not None else []


def make_room(session: Session, room: Room | None) -> None:
    """Make the room a job declared, as it starts: a windowed session evicts old inputs; an
    unbounded one is left alone (or refuses, for `what`)."""
    if room is None:
        return
    window = session.window
    if window is None:
        if room.what is not None:
            session.check_room(room.tokens, room.what)
        return
    if room.bound:
        if session.cache.length > window.max_tokens:
            evict(session, window.keep_tokens)
    elif room.answer_at is not None:
        room_for_answer(session, room.tokens, room.answer_at)
    elif room.replace_from is not None:  # a longer tail evicts older input first (never the tail itself)
        first = room.replace_from
        if room.evict_first:
            first -= len(evict_seqs(session, list(room.evict_first)))
        grow = room.tokens - sum(len(c.tokens) for c in session.chunks[first:])
        if session.cache.length + grow > window.max_tokens:
            evict(session, window.max_tokens - grow, limit=first)
    else:
        if room.evict_first:
            evict_seqs(session, list(room.evict_first))
        elif room.frame:
            room_for_frame(session, room.tokens)
        room_for_input(session, room.tokens)


def reserve_tokens(limits, context_window: int) -> int:
    """Room a default window leaves free in the model's window: the longest question plus the
    longest answer (flash evaluations and dual-mode notes fit in it too), at most half of it. So
    with the default window no question ever needs to evict input."""
    return min(limits.max_question_tokens + limits.max_answer_tokens, context_window // 2)


def default_size(limits, context_window: int, prefix_tokens: int = 0) -> int:
    """The default bound: `limits.window_tokens` (DEFAULT_WINDOW_TOKENS), or less where the
    model's window minus the reserve is smaller; always some room past a long system prompt."""
    wanted = getattr(limits, "window_tokens", DEFAULT_WINDOW_TOKENS)
    size = min(wanted, context_window - reserve_tokens(limits, context_window))
    return min(context_window, max(size, prefix_tokens + 256))


def set_window(session: Session, max_tokens: int, keep_tokens: int = 0, sink_inputs: int = 1,
               default: bool = False, vision_tokens: int = 0) -> TextWindow:
    """Bound the session's cache."""
    floor = len(session.prefix_ids) + 16
    if not floor <= max_tokens <= session.context_window:
        raise InvalidRequest(f"window max_tokens {max_tokens} must be in [{floor}, {session.context_window}] "
                             f"(prefix {len(session.prefix_ids)} tokens + room, at most the context window)",
                             param="max_tokens")
    if session.window is None:
        window = TextWindow(max_tokens, keep_tokens, sink_inputs, vision_tokens, default)
    else:  # a resize: the counters (and evictions not yet reported) carry over
        window = replace(session.window, max_tokens=max_tokens, keep_tokens=keep_tokens, sink_inputs=sink_inputs,
                         default=default, vision_tokens=vision_tokens)
    session.window = window
    return window


def adopt(session: Session, window: TextWindow | None) -> None:
    """A handed-off session's window, counters included (sessions/handoff.py)."""
    session.window = window


def restore(session: Session, settings: dict | None) -> None:
    """A checkpoint's window, counters included (sessions/checkpoint.py)."""
    session.window = TextWindow(**settings) if settings is not None else None


def unbound(session: Session) -> None:
    """Lift the session's bound (input past the model's window is then refused)."""
    session.window = None


def window_args(settings: dict) -> dict:
    """`set_window` keywords from a client's `window` object (unknown keys are refused)."""
    known = {"max_tokens", "keep_tokens", "sink_inputs", "vision_tokens"}
    extra = set(settings) - known
    if extra:
        raise InvalidRequest(f"window has no field {sorted(extra)[0]!r}", param=sorted(extra)[0])
    if settings.get("max_tokens") is None:
        raise InvalidRequest("window needs 'max_tokens' (or null for an unbounded session)", param="max_tokens")
    out = {"max_tokens": settings["max_tokens"], "keep_tokens": settings.get("keep_tokens") or 0,
           "sink_inputs": settings.get("sink_inputs", 1)}
    if settings.get("vision_tokens"):
        out["vision_tokens"] = settings["vision_tokens"]
    return out


def check_input(session: Session, new_tokens: int) -> None:
    """Refuse, when it is submitted, input that can never fit: a windowed session's input must
    fit beside its prefix and sinks; an unbounded one's must fit the rest of the model's window."""
    window = session.window
    if window is None:
        session.check_room(new_tokens)
        return
    fixed = len(session.prefix_ids) + sum(len(c.tokens) for c in session.chunks[: window.sink_inputs])
    if fixed + new_tokens > window.max_tokens:
        raise ContextOverflow(
            f"input of {new_tokens} tokens does not fit session {session.id}'s window of {window.max_tokens} "
            f"tokens next to its {fixed} prefix and sink tokens")


def room_for_input(session: Session, new_tokens: int) -> None:
    """Called as an input starts (its turn in the FIFO): evict if it would pass the window."""
    window = session.window
    if window is None or session.cache.length + new_tokens <= window.max_tokens:
        return
    target = window.keep_tokens - new_tokens
    if target < len(session.prefix_ids):
        target = window.max_tokens - new_tokens
    evict(session, target)
    if session.cache.length + new_tokens > window.max_tokens:
        raise ContextOverflow(
            f"input of {new_tokens} tokens does not fit session {session.id}'s window of {window.max_tokens} "
            f"tokens beside the {session.cache.length} tokens it must keep")


def room_for_frame(session: Session, new_tokens: int) -> None:
    """Called as a frame starts (VL model): with a vision bound, the oldest frames after the sinks
    are evicted (text between them stays) until the frames held plus this one fit it. The longer
    text window is the window's own bound (`room_for_input`, after this)."""
    s, w = session, session.window
    if w is None or not w.vision_tokens:
        return
    first = min(w.sink_inputs, len(s.chunks))
    frames = [i for i in range(first, len(s.chunks)) if s.chunks[i].extent is not None]
    held = sum(len(s.chunks[i].tokens) for i in frames)
    gone = []
    for i in frames:  # oldest first
        if held + new_tokens <= w.vision_tokens:
            break
        held -= len(s.chunks[i].tokens)
        gone.append(i)
    for i in reversed(gone):  # later ones first, so the earlier indices still hold
        _evict_range(s, i, i + 1)


def room_for_answer(session: Session, need: int, position: int) -> None:
    """Called as a question starts: a windowed session evicts until `need` more tokens (question +
    answer) fit after `position` in the model's window; an unbounded one is left alone."""
    if session.window is None:
        return
    over = position + need - session.context_window
    if over > 0:
        evict(session, session.cache.length - over)


def evict(session: Session, target: int, limit: int | None = None) -> list:
    """Evict the oldest inputs after the sinks until the reading cache holds at most `target`
    tokens (or only prefix and sinks are left; never the chunk at index `limit` or later).
    Returns the evicted chunks."""
    s, w = session, session.window
    first = min(w.sink_inputs, len(s.chunks))
    end = len(s.chunks) if limit is None else min(limit, len(s.chunks))
    drop, length = first, s.cache.length
    while drop < end and length > target:
        length -= len(s.chunks[drop].tokens)
        drop += 1
    return _evict_range(s, first, drop)


def evict_seqs(session: Session, seqs: list[int]) -> list:
    """Evict exactly these inputs (replay: what the original session evicted before an input).
    They must be the oldest inputs after the sinks, in order."""
    s = session
    if s.window is None:
        raise InvalidRequest(f"session {s.id} has no window to evict inputs {seqs} from")
    first = min(s.window.sink_inputs, len(s.chunks))
    drop, wanted = first, list(seqs)
    while wanted and drop < len(s.chunks):
        seq = s.chunks[drop].seq
        if seq and seq != wanted[0]:
            break
        if seq:
            wanted.pop(0)
        drop += 1
    if wanted:
        picked = _evict_scattered(s, first, list(seqs))  # a vision bound evicts frames between kept text
        if picked is not None:
            return picked
        live = [c.seq for c in s.chunks[first:first + 5]]
        raise InvalidRequest(f"inputs {wanted} are not the oldest evictable inputs of session {s.id} "
                             f"(oldest after the sinks: {live})")
    return _evict_range(s, first, drop)


def _evict_scattered(s: Session, first: int, seqs: list[int]) -> list | None:
    """Evict exactly the inputs `seqs` after the sinks, wherever they are (None if one is not a
    live input there)."""
    where = {c.seq: i for i, c in enumerate(s.chunks) if i >= first and c.seq}
    if any(seq not in where for seq in seqs):
        return None
    gone = []
    for i in sorted((where[seq] for seq in seqs), reverse=True):
        gone[:0] = _evict_range(s, i, i + 1)
    return gone


def _evict_range(s: Session, first: int, drop: int) -> list:
    """Evict `s.chunks[first:drop]`: move the later K/V down over them and turn their keys."""
    w = s.window
    if drop <= first:
        return []
    started = time.perf_counter()
    gone = s.chunks[first:drop]
    a, b = gone[0].start, gone[-1].end
    moved = s.cache.length - b
    shift = b - a
    turn = sum(c.span for c in gone)  # positions they took (a VL frame takes fewer than its tokens)
    s.cache.remove(a, b)  # the kept K/V move down in every layer: one copy
    rotate_keys(s.cache, a - s.cache.prefix_len, moved, -turn, s.runner.inv_freq)  # keys turn back by the gap
    seqs = drop_inputs(s, first, drop, turn)  # the log follows; forks over the old positions are stale
    if s.thinking is not None:  # dual notes turn down with the reading cache
        s.thinking.reanchor(gone, s.runner.inv_freq)
    w.evicted.extend(seqs)
    ms = (time.perf_counter() - started) * 1000
    w.slides += 1
    w.dropped_inputs += len(gone)
    w.dropped_tokens += shift
    w.moved_tokens += moved
    w.slide_ms_total += ms
    w.last_slide_ms = ms
    if seqs:
        w.last_evicted_seq = seqs[-1]
    s.log.info("window: evicted %d inputs (%d tokens), moved %d tokens down in %.1f ms", len(gone), shift, moved, ms)
    return gone


# ---- commands (run on the engine thread; `core` is the EngineCore) -----------------------------


def ensure(core: EngineCore, session_id: str, max_tokens: int) -> dict:
    """A media session keeps the media window size (`MediaConfig.window_tokens`) if its window is
    still the default one; a window the client chose, or none, is left as it is. Returns
    {"window_set": the settings applied, or None}."""
    session = core.live(session_id)
    window = session.window
    size = min(max_tokens, session.context_window)
    vision = size // 2 if session.runner.vl is not None else 0  # frames on a VL model: half of it at most
    if window is None or not window.default or (window.max_tokens, window.vision_tokens) == (size, vision):
        return {"window_set": None}
    set_window(session, size, default=True, vision_tokens=vision)
    settings = {"max_tokens": size, "keep_tokens": 0, "sink_inputs": 1}
    return {"window_set": {**settings, "vision_tokens": vision} if vision else settings}
