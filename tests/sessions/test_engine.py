"""The engine: ordering, packing many sessions into one step, errors, limits. Driven by hand
(`step()` / `run_until_idle()`), except where the thread itself is under test."""

import pytest
import torch
from helpers import Sync, driven, result

from streamer.sessions.errors import ContextOverflow, EngineError, InputEnded, SessionNotFound
from streamer.sessions.jobs import PrefillJob
from streamer.sessions.query import QueryJob
from streamer.sessions.sampling import SamplingParams

DOCS = ["The keeper is Ada. The cat is Pepper. " * 3, "Boats: Marigold on Tuesday, Heron on Friday. " * 5,
        "One line.", "Numbers: " + ", ".join(str(i) for i in range(60))]


def ask(engine, sid, question, **params):
    return engine.query(sid, question, SamplingParams(**params))


def test_sessions_packed_together_answer_as_alone(tiny):
    """Many sessions of different lengths, appends and questions interleaved, packed into shared
    steps with a small budget (chunked prefill), give exactly the answers each gets alone."""
    runner, _ = tiny
    alone = {}
    solo = Sync(driven(runner, step_tokens=1024))
    for i, doc in enumerate(DOCS):
        sid = solo.create_session()["session_id"]
        solo.append(sid, doc)
        first = result(solo.engine, ask(solo.engine, sid, f"Question {i}?", max_tokens=12)).tokens
        solo.append(sid, " More text.")
        alone[i] = (first, result(solo.engine, ask(solo.engine, sid, "And now?", max_tokens=12)).tokens)

    packed = driven(runner, step_tokens=24)
    sids = [Sync(packed).create_session()["session_id"] for _ in DOCS]
    firsts = []
    for i, doc in enumerate(DOCS):  # submit everything before running anything
        packed.append(sids[i], doc)
        firsts.append(ask(packed, sids[i], f"Question {i}?", max_tokens=12))
        packed.append(sids[i], " More text.")
    seconds = [ask(packed, sid, "And now?", max_tokens=12) for sid in sids]
    packed.run_until_idle()
    for i in range(len(DOCS)):
        assert (firsts[i].future.result(0).tokens, seconds[i].future.result(0).tokens) == alone[i]
    stats = packed.snapshot_stats()
    assert stats["step_sequences"] > stats["steps"]  # some steps carried several sessions


def test_question_sees_all_input_submitted_before_it(tiny):
    engine = Sync(driven(tiny[0]))
    sid = engine.create_session()["session_id"]
    for k in range(5):
        engine.engine.append(sid, f"chunk {k} ")
    answer = result(engine.engine, ask(engine.engine, sid, "Count?", max_tokens=2))
    assert answer.data_version == 5
    assert answer.context_tokens == engine.session_state(sid)["tokens"]


def test_errors_and_survival(tiny):
    engine = Sync(driven(tiny[0], max_context_tokens=120, max_sessions=2))
    sid = engine.create_session()["session_id"]
    engine.append(sid, "Kept. ")
    with pytest.raises(ContextOverflow, match="window of 120 tokens"):
        engine.append(sid, "word " * 200)
    with pytest.raises(SessionNotFound):
        engine.append("missing", "x")
    with pytest.raises(EngineError, match="empty"):
        engine.append(sid, "")
    engine.create_session()
    with pytest.raises(EngineError) as exc:
        engine.create_session()
    assert exc.value.code == "too_many_sessions"
    engine.end_input(sid)
    with pytest.raises(InputEnded):
        engine.append(sid, "more")
    assert engine.session_state(sid)["inputs"] == 1
    assert result(engine.engine, ask(engine.engine, sid, "Still fine?", max_tokens=3)).tokens


