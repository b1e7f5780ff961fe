"""The engine thread: ordering, packing many sessions into one step, errors, limits."""

import pytest

from streamer.sessions.errors import ContextOverflow, EngineError, InputEnded, SessionNotFound
from streamer.sessions.sampling import SamplingParams

DOCS = ["The keeper is Ada. The cat is Pepper. " * 3, "Boats: Marigold on Tuesday, Heron on Friday. " * 5,
        "One line.", "Numbers: " + ", ".join(str(i) for i in range(60))]


def answer(engine, sid, question, **params):
    return engine.query(sid, question, SamplingParams(**params)).future.result(timeout=60)


def test_sessions_packed_together_answer_as_alone(tiny, engine_factory):
    """Many sessions of different lengths, appends and questions interleaved, packed into shared
    steps with a small budget (chunked prefill), give exactly the answers each gets alone."""
    runner, _ = tiny
    alone = {}
    solo = engine_factory(runner, step_tokens=1024)
    for i, doc in enumerate(DOCS):
        sid = solo.create_session().result()["session_id"]
        solo.append(sid, doc).result()
        first = answer(solo, sid, f"Question {i}?", max_tokens=12).tokens
        solo.append(sid, " More text.").result()
        alone[i] = (first, answer(solo, sid, "And now?", max_tokens=12).tokens)
    solo.stop()

    packed = engine_factory(runner, step_tokens=24)
    sids = [packed.create_session().result()["session_id"] for _ in DOCS]
    firsts = []
    for i, doc in enumerate(DOCS):  # submit everything before waiting on anything
        packed.append(sids[i], doc)
        firsts.append(packed.query(sids[i], f"Question {i}?", SamplingParams(max_tokens=12)))
        packed.append(sids[i], " More text.")
    seconds = [packed.query(sid, "And now?", SamplingParams(max_tokens=12)) for sid in sids]
    for i in range(len(DOCS)):
        assert (firsts[i].future.result(60).tokens, seconds[i].future.result(60).tokens) == alone[i]
    stats = packed.snapshot_stats()
    assert stats["step_sequences"] > stats["steps"]  # some steps carried several sessions


def test_question_sees_all_input_submitted_before_it(tiny, engine_factory):
    engine = engine_factory(tiny[0])
    sid = engine.create_session().result()["session_id"]
    for k in range(5):
        engine.append(sid, f"chunk {k} ")
    result = answer(engine, sid, "Count?", max_tokens=2)
    assert result.data_version == 5
    assert result.context_tokens == engine.session_state(sid).result()["tokens"]


def test_errors_and_survival(tiny, engine_factory):
    engine = engine_factory(tiny[0], max_context_tokens=120, max_sessions=2)
    sid = engine.create_session().result()["session_id"]
    engine.append(sid, "Kept. ").result()
    with pytest.raises(ContextOverflow, match="context window is 120 tokens"):
        engine.append(sid, "word " * 200).result()
    with pytest.raises(SessionNotFound):
        engine.append("missing", "x").result()
    with pytest.raises(EngineError, match="empty"):
        engine.append(sid, "").result()
    engine.create_session().result()
    with pytest.raises(EngineError) as exc:
        engine.create_session().result()
    assert exc.value.code == "too_many_sessions"
    engine.end_input(sid).result()
    with pytest.raises(InputEnded):
        engine.append(sid, "more").result()
    assert engine.session_state(sid).result()["inputs"] == 1
    assert answer(engine, sid, "Still fine?", max_tokens=3).tokens


