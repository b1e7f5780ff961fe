"""Repetition, presence and frequency penalties: their arithmetic, questions and flash questions
decoded with them equal a stateless greedy loop with the same penalties, a cached flash answer
serves only a question with the same penalties, and bad values are refused naming the field."""

import pytest
import torch
from helpers import Sync, driven
from streamer.sessions.errors import InvalidRequest
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.query import QueryJob, query
from streamer.sessions.sampling import Penalties, SamplingParams
from streamer.sessions.session import Session

from streamer.protocol import ProtocolError, ServerProtocol

TEXT = ("The lighthouse keeper was named Ada Morrow. She lived on Gull Island with a grey cat called "
        "Pepper. Every evening at six she lit the lamp.")
STRONG = {"repetition_penalty": 1.8, "presence_penalty": 0.3, "frequency_penalty": 0.2}


def test_penalties_arithmetic():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    out = Penalties(repetition_penalty=2.0).apply(logits, [0, 1, 1])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0]  # positive divided, negative multiplied, once per token
    out = Penalties(presence_penalty=0.5, frequency_penalty=0.25).apply(logits, [3, 3, 3, 2])
    assert out.tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 0.5 - 0.75]
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0]))  # the input is kept
    assert Penalties().apply(logits, [0, 1]) is logits and not Penalties().active


def _session(runner):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    drive(runner, PrefillJob(session, session.tokenize(TEXT), TEXT))
    return session


def _stateless_greedy(ref, ids, n, penalties):
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = ref(torch.tensor([ids + out])).logits[0, -1].float()
            out.append(int(penalties.apply(logits, out).argmax()))
    return out


def test_penalized_answer_equals_stateless_greedy_with_the_same_penalties(tiny):
    runner, ref = tiny
    session = _session(runner)
    question = "Who keeps the lighthouse?"
    ids = session.context_ids() + session.question_ids(question)
    plain = drive(runner, QueryJob(session, "a", question, SamplingParams(max_tokens=16), frozenset())).tokens
    penalized = drive(runner, QueryJob(session, "b", question, SamplingParams(max_tokens=16, **STRONG),
                                       frozenset())).tokens
    assert penalized == _stateless_greedy(ref, ids, 16, Penalties(**STRONG))
    assert plain == _stateless_greedy(ref, ids, 16, Penalties())
    assert penalized != plain  # the tiny model repeats itself; the penalties change its answer
    assert len(set(penalized)) > len(set(plain))


def test_flash_answers_use_their_penalties_and_cached_answers_need_the_same(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session()["session_id"]
    question = "Who keeps the lighthouse?"
    engine.register_flash(sid, question, max_tokens=12, **STRONG)
    engine.append(sid, TEXT)
    state = engine.session_state(sid)
    flash = state["flash"][0]
    assert flash["data_version"] == state["data_version"]
    assert {k: flash[k] for k in STRONG} == STRONG
    same = engine.query(sid, question, SamplingParams(max_tokens=12, **STRONG))
    assert same.cached and same.text == flash["answer"]
    other = engine.query(sid, question, SamplingParams(max_tokens=12, repetition_penalty=1.8))
    assert not other.cached
    unpenalized = engine.query(sid, question, SamplingParams(max_tokens=12))
    assert not unpenalized.cached and unpenalized.text != flash["answer"]
    longer = engine.query(sid, question, SamplingParams(max_tokens=13, **STRONG))  # past the cached answer
    cached_tokens = engine.engine.sessions[sid].flash[flash["flash_id"]].answer.tokens
    assert not longer.cached and longer.tokens[:len(cached_tokens)] == cached_tokens  # the model agrees


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0.0), ("repetition_penalty", 11.0),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3.0)])
def test_bad_penalties_name_their_field(tiny, field, value):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session()["session_id"]
    with pytest.raises(InvalidRequest) as err:
        query(engine.engine.core, sid, "Who?", SamplingParams(**{field: value}))
    assert err.value.param == field
    with pytest.raises(InvalidRequest) as err:
        engine.register_flash(sid, "Who?", **{field: value})
    assert err.value.param == field
    assert engine.session_state(sid)["flash"] == []  # refused, nothing registered


def test_the_protocol_carries_penalties_and_refuses_out_of_range():
    proto = ServerProtocol()
    cmd = proto.receive_text('{"type": "query.create", "session_id": "s", "question": "q", '
                             '"repetition_penalty": 1.3, "frequency_penalty": 0.5}')
    assert cmd.fields["repetition_penalty"] == 1.3 and cmd.fields["frequency_penalty"] == 0.5
    for kind in ("query.create", "flash.register"):
        with pytest.raises(ProtocolError) as err:
            proto.receive_text(f'{{"type": "{kind}", "session_id": "s", "question": "q", "presence_penalty": 7}}')
        assert err.value.param == "presence_penalty" and err.value.code == "invalid_field"


def test_a_logged_registration_keeps_its_penalties():
    """The event log's record carries them, so a replayed session decodes its flash answers alike."""
    from streamer.handlers import flash_args
    from streamer.records import FlashRegister, Record

    args = flash_args({"question": "Who?", "max_tokens": 8, **STRONG})
    record = FlashRegister.of(args, {"flash_id": "f1"})
    again = Record.from_json(record.to_json())
    assert again.arguments() == {"question": "Who?", "flash_id": "f1", "max_tokens": 8, **STRONG}
