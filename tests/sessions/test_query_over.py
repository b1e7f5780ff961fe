"""Questions asked over what the session has read (`over="read"`) versus over everything sent
before them (`over="sent"`, the default): the engine driven by hand, so the backlog of unread
input is exact (appends submitted and not yet stepped), never a matter of timing."""

import pytest
import torch
from helpers import Sync, driven

from streamer.sessions.errors import Code, InvalidRequest
from streamer.sessions.sampling import SamplingParams

READ = ["The keeper is Ada. ", "The cat is Pepper. "]
BACKLOG = ["The boat is Marigold. ", "It sails on Tuesday. ", "The dog is Rex. ", "Rain at noon. "]


def ask(engine, sid, question, over="sent", **params):
    return engine.query(sid, question, SamplingParams(max_tokens=params.pop("max_tokens", 8), **params), over=over)


def reference(runner, inputs, question, step_tokens=512):
    """The answer of a session that got exactly `inputs` (and nothing else), asked the default way."""
    ref = Sync(driven(runner, step_tokens=step_tokens))
    sid = ref.create_session()["session_id"]
    for text in inputs:
        ref.append(sid, text)
    return ref.query(sid, question, SamplingParams(max_tokens=8))


def test_read_answers_ahead_of_the_backlog_over_what_was_read(tiny):
    runner, _ = tiny
    engine = driven(runner)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    for text in READ:
        sync.append(sid, text)
    session = engine.sessions[sid]
    read_tokens, before = session.cache.length, session.cache.snapshot()
    done = []
    acks = [engine.append(sid, text) for text in BACKLOG]  # queued, not read yet
    for i, fut in enumerate(acks):
        fut.add_done_callback(lambda _, i=i: done.append(f"input {i}"))
    backlog_tokens = sum(len(runner.tokenize(text)) for text in BACKLOG)
    assert engine.session_state(sid).result(0)["unread_tokens"] == backlog_tokens  # the backlog, in state
    read = ask(engine, sid, "Who is the keeper?", over="read")
    read.future.add_done_callback(lambda _: done.append("read"))
    sent = ask(engine, sid, "Who is the keeper?")
    while not read.future.done():
        assert engine.step(), "the engine went idle before the question over what was read was answered"
    assert done == ["read"]  # answered before any of the backlog was read
    assert session.cache.length == read_tokens and torch.equal(session.cache.snapshot(), before)  # no trace
    engine.run_until_idle()
    assert engine.session_state(sid).result(0)["unread_tokens"] == 0

    r, s = read.future.result(0), sent.future.result(0)
    assert (r.over, r.data_version, r.unread_inputs, r.context_tokens) == ("read", len(READ), len(BACKLOG), read_tokens)
    assert (s.over, s.data_version, s.unread_inputs) == ("sent", len(READ) + len(BACKLOG), 0)
    assert s.context_tokens == session.cache.length > r.context_tokens
    assert r.tokens == reference(runner, READ, "Who is the keeper?").tokens  # exactly the read inputs
    assert s.tokens == reference(runner, READ + BACKLOG, "Who is the keeper?").tokens


def test_read_never_sees_half_an_input(tiny):
    """An input the session is in the middle of reading (chunked prefill) is read to its end
    first; the backlog behind it is not waited for."""
    runner, _ = tiny
    engine = driven(runner, step_tokens=8, query_step_tokens=8)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, READ[0])
    session = engine.sessions[sid]
    long = "Numbers: " + ", ".join(str(i) for i in range(12)) + ". "
    engine.append(sid, long)
    rest = [engine.append(sid, text) for text in BACKLOG[:2]]
    engine.step()  # one chunk of `long` is in the cache, the rest of it is not
    assert session.data_version == 1 and session.pending_tokens > 0
    half = session.cache.length
    read = ask(engine, sid, "What numbers?", over="read")
    while not read.future.done():
        assert engine.step(), "the engine went idle before the question over what was read was answered"
    r = read.future.result(0)
    assert not any(f.done() for f in rest)
    assert (r.data_version, r.unread_inputs) == (2, 2)
    assert r.context_tokens == session.cache.length > half  # the whole of `long`, nothing of the backlog
    assert r.tokens == reference(runner, [READ[0], long], "What numbers?", step_tokens=8).tokens
    engine.run_until_idle()
    assert session.data_version == 4


def test_read_with_nothing_unread_is_the_sent_answer(tiny):
    runner, _ = tiny
    sync = Sync(driven(runner))
    sid = sync.create_session()["session_id"]
    for text in READ:
        sync.append(sid, text)
    read = sync.query(sid, "Who?", SamplingParams(max_tokens=6), over="read")
    sent = sync.query(sid, "Who?", SamplingParams(max_tokens=6))
    assert (read.over, read.unread_inputs, read.data_version) == ("read", 0, 2)
    assert (sent.over, sent.unread_inputs) == ("sent", 0)
    assert read.tokens == sent.tokens


@pytest.mark.parametrize("over", ["later", "", "SENT", None, 1])
def test_other_values_of_over_are_refused(tiny, over):
    runner, _ = tiny
    engine = driven(runner)
    sid = Sync(engine).create_session()["session_id"]
    handle = engine.query(sid, "Who?", SamplingParams(max_tokens=2), over=over)
    with pytest.raises(InvalidRequest) as info:
        handle.future.result(0)
    assert info.value.code == Code.INVALID_FIELD and info.value.param == "over" and info.value.recoverable
    assert "'sent', 'read'" in info.value.message
    assert engine.run_until_idle() == 0  # nothing was queued
