"""Thinking while reading: the dual-cache scheduler against its invariants."""

import pytest
import torch
from helpers import Sync, driven, result, run_unit
from parrot import parrot_runner

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
    ({"mode": "dual", "quote_tokens": -1}, "quote_tokens"),
    ({"mode": "dual", "presence_penalty": 5}, "presence_penalty"),
    ({"mode": "dual", "repetition_penalty": 0}, "repetition_penalty"),
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



ROWS = [f"row {i}: temp={20 + i % 3}.{i}C pressure={1010 + i}hPa\n" for i in range(1, 13)]


@pytest.fixture(scope="module")
def parrot(tokenizer):
    """Every note it writes is ' same same ...' (tests/parrot.py)."""
    return parrot_runner(tokenizer)


def dual_feed(runner, rows=ROWS, **cfg):
    """A driven engine with a dual session fed `rows` one append (and its unit) at a time, and
    the session's `reasoning.done` payloads (a list that keeps growing with later units)."""
    engine = Sync(driven(runner))
    done = []
    sid = engine.create_session(thinking={"mode": "dual", "unit_tokens": 6, "stop": "budget", **cfg})["session_id"]
    engine.add_listener(sid, lambda e, p: e == "reasoning.done" and done.append(p))
    for row in rows:
        engine.append(sid, row)
    return engine, sid, done


def test_a_later_dual_unit_quotes_the_input_since_the_last_note(tiny):
    """Each unit after the first is a turn about what arrived since the previous note: its
    prompt names those seqs and holds their own token ids; input the last note saw is not quoted."""
    runner, _ = tiny
    session = session_with(runner, "dual", unit_tokens=4, stop="budget")
    first = run_unit(runner, session)
    assert first.unit.seqs == (1, 3)
    new = [session.tokenize(text) for text in CHUNKS[3:5]]
    for chunk, ids in zip(CHUNKS[3:5], new):
        drive(runner, PrefillJob(session, ids, chunk))
    job = run_unit(runner, session)
    fed = job.fed[:len(job.fed) - len(job.generated)]
    quoted = new[0] + new[1]
    at = next(i for i in range(len(fed)) if fed[i:i + len(quoted)] == quoted)
    head = session.tokenizer.decode(fed[:at])
    assert "inputs 4-5" in head and session.framing.between.strip() in head
    assert "Her cat" not in session.tokenizer.decode(fed)  # seq 2: the first note saw it
    assert job.unit.seqs == (4, 5) and job.unit.end - job.unit.start == len(job.fed)

    # quote_tokens bounds the quote to the tail of the new input
    short = session_with(runner, "dual", unit_tokens=4, stop="budget", quote_tokens=3)
    run_unit(runner, short)
    drive(runner, PrefillJob(short, new[0], CHUNKS[3]))
    fed = run_unit(runner, short).fed
    cut = short.tokenize("...") + new[0][-3:]
    assert any(fed[i:i + len(cut)] == cut for i in range(len(fed)))
    assert not any(fed[i:i + 4] == new[0][-4:] for i in range(len(fed)))


def test_a_note_equal_to_an_earlier_one_is_rolled_back(parrot):
    """The parrot writes the same note whatever it reads: every repeat is refused, its tokens
    cropped from the thinking cache (cache, positions and what answers read are as if it never
    ran) and counted; reasoning.done says repeated."""
    engine, sid, done = dual_feed(parrot, ROWS[:2])
    session = engine.engine.sessions[sid]
    state = session.thinking
    assert done[0]["text"].split() == ["same"] * 6 and done[1]["text"] == done[0]["text"]
    assert len(state.units) == 1  # today's code kept both
    assert [d["repeated"] for d in done] == [False, True] and [d["unit"] for d in done] == [0, 1]
    assert done[1]["tokens"] > 6 and state.repeated_units == 1  # written, then cropped
    kept = state.units[0]
    assert state.cache.length == kept.end and state.last_position == kept.positions[1]
    before = state.cache.snapshot()

    engine.append(sid, ROWS[2])  # another repeat, refused the same way
    assert state.repeated_units == 2 and len(state.units) == 1 and done[-1]["unit"] == 2
    assert torch.equal(state.cache.snapshot(), before) and state.last_position == kept.positions[1]
    # an answer reads the reading cache and the kept note only
    query = engine.engine.query(sid, "What is the pressure?", SamplingParams(max_tokens=4))
    engine.engine.step()  # the question begins: it takes its ranges of the two caches
    job = next(j for j in engine.engine.core.lanes.fifo[sid] if j.kind == "query")
    assert job.prefixes == ((session.cache, session.cache.length), (state.cache, kept.end))
    assert result(engine.engine, query).tokens
    public = session.state()["thinking"]
    assert public["repeated_units"] == 2 and public["units"] == 1


