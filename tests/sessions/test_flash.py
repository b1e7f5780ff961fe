"""Flash questions: batched evaluation equals on-demand answers (on the fp32 oracle, and bit
for bit on the native int4 stack), pushes only on change, hysteresis, stale evaluations never
mislabelled, limits."""

import time

import pytest
from helpers import Sync, driven, require_native, result, wait_until

from streamer.sessions.errors import EngineError
from streamer.sessions.flash import FlashAnswer, FlashJob, FlashQuestion, normalize
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.query import QueryJob
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session

QUESTIONS = ["Who keeps the light?", "What is the cat called?", "When does the boat come?",
             "How many barrels of oil?"]
TEXT = ["The keeper is Ada Morrow. ", "Her cat is Pepper. ", "The boat Marigold comes on Tuesdays. ",
        "There are twelve barrels of oil. "]


@pytest.fixture(scope="module")
def native_tiny(tokenizer):
    """A tiny int4 model on the native stack, head_dim 64 (its SIMD attention path)."""
    require_native()
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner
    from streamer.sessions.weights import apply_weights

    lm = build_tiny_model(tokenizer, seed=1234, hidden=256, heads=4, kv_heads=2)
    return ModelRunner(lm.model, tokenizer, lm.name, apply_weights(lm.model, "int4", native=True)), None


@pytest.fixture(params=["tiny", "native_tiny"])
def either(request):
    """The fp32 tiny model (the oracle) and the native int4 stack."""
    return request.getfixturevalue(request.param)


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
def test_flash_answer_equals_on_demand_answer(either, budget):
    runner, _ = either
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


def test_batched_equals_single_evaluations(either):
    runner, _ = either
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
    assert answer.logit_gap > 0 and 0 < answer.mean_prob <= 1  # float logits do not tie at the top
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
    Sync(engine).add_listener(sid, lambda event, payload: event == "flash.updated" and updates.append((event, payload)))
    return updates


def test_engine_evaluates_after_updates_and_answers_from_cache(tiny):
    runner, _ = tiny
    engine = driven(runner)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    updates = collect(engine, sid)
    state = sync.register_flash(sid, QUESTIONS[0], max_tokens=10)
    assert state["flash_id"] == "f1"
    engine.run_until_idle()
    assert updates == [] and engine.stats.flash_evaluations == 0  # no answers from no data
    sync.append(sid, TEXT[0])
    assert engine.stats.flash_questions_evaluated == 1 and len(updates) == 1
    assert updates[0][1]["data_version"] == 1
    # staleness runs from the data's acceptance to the answer, so it spans the evaluation
    assert updates[0][1]["staleness_ms"] >= updates[0][1]["eval_ms"] - 0.1 and updates[0][1]["staleness_ms"] > 0
    session = engine.sessions[sid]
    q = session.flash.questions["f1"]
    assert q.answer.data_version == 1
    # asking the registered question returns the cached, current answer without the model
    steps = engine.stats.steps
    cached = result(engine, engine.query(sid, QUESTIONS[0].upper(), SamplingParams(max_tokens=10)))
    assert cached.cached and cached.text == q.answer.text and cached.data_version == 1
    assert engine.stats.steps == steps  # no model step
    assert cached.tokens == on_demand(runner, session, QUESTIONS[0], 10).tokens
    # a different max_tokens (when the answer was cut by length) or sampling is not served from cache
    if q.answer.finish_reason == "length":
        assert not result(engine, engine.query(sid, QUESTIONS[0], SamplingParams(max_tokens=11))).cached
    assert not result(engine, engine.query(sid, QUESTIONS[0], SamplingParams(max_tokens=10, temperature=0.5))).cached
    # revising to the same text bumps the version but not the answer: no push
    pushed = engine.stats.flash_pushed
    sync.revise(sid, TEXT[0])
    assert q.evaluated_version == 2
    assert engine.stats.flash_pushed == pushed
    state = sync.session_state(sid)["flash"][0]
    assert state["data_version"] == 2 and state["staleness"]["versions"] == 0 and state["history"]


