"""Bounded sessions: sinks + recent inputs, evicted by a copy and re-anchored by key rotation.

Rotation is exact: with one layer a cache's K/V depend only on each token and its position, so
the evicted-and-rotated cache must equal a fresh prefill of the kept inputs at their new
positions; with more layers the first layer's keys must. Replay evicts the same inputs."""

import pytest
from helpers import Sync, driven, result

from streamer.sessions.errors import ContextOverflow, InvalidRequest
from streamer.sessions.forks import fork_view
from streamer.sessions.models import build_tiny_model
from streamer.sessions.runner import ModelRunner
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.window import DEFAULT_WINDOW_TOKENS, default_size

LINES = [f"[video {i * 0.5:.1f}s] colours: {c} 90%; brightness dim; motion low.\n"
         for i, c in enumerate(["red", "blue", "green", "grey", "white", "pink"] * 20)]


def fresh_cache(runner, ids):
    """A private cache holding a fresh prefill of `ids` at positions 0.. (and its last logits)."""
    from streamer.sessions.runner import SeqStep

    cache = runner.new_cache(len(ids) + 1)
    logits = runner.forward([SeqStep(cache, 0, ids)], logits="last")[0]
    cache.commit(len(ids))
    return cache, logits


@pytest.fixture(scope="module")
def one_layer(tokenizer):
    lm = build_tiny_model(tokenizer, seed=7, layers=1)
    return ModelRunner(lm.model, tokenizer, lm.name)


def stream(engine, sid, lines):
    return [engine.append(sid, line) for line in lines]


def test_eviction_by_rotation_equals_a_fresh_prefill_of_the_kept_inputs(one_layer):
    engine = Sync(driven(one_layer, step_tokens=64))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    state = engine.configure_window(sid, max_tokens=prefix + 200, keep_tokens=prefix + 120, sink_inputs=1)
    assert state["window"]["max_tokens"] == prefix + 200 and not state["window"]["default"]
    acks = stream(engine, sid, LINES[:60])
    session = engine.engine.sessions[sid]
    window = session.window
    assert window.slides >= 3 and window.dropped_inputs > 0 and window.moved_tokens > 0
    assert max(a.total_tokens for a in acks) <= prefix + 200
    # every evicted input was reported once, in order, by the input that made room
    evicted = [seq for a in acks for seq in a.evicted_seqs]
    assert evicted == list(range(2, 2 + window.dropped_inputs))
    # the sink stays, the newest inputs are kept in order, positions contiguous
    assert session.chunks[0].text == LINES[0]
    assert [c.text for c in session.chunks[1:]] == LINES[60 - len(session.chunks) + 1:60]
    pos = len(session.prefix_ids)
    for chunk in session.chunks:
        assert chunk.start == pos
        pos += len(chunk.tokens)
    assert session.cache.length == pos == len(session.context_ids())
    # exact: the whole moved-and-rotated cache is what a fresh prefill of the kept tokens holds
    fresh, _ = fresh_cache(one_layer, session.context_ids())
    got, want = session.cache.snapshot(), fresh.snapshot()
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4
    # and the next input's logits equal the fresh session's
    engine.append(sid, "and then a bright light.")
    _, expected = fresh_cache(one_layer, session.context_ids())
    assert (session.last_logits.float() - expected.float()).abs().max().item() <= 1e-4


def test_a_deep_model_keeps_its_first_layer_exact_and_answers(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=128))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    engine.configure_window(sid, max_tokens=prefix + 240)
    stream(engine, sid, LINES[:80])
    session = engine.engine.sessions[sid]
    assert session.window.slides >= 2
    fresh, _ = fresh_cache(runner, session.context_ids())
    layer0 = session.cache.snapshot()[0]  # layer 0's keys and values depend only on token and position
    assert (layer0 - fresh.snapshot()[0]).abs().max().item() <= 1e-4
    answer = result(engine.engine, engine.engine.query(sid, "What colour?"))
    assert answer.context_tokens == session.cache.length and answer.tokens