def test_notes_of_a_changing_feed_are_never_equal(parrot):
    """With penalties counting the earlier notes' tokens, the parrot's later notes move off its
    one sentence; the first note is plain greedy either way. Whatever is written, no two kept
    notes are equal (blank ones, only whitespace, state nothing and are not compared) and every
    refused one is counted."""
    _, _, plain = dual_feed(parrot)
    kept = [" ".join(d["text"].split()) for d in plain if not d.get("repeated") and d["text"].strip()]
    assert len(kept) == 1 and len(plain) == len(ROWS)  # without penalties: one note, 11 refused
    engine, sid, penalized = dual_feed(parrot, repetition_penalty=3.0, presence_penalty=2.0)
    assert plain[0]["text"] == penalized[0]["text"]
    kept = [" ".join(d["text"].split()) for d in penalized if not d["repeated"] and d["text"].strip()]
    assert len(set(kept)) == len(kept) >= 4
    state = engine.engine.sessions[sid].thinking
    assert len(state.units) >= 4
    assert state.repeated_units == len([d for d in penalized if d["repeated"]])
    assert len(penalized) == len(state.units) + state.dropped_units + state.repeated_units
    assert not set(state.units[0].ids) & set(state.units[1].ids)
    assert state.cache.length == state.units[-1].end


def test_dual_notes_rebuild_identically_from_the_same_inputs(parrot):
    """Invariant 4 for the notes: quotes, penalties and refusals depend only on the inputs, so
    the same inputs on the same schedule give the same notes, thinking cache and answer."""
    runs = []
    for _ in range(2):
        engine, sid, done = dual_feed(parrot, ROWS[:6], presence_penalty=1.0)
        session = engine.engine.sessions[sid]
        answer = result(engine.engine, engine.engine.query(sid, "Pressure?", SamplingParams(max_tokens=4)))
        runs.append((done, session.thinking.cache.snapshot(), answer.tokens, session.cache.snapshot()))
    (done_a, notes_a, answer_a, reading_a), (done_b, notes_b, answer_b, reading_b) = runs
    assert [{k: v for k, v in d.items()} for d in done_a] == done_b and answer_a == answer_b
    assert torch.equal(notes_a, notes_b) and torch.equal(reading_a, reading_b)


def sensor_rows(n: int, anomaly: int) -> list[str]:
    """A sensor's CSV-like rows: readings that drift a little, and one anomaly."""
    rows = []
    for i in range(1, n + 1):
        temp, pressure = (87.5, 940) if i == anomaly else (20 + (i * 7 % 10) / 10, 1010 + i % 4)
        rows.append(f"row {i}: sensor A temp={temp:.1f}C pressure={pressure}hPa\n")
    return rows


def test_embedded_model_notes_on_a_changing_sensor_feed_are_all_different(embedded):
    """The first day's feed on the embedded model with dual thinking at its defaults: rows that
    change, three per input, an anomaly at row 20. Today's code wrote the same note again and
    again ('* Sensor B: 20.' and 'Summary: * Sensor A: 20.' twice each in 8 notes); now each
    later unit quotes its own rows (and '20.' no longer ends a sentence), no kept note is blank
    and no two are equal."""
    from streamer.sessions.runner import ModelRunner

    runner = ModelRunner(embedded.model, embedded.tokenizer, embedded.name)
    rows = sensor_rows(24, anomaly=20)
    inputs = ["".join(rows[i:i + 3]) for i in range(0, len(rows), 3)]
    engine, sid, done = dual_feed(runner, inputs, unit_tokens=24, stop="sentence")
    assert len(done) == len(inputs) and [d["seq_range"] for d in done] == [[i, i] for i in range(1, 9)]
    kept = [" ".join(d["text"].split()) for d in done if not d.get("repeated")]
    assert all(kept) and len(set(kept)) == len(kept)
    state = engine.engine.sessions[sid].thinking
    assert state.cache.length == state.units[-1].end
    assert len(state.units) + state.dropped_units + state.repeated_units == len(inputs)


def test_a_decimal_point_does_not_end_a_sentence():
    """stop="sentence" ended the embedded model's notes at '* Sensor A: 19.' (a temperature cut
    at its decimal point); a '.' after a digit now ends a sentence only once whitespace follows."""
    from streamer.sessions.thinking import ends_sentence

    assert not ends_sentence("* Sensor A: 19.") and not ends_sentence("temp=19.5")
    assert ends_sentence("The temperature fell to 19. ") and ends_sentence("fell to 19.\n")
    assert ends_sentence("Ada keeps the light.") and ends_sentence("Who keeps it?") and ends_sentence("No! ")
    assert not ends_sentence("Summary:\n")
