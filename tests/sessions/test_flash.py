"""Flash questions: batched evaluation equals on-demand answers, pushes only on change,
hysteresis, stale evaluations never mislabelled, limits."""

import time

import pytest

from streamer.sessions.errors import EngineError
from streamer.sessions.flash import FlashAnswer, FlashJob, FlashQuestion, normalize
from streamer.sessions.jobs import PrefillJob, QueryJob, drive
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session

QUESTIONS = ["Who keeps the light?", "What is the cat called?", "When does the boat come?",
             "How many barrels of oil?"]
TEXT = ["The keeper is Ada Morrow. ", "Her cat is Pepper. ", "The boat Marigold comes on Tuesdays. ",
        "There are twelve barrels of oil. "]


def build(runner, chunks):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    for chunk in chunks:
        drive(runner, PrefillJob(session, session.tokenize(chunk), chunk))
    return session


def flash_question(session, question, fid="f", max_tokens=12, **kw):
    return FlashQuestion(fid, question, session.question_ids(question), max_tokens, **kw)


def run_flash(runner, session, questions, budget=512):
    job = FlashJob(session, questions, frozenset([runner.tokenizer.eos_token_id]))
    while not job.done:
        steps = job.plan(budget)
        if steps:
            job.complete_many(runner.forward(steps, logits="last"))
    return {q.flash_id: a for q, a in job.results}


def on_demand(runner, session, question, max_tokens=12):
    job = QueryJob(session, "q", question, SamplingParams(max_tokens=max_tokens),
                   frozenset([runner.tokenizer.eos_token_id]))
    return drive(runner, job)


@pytest.mark.parametrize("budget", [512, 9])
def test_flash_answer_equals_on_demand_answer(tiny, budget):
    runner, _ = tiny
    session = build(runner, TEXT)
    before = session.cache.snapshot()
    questions = [flash_question(session, q, f"f{i}") for i, q in enumerate(QUESTIONS)]
    batched = run_flash(runner, session, questions, budget)
    for i, q in enumerate(QUESTIONS):
        expected = on_demand(runner, session, q)
        assert batched[f"f{i}"].tokens == expected.tokens, q
        assert batched[f"f{i}"].text == expected.text
        assert batched[f"f{i}"].data_version == session.data_version
    assert session.cache.snapshot().equal(before)  # forks never touch the session


def test_batched_equals_single_evaluations(tiny):
    runner, _ = tiny
    session = build(runner, TEXT[:3])
    questions = [flash_question(session, q, f"f{i}", max_tokens=8 + i) for i, q in enumerate(QUESTIONS)]
    batched = run_flash(runner, session, questions)
    for q in questions:
        single = run_flash(runner, session, [q])
        assert single[q.flash_id].tokens == batched[q.flash_id].tokens
        assert abs(single[q.flash_id].logit_gap - batched[q.flash_id].logit_gap) < 1e-3
        assert abs(single[q.flash_id].mean_prob - batched[q.flash_id].mean_prob) < 1e-4


def test_confidence_fields(tiny):
    runner, _ = tiny
    session = build(runner, TEXT)
    answer = run_flash(runner, session, [flash_question(session, QUESTIONS[0])])["f"]
    assert answer.logit_gap >= 0 and 0 < answer.mean_prob <= 1
    assert answer.eval_s > 0 and answer.finish_reason in ("stop", "length")


def answer(text, version):
    return FlashAnswer(text, [1], version, 1.0, 0.5, 0.01, time.time(), "stop")