def test_a_long_stream_stays_bounded_in_tokens_and_memory(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=128))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    bound = prefix + 160
    engine.configure_window(sid, max_tokens=bound)
    futures = [engine.engine.append(sid, LINES[i % len(LINES)]) for i in range(600)]  # queued faster than read
    engine.engine.run_until_idle()
    results = [f.result(0) for f in futures]
    state = engine.session_state(sid)
    assert max(r.total_tokens for r in results) <= bound and state["tokens"] <= bound
    session = engine.engine.sessions[sid]
    assert session.cache.capacity <= bound + 16  # whole pool blocks, never past the bound
    assert state["window"]["dropped_inputs"] == 600 - len(session.chunks)
    assert sorted(s for r in results for s in r.evicted_seqs) == list(range(2, 2 + state["window"]["dropped_inputs"]))


def test_every_session_is_bounded_by_default_and_null_is_unbounded(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    limits = engine.engine.limits
    state = engine.create_session()
    window = state["window"]
    assert window["default"] and window["max_tokens"] == default_size(limits, runner.context_window)
    assert window["max_tokens"] <= DEFAULT_WINDOW_TOKENS
    assert runner.context_window - window["max_tokens"] >= min(limits.max_question_tokens + limits.max_answer_tokens,
                                                             runner.context_window // 2)
    unbounded = engine.create_session(window=None)
    assert unbounded["window"] is None
    sid = unbounded["session_id"]
    with pytest.raises(ContextOverflow, match="context window"):
        for _ in range(400):
            engine.append(sid, LINES[0] * 3)
    # a session can also lift its bound later, or get one back
    other = engine.create_session()["session_id"]
    assert engine.configure_window(other, unbounded=True)["window"] is None
    assert engine.configure_window(other, max_tokens=300)["window"]["max_tokens"] == 300


def test_a_session_at_its_bound_still_answers(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=256))
    ctx = runner.context_window
    sid = engine.create_session(window={"max_tokens": ctx, "keep_tokens": ctx})["session_id"]
    for _ in range(40):  # ~60 tokens each: the cache ends within one input of the model's window
        engine.append(sid, LINES[3] * 4)
    before = engine.session_state(sid)
    assert before["tokens"] > ctx - 100 and before["window"]["slides"] >= 1
    params = SamplingParams(max_tokens=200)
    answer = result(engine.engine, engine.engine.query(sid, "What colour is it?", params))
    assert answer.finish_reason in ("stop", "length") and answer.tokens
    after = engine.session_state(sid)
    assert after["window"]["dropped_inputs"] > before["window"]["dropped_inputs"]  # it made room first
    # the next input reports what the question evicted
    ack = engine.append(sid, "more.")
    assert ack.evicted_seqs


def test_replay_evicts_the_same_inputs_and_rebuilds_the_same_cache(tiny):
    runner, _ = tiny
    original = Sync(driven(runner, step_tokens=64))
    sid = original.create_session(window={"max_tokens": 220, "keep_tokens": 150})["session_id"]
    log = []
    for i, line in enumerate(LINES[:50]):
        if i % 7 == 6:  # questions evict too, and are not in the log: the next input carries it
            result(original.engine, original.engine.query(sid, "Colour?"))
        ack = original.append(sid, line)
        log.append((line, ack.evicted_seqs))
    replay = Sync(driven(runner, step_tokens=512))  # other step sizes: appends join differently
    rid = replay.create_session(window={"max_tokens": 220, "keep_tokens": 150})["session_id"]
    futures = [replay.engine.append(rid, line, evict_first=ev) for line, ev in log]
    replay.engine.run_until_idle()
    assert [f.result(0).evicted_seqs for f in futures] == [ev for _, ev in log]
    a, b = original.engine.sessions[sid], replay.engine.sessions[rid]
    assert [c.seq for c in a.chunks] == [c.seq for c in b.chunks]
    assert (a.cache.snapshot() - b.cache.snapshot()).abs().max().item() <= 1e-5
    with pytest.raises(InvalidRequest, match="oldest evictable"):
        result(replay.engine, replay.engine.append(rid, "x", evict_first=[3]))


def test_dual_thinking_in_a_window_keeps_positions_bounded(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=128))
    sid = engine.create_session(window={"max_tokens": 260},
                                thinking={"mode": "dual", "unit_tokens": 8, "stop": "budget", "max_tokens": 96})
    sid = sid["session_id"]
    for line in LINES[:90]:
        engine.append(sid, line)
    engine.engine.run_until_idle()
    session = engine.engine.sessions[sid]
    state = session.thinking
    assert session.window.slides >= 3 and len(state.units) >= 3
    assert state.last_position < 260 + 96 + 64  # reading bound + thinking bound (+ a unit)
    for u, v in zip(state.units, state.units[1:]):
        assert u.positions[0] <= u.positions[1]
    answer = result(engine.engine, engine.engine.query(sid, "What colour?"))
    assert answer.tokens