def test_stop_strings_and_seeded_sampling(tiny):
    engine = Sync(driven(tiny[0]))
    sid = engine.create_session()["session_id"]
    engine.append(sid, "Some text to talk about.")

    def answer(**params):
        return result(engine.engine, ask(engine.engine, sid, params.pop("q", "Say something."), **params))

    free = answer(max_tokens=20)
    stop = free.text[3:6]
    cut = answer(max_tokens=20, stop=[stop])
    assert cut.finish_reason == "stop_string" and cut.text == free.text[:free.text.find(stop)]
    a = answer(q="Pick.", max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    b = answer(q="Pick.", max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=3)
    assert a.tokens == b.tokens
    with pytest.raises(EngineError, match="top_p"):
        answer(q="Pick.", top_p=0.0)


def test_close_cancels_queued_work_and_frees_the_session(tiny):
    engine = driven(tiny[0])
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    pending = [engine.append(sid, "text " * 50) for _ in range(20)]
    engine.step()  # one step's worth of appends runs; the rest still wait
    sync.close_session(sid)
    assert sid not in engine.sessions
    outcomes = [f.exception(0) for f in pending]
    ran = sum(e is None for e in outcomes)
    assert 1 <= ran < len(outcomes) and all(e is None for e in outcomes[:ran])  # in the cache before the close
    assert all(isinstance(e, EngineError) and e.code == "session_closed" for e in outcomes[ran:])
    for _ in range(30):  # create/close cycles leave nothing behind
        sync.close_session(sync.create_session()["session_id"])
    assert engine.sessions == {} and engine.snapshot_stats()["queued_jobs"] == 0
    assert engine.pool.free_blocks() == engine.pool.num_blocks


def test_stopped_engine_refuses_work(tiny, engine_factory):
    engine = engine_factory(tiny[0])  # started: the thread is under test
    engine.stop()
    with pytest.raises(EngineError) as exc:
        engine.create_session().result(timeout=5)
    assert exc.value.code == "engine_stopped" and not exc.value.recoverable


def test_work_waiting_when_the_engine_stops_fails_with_engine_stopped(tiny):
    engine = driven(tiny[0])
    sid = Sync(engine).create_session()["session_id"]
    waiting = engine.append(sid, "never run ")
    engine.stop()
    assert waiting.exception(0).code == "engine_stopped"


def test_a_backlog_of_appends_is_prefilled_in_few_steps_and_stays_exact(tiny):
    runner, ref = tiny
    engine = driven(runner, step_tokens=512)
    sid = Sync(engine).create_session()["session_id"]
    steps_before = engine.stats.steps
    pieces = [f"Piece number {i} of the stream. " for i in range(40)]
    futures = [engine.append(sid, p) for p in pieces]
    engine.run_until_idle()
    acks = [f.result(0) for f in futures]
    assert [a.seq for a in acks] == list(range(1, 41))
    assert engine.stats.steps - steps_before == 1  # 40 appends (430 tokens) fit one 512-token step
    session = engine.sessions[sid]
    with torch.inference_mode():
        full = ref(torch.tensor([session.context_ids()])).logits[0, -1].float()
    assert (session.last_logits - full).abs().max().item() <= 1e-4
    spans = [(c.start, c.end) for c in session.chunks]
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))


def test_waiting_jobs_age_into_higher_classes(tiny):
    engine = driven(tiny[0], aging_s=2.0)
    sid = Sync(engine).create_session()["session_id"]
    session = engine.sessions[sid]
    ingest = PrefillJob(session, [1, 2], "x")
    query = QueryJob(session, "q", "Q?", SamplingParams(), frozenset())
    ingest.order, query.order = 1, 2
    rank, now = engine.core.scheduler.rank, ingest.waiting_since
    assert rank(query, now) < rank(ingest, now)  # a fresh question goes first
    assert rank(ingest, now + 4.5) < rank(query, now)  # ingest waiting 4.5 s overtakes it
    ingest.abort()


def test_a_caller_that_gives_up_never_breaks_the_engine(tiny, engine_factory):
    engine = engine_factory(tiny[0])  # started: the thread must survive cancelled futures
    sid = engine.create_session().result()["session_id"]
    abandoned = [engine.session_state(sid) for _ in range(5)] + [engine.append(sid, "x ") for _ in range(5)]
    for fut in abandoned:
        fut.cancel()  # as when a client disconnects while its request waits
    assert engine.append(sid, "still working ").result(30).data_version >= 1
    assert engine._thread.is_alive()


def test_a_flash_question_that_cannot_fit_does_not_spin(tiny):
    engine = driven(tiny[0], max_context_tokens=120)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "word " * 60)
    sync.register_flash(sid, "A question " * 6, max_tokens=4)
    assert engine.run_until_idle(max_steps=50) < 50  # it goes idle: no evaluation loop
    assert engine.stats.flash_evaluations == 1  # evaluated (skipped: no room) once
    assert engine.sessions[sid].flash.questions["f1"].answer is None


def test_an_engine_not_started_does_nothing_until_stepped(tiny):
    engine = driven(tiny[0])
    created = engine.create_session()
    assert not created.done()  # its framing is queued, not run
    assert engine.step() and created.result(0)["tokens"] > 0  # one step frames the session
    assert engine.run_until_idle() == 0  # and leaves nothing to run
    assert not engine.step()  # nothing left to run


def test_a_session_state_is_read_without_a_torch_call(tiny):
    """`session.get` is answered on the engine thread between steps; a torch call there releases
    the GIL, and while other connections keep the event loop busy each release waits up to a
    switch interval to get it back (a flood of `session.get` made the engine spend most of its
    time waiting in `KVShape.bytes_per_token`'s `torch.empty`: bench/fairness.py
    twenty_connections). Reading a session's state makes no torch call at all."""
    from torch.overrides import TorchFunctionMode

    class Calls(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    engine = Sync(driven(tiny[0]))
    sid = engine.create_session()["session_id"]
    engine.append(sid, "The keeper logged a storm.")
    with Calls() as calls:
        state = engine.engine.core.session_state(sid)
    assert calls.seen == []
    shape = tiny[0].kv_shape
    assert state["kv_bytes_per_token"] == shape.layers * 2 * shape.kv_heads * shape.head_dim * shape.dtype.itemsize