def test_push_only_on_change_and_hysteresis():
    q = FlashQuestion("f", "q?", [1])
    assert q.observe(answer("Ada.", 1))  # first answer is pushed
    assert not q.observe(answer("ada", 2))  # same after normalization: not pushed
    assert q.answer.data_version == 2  # but the current answer is fresher
    assert q.observe(answer("Owen", 3))  # a change: pushed at once with confirm=1

    h = FlashQuestion("h", "q?", [1], confirm=3)
    assert h.observe(answer("Ada", 1))
    assert not h.observe(answer("Owen", 2))
    assert not h.observe(answer("Owen", 3))
    assert h.observe(answer("Owen", 4))  # third in a row
    assert not h.observe(answer("Ada", 5))
    assert not h.observe(answer("Owen", 6))  # flicker back to the pushed answer resets the count
    assert not h.observe(answer("Ada", 7))
    assert not h.observe(answer("Ada", 8))
    assert h.observe(answer("Ada", 9))
    assert normalize("  The  Boat. ") == "the boat"


def collect(engine, sid):
    updates = []
    engine.add_listener(sid, lambda event, payload: updates.append((event, payload))).result()
    return updates


def wait_for(pred, timeout=60):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_engine_evaluates_after_updates_and_answers_from_cache(tiny, engine_factory):
    runner, _ = tiny
    engine = engine_factory(runner)
    sid = engine.create_session().result()["session_id"]
    updates = collect(engine, sid)
    state = engine.register_flash(sid, QUESTIONS[0], max_tokens=10).result()
    assert state["flash_id"] == "f1"
    wait_for(lambda: len(updates) == 1)  # evaluated on the (empty) data at once
    engine.append(sid, TEXT[0]).result()
    wait_for(lambda: engine.stats.flash_questions_evaluated >= 2)
    session = engine.sessions[sid]
    q = session.flash["f1"]
    assert q.answer.data_version == 1
    # asking the registered question returns the cached, current answer without the model
    result = engine.query(sid, QUESTIONS[0].upper(), SamplingParams(max_tokens=10)).future.result()
    assert result.cached and result.text == q.answer.text and result.data_version == 1
    assert result.tokens == on_demand(runner, session, QUESTIONS[0], 10).tokens
    # a different max_tokens (when the answer was cut by length) or sampling is not served from cache
    if q.answer.finish_reason == "length":
        assert not engine.query(sid, QUESTIONS[0], SamplingParams(max_tokens=11)).future.result().cached
    assert not engine.query(sid, QUESTIONS[0], SamplingParams(max_tokens=10, temperature=0.5)).future.result().cached
    # revising to the same text bumps the version but not the answer: no push
    pushed = engine.stats.flash_pushed
    engine.revise(sid, TEXT[0]).result()
    wait_for(lambda: q.evaluated_version == 2)
    assert engine.stats.flash_pushed == pushed
    state = engine.session_state(sid).result()["flash"][0]
    assert state["data_version"] == 2 and state["staleness"]["versions"] == 0 and state["history"]


def test_stale_evaluations_are_labelled_with_the_data_they_saw(tiny, engine_factory):
    """Data pushed while an evaluation runs never yields an answer labelled with the newer
    version: every pushed answer equals the on-demand answer on the data of its version."""
    runner, _ = tiny
    engine = engine_factory(runner, step_tokens=6)  # slow evaluations: many steps each
    sid = engine.create_session().result()["session_id"]
    seen = []
    engine.add_listener(sid, lambda event, payload: seen.append(payload)).result()
    engine.register_flash(sid, QUESTIONS[1], max_tokens=12).result()
    engine.register_flash(sid, QUESTIONS[2], max_tokens=12).result()
    for chunk in TEXT * 2:
        engine.append(sid, chunk)
        time.sleep(0.005)
    engine.append(sid, "End. ").result()
    session = engine.sessions[sid]
    deadline = time.time() + 60
    while any(q.evaluated_version < session.data_version for q in session.flash.values()):
        assert time.time() < deadline
        time.sleep(0.02)
    evaluated = [(q, q.history) for q in session.flash.values()]
    chunks = [c.text for c in session.chunks]
    versions = {p["data_version"] for p in seen}
    assert max(versions) == session.data_version
    for payload in seen:
        reference = build(runner, chunks[:payload["data_version"]])
        expected = on_demand(runner, reference, payload["question"], 12)
        assert payload["answer"] == expected.text, payload
    assert evaluated


