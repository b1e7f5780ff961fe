"""What room a job needs in its session's reading cache as it starts.

A job declares it (`Job.room`); one step of the core makes it before the job plans
(`EngineCore._prepare` calls `window.make_room`), so evictions follow the session's FIFO and a
replay of the same log evicts the same inputs (sessions/window.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Room:
    """What a job needs of its session's reading cache as it starts (`Job.room`). One step of the
    core makes it (`make_room`, from `EngineCore._prepare`) before the job plans, so evictions
    follow the session's FIFO and replay the same way."""

    tokens: int = 0  # tokens it writes at the end of the reading cache (input, notes; a question: + answer)
    evict_first: tuple[int, ...] = ()  # replay: exactly these inputs are evicted first
    frame: bool = False  # a frame on a VL model: the window's vision bound applies first
    answer_at: int | None = None  # a question: `tokens` must fit after this position in the model's window
    replace_from: int | None = None  # a revise: index of the first chunk it replaces (never evicted)
    bound: bool = False  # a new bound: a cache past it is evicted down to `keep_tokens`
    what: str | None = None  # an unbounded session refuses it if the model's window cannot take `tokens`
