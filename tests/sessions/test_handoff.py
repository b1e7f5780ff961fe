"""Handoff: a session exported on one engine and imported on another is the same session: the
same caches, state, flash answers and thinking notes, and the same answers and notes after
more input, with none of its input read again."""

import pytest
import torch
from helpers import Sync, driven, result
from parrot import parrot_runner

from streamer.sessions.handoff import MAGIC, HandoffError, export_session, import_session
from streamer.sessions.sampling import SamplingParams

SYSTEM = "You keep the lighthouse log."
ROWS = [f"row {i}: lamp {'on' if i % 3 else 'off'}, wind {10 + i} knots, pressure {1000 + 2 * i} hPa. "
        for i in range(12)]
FLASH = [{"question": "Is the lamp on?", "max_tokens": 6}]
WINDOW = {"max_tokens": 160, "keep_tokens": 110}  # small: the rows make it slide


def feed(runner, rows, **settings):
    engine = Sync(driven(runner))
    sid = engine.create_session(SYSTEM, session_id="s1", **settings)["session_id"]
    for row in rows:
        engine.append(sid, row)
    return engine, sid


def move(source, sid, **settings):
    """Export from `source`, create the session the same way on a fresh engine, import there.
    Returns (that engine, the blob)."""
    blob = source.call(lambda: export_session(source.engine.core, sid))
    target = Sync(driven(source.engine.runner))
    target.create_session(SYSTEM, session_id=sid, **settings)
    read = target.engine.stats.tokens_ingested
    target.call(lambda: import_session(target.engine.core, sid, blob))
    assert target.engine.stats.tokens_ingested == read  # the import read nothing
    return target, blob


def comparable(state: dict) -> dict:
    """A session's state without what depends on the clock or the pool's block layout."""
    flash = [{k: v for k, v in q.items() if k != "staleness"} for q in state["flash"]]
    return {**{k: v for k, v in state.items() if k != "cache_bytes"}, "flash": flash}


def same_session(a, b, sid, whole=True):
    """The same caches and inputs; `whole`: the same state too (right after the move: later
    inputs stamp each side's own clock)."""
    sa, sb = a.engine.sessions[sid], b.engine.sessions[sid]
    assert torch.equal(sa.cache.snapshot(), sb.cache.snapshot())
    if whole:
        assert comparable(sa.state()) == comparable(sb.state())
    assert (sa.data_version, sa.next_seq, sa.next_position) == (sb.data_version, sb.next_seq, sb.next_position)
    assert [(c.seq, c.start, c.tokens, c.text) for c in sa.chunks] == [(c.seq, c.start, c.tokens, c.text)
                                                                       for c in sb.chunks]
    return sa, sb


def ask(engine, sid, question="What is the wind now?"):
    return result(engine.engine, engine.engine.query(sid, question, SamplingParams(max_tokens=8))).tokens


def test_a_windowed_text_session_with_flash_moves_whole(tiny):
    runner, _ = tiny
    settings = {"flash": FLASH, "window": WINDOW}
    source, sid = feed(runner, ROWS[:8], **settings)
    assert source.engine.sessions[sid].window.slides > 0  # the window slid: positions were re-anchored
    target, blob = move(source, sid, **settings)
    assert blob.startswith(MAGIC)
    sa, sb = same_session(source, target, sid)
    assert sb.flash.questions["f1"].answer is not None and sb.flash.questions["f1"].answer.text == sa.flash.questions["f1"].answer.text
    assert ask(source, sid) == ask(target, sid)
    for row in ROWS[8:]:  # more input after the move: the same seqs, caches and flash answers
        assert source.append(sid, row).seq == target.append(sid, row).seq
    same_session(source, target, sid, whole=False)
    assert sa.flash.questions["f1"].answer.text == sb.flash.questions["f1"].answer.text
    assert ask(source, sid, "Is the lamp on?") == ask(target, sid, "Is the lamp on?")


def notes(session):
    """The thinking units without their (per-process) clocks."""
    return [(u.index, u.seqs, u.visible, u.start, u.end, u.positions, u.text, u.ids, u.repeated)
            for u in session.thinking.units]


@pytest.fixture(scope="module")
def parrot(tokenizer):
    return parrot_runner(tokenizer)


def test_a_dual_thinking_session_moves_with_its_notes(parrot):
    settings = {"thinking": {"mode": "dual", "unit_tokens": 6, "stop": "budget"}}
    source, sid = feed(parrot, ROWS[:5], **settings)
    sa = source.engine.sessions[sid]
    assert sa.thinking.units and sa.thinking.cache.length > 0
    target, _ = move(source, sid, **settings)
    sa, sb = same_session(source, target, sid)
    assert torch.equal(sa.thinking.cache.snapshot(), sb.thinking.cache.snapshot())
    assert notes(sa) == notes(sb) and sa.thinking.notes == sb.thinking.notes
    refused = sa.thinking.repeated_units
    for row in ROWS[5:8]:  # later units quote, penalise and refuse against the moved notes alike
        source.append(sid, row)
        target.append(sid, row)
    same_session(source, target, sid, whole=False)
    assert notes(sa) == notes(sb)
    assert sa.thinking.repeated_units == sb.thinking.repeated_units > refused  # the parrot's notes: refused alike
    assert torch.equal(sa.thinking.cache.snapshot(), sb.thinking.cache.snapshot())
    assert ask(source, sid) == ask(target, sid)


def test_a_blob_that_does_not_fit_is_refused_and_the_session_is_unchanged(tiny):
    runner, _ = tiny
    source, sid = feed(runner, ROWS[:3])
    blob = source.call(lambda: export_session(source.engine.core, sid))
    other = Sync(driven(runner))
    other.create_session("Another system prompt entirely.", session_id=sid)
    with pytest.raises(HandoffError, match="prefix"):
        other.call(lambda: import_session(other.engine.core, sid, blob))
    assert other.engine.sessions[sid].chunks == []
    with pytest.raises(HandoffError, match="not a session handoff blob"):
        other.call(lambda: import_session(other.engine.core, sid, b"junk"))
    with pytest.raises(HandoffError, match="malformed"):
        other.call(lambda: import_session(other.engine.core, sid, blob[:len(MAGIC) + 8] + b"{"))
    with pytest.raises(HandoffError, match="of session"):
        other.create_session(SYSTEM, session_id="s2")
        other.call(lambda: import_session(other.engine.core, "s2", blob))
    read = Sync(driven(runner))
    read.create_session(SYSTEM, session_id=sid)
    read.append(sid, "already read")
    with pytest.raises(HandoffError, match="read input already"):
        read.call(lambda: import_session(read.engine.core, sid, blob))
