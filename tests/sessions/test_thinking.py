"""Thinking while reading: the dual-cache scheduler against its invariants."""

import pytest
import torch
from helpers import Sync, driven, result, run_unit

from streamer.sessions.errors import EngineError
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session
from streamer.sessions.thinking import ThinkingConfig, configure

CHUNKS = ["The keeper is Ada Morrow. ", "Her cat is Pepper. ", "The boat Marigold comes on Tuesdays. ",
          "A storm broke the burner on March 16. ", "Owen Pike fitted a new burner. "]


def session_with(runner, mode, **cfg):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    configure(session, ThinkingConfig(mode=mode, **cfg))
    for chunk in CHUNKS[:3]:
        drive(runner, PrefillJob(session, session.tokenize(chunk), chunk))
    return session


def test_dual_equals_interleaved_when_no_input_arrives(tiny):
    runner, _ = tiny
    inter = session_with(runner, "interleaved", unit_tokens=24, stop="budget")
    dual = session_with(runner, "dual", unit_tokens=24, stop="budget")
    a, b = run_unit(runner, inter), run_unit(runner, dual)
    assert a.generated == b.generated and len(a.generated) == 24
    assert a.unit.positions == b.unit.positions
    # the reading cache of dual mode is untouched; interleaved wrote header + notes + reopen into it
    assert dual.cache.length == len(dual.context_ids())
    assert inter.cache.length == len(inter.context_ids()) > dual.cache.length
    assert inter.chunks[-1].seq == 0 and inter.chunks[-1].tokens[-len(a.generated) - 5:]


def test_reading_cache_is_identical_with_thinking_on_and_off(tiny):
    runner, _ = tiny
    snapshots = []
    for thinking in (None, {"mode": "dual", "unit_tokens": 8}):
        engine = Sync(driven(runner))
        sid = engine.create_session(thinking=thinking)["session_id"]
        for chunk in CHUNKS:
            engine.append(sid, chunk)  # and the reasoning unit it makes due
        session = engine.engine.sessions[sid]
        if thinking:
            assert len(session.thinking.units) == len(CHUNKS)
        snapshots.append(session.cache.snapshot())
    assert torch.equal(snapshots[0], snapshots[1])


def test_positions_are_monotone_and_units_see_growing_input(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    events = []
    sid = engine.create_session(thinking={"mode": "dual", "unit_tokens": 6, "stop": "budget"})["session_id"]
    engine.add_listener(sid, lambda e, p: events.append((e, p)))
    for chunk in CHUNKS:
        engine.append(sid, chunk)
    session = engine.engine.sessions[sid]
    units = session.thinking.units
    assert len(units) == len(CHUNKS)
    for u, v in zip(units, units[1:]):
        assert u.positions[0] <= u.positions[1] < v.positions[0]
        assert u.visible < v.visible and u.seqs[1] < v.seqs[1]
        assert v.positions[0] >= v.visible  # "after the input it can see"
    done = [p for e, p in events if e == "reasoning.done"]
    assert [d["seq_range"][1] for d in done] == [1, 2, 3, 4, 5]
    deltas = "".join(p["delta"] for e, p in events if e == "reasoning.delta" and p["unit"] == 0)
    assert deltas == done[0]["text"]


def test_group_positions_use_their_own_counter(tiny):
    runner, _ = tiny
    session = session_with(runner, "dual", unit_tokens=5, stop="budget", positions="group", offset=3)
    job = run_unit(runner, session)
    header = len(session.tokenize(session.framing.question_text(ThinkingConfig().instruction())))
    assert job.unit.positions == (3 + header, 3 + header + 4)


def test_questions_and_revise_leave_the_thinking_cache_alone(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session(thinking={"mode": "dual", "unit_tokens": 6})["session_id"]
    for chunk in CHUNKS[:3]:
        engine.append(sid, chunk)
    session = engine.engine.sessions[sid]
    before, reading = session.thinking.cache.snapshot(), session.cache.snapshot()
    answer = result(engine.engine, engine.engine.query(sid, "Who keeps the light?", SamplingParams(max_tokens=6)))
    assert answer.context_tokens == session.cache.length and len(answer.tokens) >= 1
    assert torch.equal(session.thinking.cache.snapshot(), before)
    assert torch.equal(session.cache.snapshot(), reading)
    units = len(session.thinking.units)
    engine.revise(sid, "The boat Heron")  # shorter than what the notes saw: no new unit
    assert len(session.thinking.units) == units
    assert torch.equal(session.thinking.cache.snapshot()[:, :, :, :before.shape[3]], before)


def test_end_of_input_runs_a_final_deliberation(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session(thinking={"mode": "dual", "unit_tokens": 4, "final_tokens": 10,
                                          "stop": "budget", "question": "Who keeps the light?"})
    sid = sid["session_id"]
    engine.append(sid, CHUNKS[0])
    engine.end_input(sid)
    session = engine.engine.sessions[sid]
    final = [u for u in session.thinking.units if u.final]
    assert len(final) == 1 and final[0].end - final[0].start == 11  # "\n" + 10 tokens
    assert session.state()["thinking"]["final_done"]


def test_thinking_cache_is_bounded(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session(thinking={"mode": "dual", "unit_tokens": 16, "stop": "budget",
                                          "max_tokens": 80})["session_id"]
    for i in range(12):
        engine.append(sid, f"Fact {i}. ")
    session = engine.engine.sessions[sid]
    assert session.thinking.dropped_units > 0
    assert session.thinking.cache.length <= session.thinking.cache.max_tokens
    assert result(engine.engine, engine.engine.query(sid, "Facts?", SamplingParams(max_tokens=3))).tokens


@pytest.mark.parametrize("settings,match", [
    ({"mode": "sideways"}, "mode must be one of"), ({"mode": "dual", "unit_tokens": 0}, "unit_tokens"),
    ({"mode": "dual", "stop": "never"}, "stop must be"), ({"mode": "dual", "positions": "before"}, "positions"),
    ({"mode": "dual", "max_tokens": 1}, "max_tokens"), ({"mode": "dual", "colour": "red"}, "bad thinking settings"),
])
def test_bad_thinking_settings(tiny, settings, match):
    engine = Sync(driven(tiny[0]))
    with pytest.raises(EngineError, match=match):
        engine.create_session(thinking=settings)
    sid = engine.create_session()["session_id"]
    with pytest.raises(EngineError, match=match):
        engine.configure_thinking(sid, settings)
    assert engine.configure_thinking(sid, {"mode": "dual"})["thinking"]["mode"] == "dual"


def test_interleaved_sessions_refuse_revise(tiny):
    engine = Sync(driven(tiny[0]))
    sid = engine.create_session(thinking={"mode": "interleaved", "unit_tokens": 4})["session_id"]
    engine.append(sid, CHUNKS[0])  # and its reasoning unit, in the reading cache
    assert engine.engine.sessions[sid].chunks[-1].seq == 0
    with pytest.raises(EngineError, match="interleaved reasoning"):
        engine.revise(sid, "x")
    assert engine.append(sid, CHUNKS[1]).seq == 2