def test_stale_evaluations_are_labelled_with_the_data_they_saw(tiny):
    """Data pushed while an evaluation runs never yields an answer labelled with the newer
    version: every evaluation (pushed or not) equals a fresh evaluation on the data of the
    version it is labelled with, confidence included (which depends on every context token)."""
    runner, _ = tiny
    engine = driven(runner, step_tokens=6)  # slow evaluations: many steps each
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    seen = []
    sync.add_listener(sid, lambda event, payload: event == "flash.updated" and seen.append(payload))
    sync.register_flash(sid, QUESTIONS[1], max_tokens=12)
    sync.register_flash(sid, QUESTIONS[2], max_tokens=12)
    session = engine.sessions[sid]
    lanes = engine.core.lanes
    for chunk in TEXT * 2:  # each chunk lands while an evaluation of the data before it runs
        acked = engine.append(sid, chunk)
        while not (acked.done() and lanes.running(sid, "flash") and lanes.side[sid]["flash"].version == session.data_version):
            assert engine.step()
        for _ in range(3):
            engine.step()
    sync.append(sid, "End. ")
    assert all(q.evaluated_version == session.data_version for q in session.flash.questions.values())
    chunks = [c.text for c in session.chunks]
    for q in session.flash.questions.values():
        versions = [v for v, _, _, _ in q.history]
        assert len(set(versions)) > 3 and versions[-1] == session.data_version
        for version, gap, prob, _ in q.history:
            reference = build(runner, chunks[:version])
            fresh = run_flash(runner, reference, [flash_question(reference, q.question, max_tokens=12)])["f"]
            assert abs(gap - fresh.logit_gap) < 1e-3 and abs(prob - fresh.mean_prob) < 1e-4, (q.question, version)
    for payload in seen:
        reference = build(runner, chunks[:payload["data_version"]])
        assert payload["answer"] == on_demand(runner, reference, payload["question"], 12).text, payload


def test_revise_cancels_a_running_evaluation(tiny):
    runner, _ = tiny
    engine = driven(runner, step_tokens=4)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, TEXT[0] + TEXT[1])
    seen = []
    sync.add_listener(sid, lambda e, p: e == "flash.updated" and seen.append(p))
    engine.register_flash(sid, QUESTIONS[0], max_tokens=30).result(0)
    while not engine.core.lanes.running(sid, "flash"):
        assert engine.step()
    engine.step()
    evaluation = engine.core.lanes.side[sid]["flash"]
    assert evaluation.forks[0].fed > 0 and not evaluation.done  # mid-evaluation
    sync.revise(sid, "The keeper is Owen Pike. ")
    session = engine.sessions[sid]
    assert session.flash.questions["f1"].evaluated_version == session.data_version
    reference = build(runner, [c.text for c in session.chunks])
    expected = on_demand(runner, reference, QUESTIONS[0], 30).text
    assert session.flash.questions["f1"].answer.text == expected
    assert engine.stats.flash_cancelled == 1
    assert [p["data_version"] for p in seen] == [2]  # the evaluation of version 1 never landed
    assert seen[-1]["answer"] == expected


def test_registration_limits_and_unregister(tiny):
    runner, _ = tiny
    engine = driven(runner, max_flash_per_session=2, max_answer_tokens=64)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "Some data. ")
    sync.register_flash(sid, "Who?", flash_id="a")
    with pytest.raises(EngineError) as exc:
        sync.register_flash(sid, " who ")
    assert exc.value.code == "flash_duplicate" and "'a'" in str(exc.value)
    with pytest.raises(EngineError) as exc:
        sync.register_flash(sid, "Other?", flash_id="a")
    assert exc.value.code == "flash_duplicate"
    for bad, match in [({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 65}, "max_tokens"),
                       ({"confirm": 0}, "confirm"), ({"min_interval_s": -1}, "min_interval")]:
        with pytest.raises(EngineError, match=match):
            sync.register_flash(sid, "Where?", **bad)
    with pytest.raises(EngineError, match="empty"):
        sync.register_flash(sid, "   ")
    sync.register_flash(sid, "What?", flash_id="b")
    with pytest.raises(EngineError) as exc:
        sync.register_flash(sid, "When?")
    assert exc.value.code == "flash_limit" and "2 flash questions" in str(exc.value)
    sync.unregister_flash(sid, "a")
    sync.unregister_flash(sid, "b")
    with pytest.raises(EngineError) as exc:
        sync.unregister_flash(sid, "b")
    assert exc.value.code == "flash_not_found"
    evaluated = engine.stats.flash_questions_evaluated
    sync.append(sid, "New data. ")
    assert engine.stats.flash_questions_evaluated == evaluated  # nothing registered, nothing evaluated
    assert engine.stats.flash_evaluations == 2 and not engine.step()  # one per registration, none since


def test_min_interval_spaces_evaluations(tiny):
    runner, _ = tiny
    engine = driven(runner)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "a ")
    sync.register_flash(sid, QUESTIONS[0], max_tokens=4, min_interval_s=0.5)
    q = engine.sessions[sid].flash.questions["f1"]
    assert q.evaluations == 1
    first = q.last_eval_at
    sync.append(sid, "x ")
    assert q.evaluations == 1  # due only after its interval
    wait = engine.core.next_wakeup()
    assert 0 < wait <= 0.5
    wait_until(lambda: engine.core.next_wakeup() == 0, timeout=5, what="the interval to pass")
    engine.run_until_idle()
    assert q.evaluations == 2 and q.last_eval_at - first >= 0.5