def test_stop_strings_and_seeded_sampling(tiny, engine_factory):
    engine = engine_factory(tiny[0])
    sid = engine.create_session().result()["session_id"]
    engine.append(sid, "Some text to talk about.").result()
    free = answer(engine, sid, "Say something.", max_tokens=20)
    stop = free.text[3:6]
    cut = answer(engine, sid, "Say something.", max_tokens=20, stop=[stop])
    assert cut.finish_reason == "stop_string" and cut.text == free.text[:free.text.find(stop)]
    a = answer(engine, sid, "Pick.", max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    b = answer(engine, sid, "Pick.", max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    assert a.tokens == b.tokens
    with pytest.raises(EngineError, match="top_p"):
        answer(engine, sid, "Pick.", top_p=0.0)


def test_close_cancels_queued_work_and_frees_the_session(tiny, engine_factory):
    engine = engine_factory(tiny[0])
    sid = engine.create_session().result()["session_id"]
    pending = [engine.append(sid, "text " * 50) for _ in range(20)]
    engine.close_session(sid).result()
    assert sid not in engine.sessions
    outcomes = [f.exception() for f in pending]
    assert any(isinstance(e, EngineError) and e.code == "session_closed" for e in outcomes)
    assert all(e is None or e.code == "session_closed" for e in outcomes)
    for _ in range(30):  # create/close cycles leave nothing behind
        engine.close_session(engine.create_session().result()["session_id"]).result()
    assert engine.sessions == {} and engine.snapshot_stats()["queued_jobs"] == 0


def test_stopped_engine_refuses_work(tiny, engine_factory):
    engine = engine_factory(tiny[0])
    engine.stop()
    with pytest.raises(EngineError) as exc:
        engine.create_session().result(timeout=5)
    assert exc.value.code == "engine_stopped" and not exc.value.recoverable


def test_a_backlog_of_appends_is_prefilled_in_few_steps_and_stays_exact(tiny, engine_factory):
    runner, ref = tiny
    engine = engine_factory(runner, step_tokens=512)
    sid = engine.create_session().result()["session_id"]
    steps_before = engine.stats.steps
    pieces = [f"Piece number {i} of the stream. " for i in range(40)]
    futures = [engine.append(sid, p) for p in pieces]
    acks = [f.result(60) for f in futures]
    assert [a.seq for a in acks] == list(range(1, 41))
    assert engine.stats.steps - steps_before < 10  # coalesced, not one forward per append
    session = engine.sessions[sid]
    import torch

    with torch.inference_mode():
        full = ref(torch.tensor([session.context_ids()])).logits[0, -1].float()
    assert (session.last_logits - full).abs().max().item() <= 1e-4
    spans = [(c.start, c.end) for c in session.chunks]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_waiting_jobs_age_into_higher_classes(tiny, engine_factory):
    from streamer.sessions.jobs import PrefillJob, QueryJob

    engine = engine_factory(tiny[0], aging_s=2.0)
    sid = engine.create_session().result()["session_id"]
    session = engine.sessions[sid]
    ingest = PrefillJob(session, [1, 2], "x")
    query = QueryJob(session, "q", "Q?", SamplingParams(), frozenset())
    ingest.order, query.order = 1, 2
    now = ingest.submitted_at
    assert engine._rank(query, now) < engine._rank(ingest, now)  # a fresh question goes first
    assert engine._rank(ingest, now + 4.5) < engine._rank(query, now)  # ingest waiting 4.5 s overtakes it
    ingest.abort()


def test_a_caller_that_gives_up_never_breaks_the_engine(tiny, engine_factory):
    engine = engine_factory(tiny[0])
    sid = engine.create_session().result()["session_id"]
    abandoned = [engine.session_state(sid) for _ in range(5)] + [engine.append(sid, "x ") for _ in range(5)]
    for fut in abandoned:
        fut.cancel()  # as when a client disconnects while its request waits
    assert engine.append(sid, "still working ").result(30).data_version >= 1
    assert engine._thread.is_alive()


def test_a_flash_question_that_cannot_fit_does_not_spin(tiny, engine_factory):
    import time

    engine = engine_factory(tiny[0], max_context_tokens=120)
    sid = engine.create_session().result()["session_id"]
    engine.append(sid, "word " * 60).result()
    engine.register_flash(sid, "A question " * 6, max_tokens=4).result()
    time.sleep(0.3)
    first = engine.stats.flash_evaluations
    time.sleep(0.5)
    assert engine.stats.flash_evaluations == first <= 2  # evaluated (skipped) once, not in a loop
