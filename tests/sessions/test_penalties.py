"""Repetition, presence and frequency penalties and the end bias: their arithmetic, questions and
flash questions decoded with them equal a stateless greedy loop with the same penalties, a cached
flash answer serves only a question with the same penalties, and bad values are refused naming the
field."""

import pytest
import torch
from helpers import Sync, driven
from streamer.sessions.errors import InvalidRequest
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.query import QueryJob, query
from streamer.sessions.sampling import Penalties, SamplingParams, greedy
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


def test_greedy_picks_what_torch_argmax_picks():
    """The greedy pick (numpy's argmax on a CPU float32 row, torch's elsewhere): the first of equal
    maxima, a NaN taken as the maximum, a strided row of a larger tensor, other dtypes."""
    cases = [torch.tensor([1.0, 3.0, 3.0, 2.0]), torch.tensor([1.0, float("nan"), 5.0, float("nan")]),
             torch.tensor([-2.0, -1.0, -1.0]), torch.randn(7, 50).unbind(1)[3], torch.randn(50).bfloat16(),
             torch.randn(49152)]
    for logits in cases:
        assert greedy(logits) == int(torch.argmax(logits)), logits
    assert greedy(torch.tensor([1.0, 3.0, 3.0, 2.0])) == 1


def test_end_bias_arithmetic():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    assert Penalties(end_bias=1.5).apply(logits, [], {3, 1}).tolist() == [2.0, 0.5, 0.5, 4.5]  # from the first step
    out = Penalties(frequency_penalty=0.25, end_bias=-2.0).apply(logits, [0, 0], {1})
    assert out.tolist() == [1.5, -3.0, 0.5, 3.0]  # with the penalties, on the end ids only
    assert Penalties(end_bias=1.5).apply(logits, [0]) is logits  # no end ids: nothing to bias
    assert Penalties(end_bias=1.5).active and Penalties(end_bias=1.5) != Penalties()


def _session(runner):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    drive(runner, PrefillJob(session, session.tokenize(TEXT), TEXT))
    return session


def _stateless_greedy(ref, ids, n, penalties, stop_ids=frozenset()):
    out = []
    with torch.inference_mode():
        for _ in range(n):
            logits = ref(torch.tensor([ids + out])).logits[0, -1].float()
            token = int(penalties.apply(logits, out, stop_ids).argmax())
            if token in stop_ids:
                break
            out.append(token)
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


def _end_ids(runner):
    return frozenset({runner.tokenizer.eos_token_id})


def test_end_bias_ends_the_answer_sooner_and_equals_stateless_greedy(tiny):
    runner, ref = tiny
    session = _session(runner)
    question = "Who keeps the lighthouse?"
    ids = session.context_ids() + session.question_ids(question)
    stop = _end_ids(runner)
    plain = drive(runner, QueryJob(session, "a", question, SamplingParams(max_tokens=16), stop))
    # the tiny model's end-of-turn logit is far below its best: a bias of 8 lets it win somewhere
    ended = drive(runner, QueryJob(session, "b", question, SamplingParams(max_tokens=16, end_bias=8.0), stop))
    assert plain.finish_reason == "length" and len(plain.tokens) == 16
    assert ended.finish_reason == "stop" and len(ended.tokens) < 16
    assert ended.tokens == plain.tokens[:len(ended.tokens)]  # the same answer, ended where the bias let it
    assert ended.tokens == _stateless_greedy(ref, ids, 16, Penalties(end_bias=8.0), stop)
    longer = drive(runner, QueryJob(session, "c", question, SamplingParams(max_tokens=16, end_bias=-8.0), stop))
    assert longer.tokens == plain.tokens  # a negative bias keeps an answer that did not end going


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
    cached_tokens = engine.engine.sessions[sid].flash.questions[flash["flash_id"]].answer.tokens
    assert not longer.cached and longer.tokens[:len(cached_tokens)] == cached_tokens  # the model agrees


def test_a_flash_answer_ends_with_its_end_bias_and_serves_only_the_same_bias(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session()["session_id"]
    question = "Who keeps the lighthouse?"
    engine.register_flash(sid, question, max_tokens=16, end_bias=8.0)
    engine.append(sid, TEXT)
    flash = engine.session_state(sid)["flash"][0]
    assert flash["end_bias"] == 8.0
    answer = engine.engine.sessions[sid].flash.questions[flash["flash_id"]].answer
    asked = engine.query(sid, question, SamplingParams(max_tokens=16, end_bias=8.0))
    assert asked.cached and asked.text == flash["answer"] and answer.finish_reason == "stop"
    unbiased = engine.query(sid, question, SamplingParams(max_tokens=16))
    assert not unbiased.cached and len(unbiased.tokens) > len(answer.tokens)
    assert unbiased.tokens[:len(answer.tokens)] == answer.tokens


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0.0), ("repetition_penalty", 11.0),
                                         ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                         ("end_bias", 10.5), ("end_bias", -11.0)])
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
                             '"repetition_penalty": 1.3, "frequency_penalty": 0.5, "end_bias": 2}')
    assert cmd.fields["repetition_penalty"] == 1.3 and cmd.fields["frequency_penalty"] == 0.5
    assert cmd.fields["end_bias"] == 2
    for kind in ("query.create", "flash.register"):
        for field, value in (("presence_penalty", 7), ("end_bias", 12)):
            with pytest.raises(ProtocolError) as err:
                proto.receive_text(f'{{"type": "{kind}", "session_id": "s", "question": "q", "{field}": {value}}}')
            assert err.value.param == field and err.value.code == "invalid_field"


def test_a_logged_registration_keeps_its_penalties():
    """The event log's record carries them, so a replayed session decodes its flash answers alike."""
    from streamer.handlers import flash_args
    from streamer.records import FlashRegister, Record

    args = flash_args({"question": "Who?", "max_tokens": 8, **STRONG, "end_bias": 2.5})
    record = FlashRegister.of(args, {"flash_id": "f1"})
    again = Record.from_json(record.to_json())
    assert again.arguments() == {"question": "Who?", "flash_id": "f1", "max_tokens": 8, **STRONG, "end_bias": 2.5}