def test_revise_cancels_a_running_evaluation(tiny, engine_factory):
    runner, _ = tiny
    engine = engine_factory(runner, step_tokens=4)
    sid = engine.create_session().result()["session_id"]
    engine.append(sid, TEXT[0] + TEXT[1]).result()
    seen = []
    engine.add_listener(sid, lambda e, p: seen.append(p)).result()
    engine.register_flash(sid, QUESTIONS[0], max_tokens=30).result()
    wait_for(lambda: sid in engine._flash and engine._flash[sid].forks[0].fed > 0)  # mid-evaluation
    engine.revise(sid, "The keeper is Owen Pike. ").result()
    session = engine.sessions[sid]
    deadline = time.time() + 60
    while session.flash["f1"].evaluated_version < session.data_version:
        assert time.time() < deadline
        time.sleep(0.02)
    reference = build(runner, [c.text for c in session.chunks])
    final = [p for p in seen if p["data_version"] == session.data_version]
    expected = on_demand(runner, reference, QUESTIONS[0], 30).text
    assert session.flash["f1"].answer.text == expected
    assert engine.stats.flash_cancelled == 1
    assert all(p["data_version"] == 2 for p in seen)  # the evaluation of version 1 never landed
    assert final or session.flash["f1"].answer.text == seen[-1]["answer"]


def test_registration_limits_and_unregister(tiny, engine_factory):
    runner, _ = tiny
    engine = engine_factory(runner, max_flash_per_session=2, max_answer_tokens=64)
    sid = engine.create_session().result()["session_id"]
    engine.register_flash(sid, "Who?", flash_id="a").result()
    with pytest.raises(EngineError) as exc:
        engine.register_flash(sid, " who ").result()
    assert exc.value.code == "flash_duplicate" and "'a'" in str(exc.value)
    with pytest.raises(EngineError) as exc:
        engine.register_flash(sid, "Other?", flash_id="a").result()
    assert exc.value.code == "flash_duplicate"
    for bad, match in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 65}, "max_tokens"),
                       ({"confirm": 0}, "confirm"), ({"min_interval_s": -1}, "min_interval")]:
        with pytest.raises(EngineError, match=match):
            engine.register_flash(sid, "Where?", **bad).result()
    with pytest.raises(EngineError, match="empty"):
        engine.register_flash(sid, "   ").result()
    engine.register_flash(sid, "What?", flash_id="b").result()
    with pytest.raises(EngineError) as exc:
        engine.register_flash(sid, "When?").result()
    assert exc.value.code == "flash_limit" and "2 flash questions" in str(exc.value)
    engine.unregister_flash(sid, "a").result()
    engine.unregister_flash(sid, "b").result()
    with pytest.raises(EngineError) as exc:
        engine.unregister_flash(sid, "b").result()
    assert exc.value.code == "flash_not_found"
    evaluated = engine.stats.flash_questions_evaluated
    engine.append(sid, "New data. ").result()
    time.sleep(0.3)
    assert engine.stats.flash_questions_evaluated == evaluated  # nothing registered, nothing evaluated


def test_min_interval_spaces_evaluations(tiny, engine_factory):
    runner, _ = tiny
    engine = engine_factory(runner)
    sid = engine.create_session().result()["session_id"]
    engine.register_flash(sid, QUESTIONS[0], max_tokens=4, min_interval_s=0.5).result()
    q = engine.sessions[sid].flash["f1"]
    deadline = time.time() + 30
    while q.evaluations < 1:
        assert time.time() < deadline
        time.sleep(0.01)
    first = q.last_eval_at
    engine.append(sid, "x ").result()
    while q.evaluations < 2:
        assert time.time() < deadline
        time.sleep(0.01)
    assert q.last_eval_at - first >= 0.5