def test_flash_questions_of_a_dual_session_evict_like_a_question_when_the_notes_fill_the_window(tiny):
    """Window 300 of a 400-token model and a thinking cache of 100 (+ a unit): the notes take
    positions after the reading cache, past what is left for a flash question. Its evaluation
    evicts old input first, as a question asked does, and answers the current data (it used to be
    skipped as no_room, so its answer stayed behind the data for good); the next input reports
    the inputs it evicted, so a replay evicts them too."""
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=128, max_context_tokens=400))
    sid = engine.create_session(window={"max_tokens": 300, "keep_tokens": 200},
                                thinking={"mode": "dual", "unit_tokens": 6, "stop": "budget"})["session_id"]
    rows = [f"{i:05d},station-{i % 4},{(i * 7) % 31 - 5}.5,{i % 50}\n" for i in range(24)]
    for row in rows:  # run until idle after each: a note after every row
        engine.append(sid, row)
    session = engine.engine.sessions[sid]
    question = "Which station is the coldest?"
    need = len(session.question_ids(question)) + 4
    assert fork_view(session).position + need > 400  # it cannot answer without evicting
    dropped = session.window.dropped_inputs
    engine.register_flash(sid, question, max_tokens=4)
    engine.engine.run_until_idle()
    (q,) = session.flash.questions.values()
    assert q.stale is None and q.answer is not None and q.answer.data_version == session.data_version
    assert session.window.dropped_inputs > dropped
    assert fork_view(session).position + need <= 400
    assert engine.append(sid, rows[0]).evicted_seqs


def test_window_refusals(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.configure_window(sid, max_tokens=prefix)
    with pytest.raises(InvalidRequest, match="keep_tokens"):
        engine.configure_window(sid, max_tokens=prefix + 100, keep_tokens=prefix + 101)
    with pytest.raises(InvalidRequest, match="no field"):
        engine.create_session(window={"max_tokens": 300, "size": 3})
    engine.configure_window(sid, max_tokens=prefix + 40)
    with pytest.raises(ContextOverflow, match="window"):
        engine.append(sid, "word " * 60)
    assert engine.append(sid, "still fine").seq == 1


def test_a_new_bound_takes_effect_at_its_turn_in_the_fifo(tiny):
    """A window set while inputs are queued evicts when its turn comes, after them: the same
    records queued at once (replay) or one by one evict the same inputs."""
    runner, _ = tiny

    def run(step_by_step: bool):
        engine = driven(runner, step_tokens=64)
        sid = Sync(engine).create_session()["session_id"]
        futures = []
        for i, line in enumerate(LINES[:30]):
            futures.append(engine.append(sid, line))
            if i == 20:
                futures.append(engine.configure_window(sid, max_tokens=200, keep_tokens=150))
            if step_by_step:
                engine.run_until_idle()
        engine.run_until_idle()
        session = engine.sessions[sid]
        return [c.seq for c in session.chunks], session.cache.snapshot(), futures[21].result(0)

    a_seqs, a_kv, resized = run(True)
    b_seqs, b_kv, _ = run(False)
    assert resized["tokens"] <= 200 and resized["window"]["slides"] >= 1 and resized["last_seq"] == 21
    assert a_seqs == b_seqs and (a_kv - b_kv).abs().max().item() <= 1e-5
