"""A bounded reading cache for unbounded input: attention sinks + a recent window.

A camera or a microphone never stops, but a session's cache must. With a `TextWindow` the
session keeps its framing prefix and its first `sink_inputs` inputs (the attention sinks:
StreamingLLM shows a model needs its first tokens to stay stable, and they hold the stream's
preamble, such as the frame describer's statement of what it can see), plus the most recent
inputs. When an append would take the session past `max_tokens`, a `SlideJob` runs first: it
drops the oldest inputs after the sinks until the rest fits in `keep_tokens`, crops the cache
where the first dropped input began and prefills the kept inputs again right after the sinks.
Positions are thereby re-anchored: they stay contiguous and never pass `max_tokens`, so the
model never runs past its position range however long the stream runs.

Re-prefill rather than re-rotating cached keys: the kept tokens' deeper-layer states were
computed while attending to the dropped ones; re-prefilling makes the cache exactly what a
fresh session fed the same kept inputs would hold (tests/sessions/test_window.py). Sliding down
to `keep_tokens` (default half the window) amortises that cost: each slide re-reads at most
`keep_tokens` tokens and buys room for `max_tokens - keep_tokens` new ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ContextOverflow, InvalidRequest
from .jobs import UNBOUNDED, PrefillJob
from .session import Session


@dataclass(slots=True)
class TextWindow:
    """Bounds of a session's reading cache (tokens, the framing prefix included)."""

    max_tokens: int
    keep_tokens: int = 0  # tokens left after a slide (0: half of max_tokens)
    sink_inputs: int = 1  # first inputs that are never dropped
    slides: int = 0
    dropped_inputs: int = 0
    dropped_tokens: int = 0
    reprefilled_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.keep_tokens:
            self.keep_tokens = self.max_tokens // 2
        if not 0 < self.keep_tokens <= self.max_tokens:
            raise InvalidRequest(f"window keep_tokens {self.keep_tokens} must be in [1, max_tokens={self.max_tokens}]")
        if self.sink_inputs < 0:
            raise InvalidRequest(f"window sink_inputs must be >= 0, got {self.sink_inputs}")

    def public(self) -> dict:
        return {"max_tokens": self.max_tokens, "keep_tokens": self.keep_tokens, "sink_inputs": self.sink_inputs,
                "slides": self.slides, "dropped_inputs": self.dropped_inputs, "dropped_tokens": self.dropped_tokens,
                "reprefilled_tokens": self.reprefilled_tokens}


def set_window(session: Session, max_tokens: int, keep_tokens: int = 0, sink_inputs: int = 1) -> TextWindow:
    """Bound the session's cache. Refused with thinking on (its notes track reading positions)."""
    if session.thinking is not None and session.thinking.config.mode != "off":
        raise InvalidRequest(f"session {session.id} thinks while reading; a text window needs thinking 'off'")
    floor = len(session.prefix_ids) + 16
    if not floor <= max_tokens <= session.context_window:
        raise InvalidRequest(f"window max_tokens {max_tokens} must be in [{floor}, {session.context_window}] "
                             f"(prefix {len(session.prefix_ids)} tokens + room, at most the context window)")
    window = TextWindow(max_tokens, keep_tokens, sink_inputs)
    session.window = window
    return window


def check_window_room(session: Session, window: TextWindow, new_tokens: int) -> bool:
    """Validate an append of `new_tokens` to a windowed session; True if a slide must run first."""
    sinks = session.chunks[: window.sink_inputs]
    fixed = len(session.prefix_ids) + sum(len(c.tokens) for c in sinks)
    if fixed + new_tokens > window.max_tokens:
        raise ContextOverflow(
            f"input of {new_tokens} tokens does not fit session {session.id}'s window of {window.max_tokens} "
            f"tokens next to its {fixed} prefix and sink tokens")
    return session.cache.length + session.pending_tokens + new_tokens > window.max_tokens


class SlideJob(PrefillJob):
    """Drop the oldest inputs after the sinks and re-prefill the rest right after them."""

    kind = "slide"
    joins = False

    def __init__(self, session: Session, window: TextWindow) -> None:
        super().__init__(session, [], None)
        self.window = window

    def want(self) -> int:
        return UNBOUNDED if self.start is None else super().want()

    def begin(self, after=None) -> None:
        s, w = self.session, self.window
        first = min(w.sink_inputs, len(s.chunks))
        target = min(w.keep_tokens, w.max_tokens - s.pending_tokens)
        drop = first
        length = s.cache.length
        while drop < len(s.chunks) and length > target:
            length -= len(s.chunks[drop].tokens)
            drop += 1
        self.start = s.cache.length
        if drop == first:  # nothing to drop (another slide already made room)
            return
        dropped, kept = s.chunks[first:drop], s.chunks[drop:]
        base = dropped[0].start
        s.cache.crop(base)
        s.crop_epoch += 1  # forks reading the old positions (flash evaluations) are now stale
        del s.chunks[first:drop]
        pos = base
        for chunk in kept:  # re-anchored: contiguous right after the sinks
            chunk.start, pos = pos, pos + len(chunk.tokens)
        self.tokens = [t for c in kept for t in c.tokens]
        if not self.tokens:
            s.last_logits = None  # known again after the next input
        s.pending_tokens += len(self.tokens)
        self.start, self.pos = base, 0
        w.slides += 1
        w.dropped_inputs += len(dropped)
        w.dropped_tokens += sum(len(c.tokens) for c in dropped)
        w.reprefilled_tokens += len(self.tokens)
        s.log.info("window slide: dropped %d inputs (%d tokens), re-prefilling %d", len(dropped),
                   sum(len(c.tokens) for c in dropped), len(self.tokens))

    def finish_input(self) -> None:
        self.done = True


def configure(core, session_id: str, max_tokens: int, keep_tokens: int = 0, sink_inputs: int = 1) -> dict:
    """Bound the session's reading cache: sinks + recent inputs. Returns the session state."""
    session = core.live(session_id)
    set_window(session, max_tokens, keep_tokens, sink_inputs)
    if session.cache.length + session.pending_tokens > max_tokens:
        core.submit(SlideJob(session, session.window))
    return session.state()


def ensure(core, session_id: str, max_tokens: int) -> dict:
    """Give a session that has no window one of `max_tokens` (at most its context window), so
    an endless input (media) cannot fill it; sessions that think keep their cache as it is.
    Returns {"window_set": the settings applied, or None}."""
    session = core.live(session_id)
    if session.window is not None or (session.thinking is not None and session.thinking.config.mode != "off"):
        return {"window_set": None}
    size = min(max_tokens, session.context_window)
    configure(core, session_id, size)
    return {"window_set": {"max_tokens": size, "keep_tokens": 0, "sink_inputs": 1}}
