"""Thinking over the websocket: reasoning events to producer and subscribers, settings, errors."""

import pytest
from parrot import parrot_runner
from wsutil import check_error, next_of, raw, serve


def test_reasoning_events_and_settings(tiny_engine):
    async def test(url, server):
        producer, watcher = await raw(url), await raw(url)
        created = await producer.request({"type": "session.create", "thinking": {
            "mode": "dual", "unit_tokens": 6, "stop": "budget", "question": "Who keeps the light?"}})
        sid = created["session_id"]
        assert created["session"]["thinking"]["mode"] == "dual"
        await watcher.request({"type": "subscribe", "session_id": sid, "token": created["subscribe_token"]})
        await producer.request({"type": "input.text.append", "session_id": sid, "text": "Ada keeps the light."})
        for peer in (producer, watcher):
            delta = await next_of(peer, "reasoning.delta")
            assert delta["unit"] == 0 and delta["session_id"] == sid
            done = await next_of(peer, "reasoning.done")
            assert done["seq_range"] == [1, 1] and done["tokens"] > 6 and done["text"]
        updated = await producer.request({"type": "session.update", "session_id": sid,
                                          "thinking": {"mode": "off"}})
        assert updated["type"] == "session.updated" and updated["session"]["thinking"]["mode"] == "off"
        err = check_error(await producer.request({"type": "session.update", "session_id": sid,
                                                  "thinking": {"mode": "sideways"}}), "invalid_field")
        assert "sideways" in err["message"]
        check_error(await producer.request({"type": "session.update", "session_id": sid,
                                            "thinking": {"mode": "dual", "colour": 1}}), "unknown_field")
        check_error(await watcher.request({"type": "session.update", "session_id": sid,
                                           "thinking": {"mode": "dual"}}), "forbidden")
        await producer.still_serving(sid)

    serve(tiny_engine, test)


@pytest.fixture(scope="module")
def parrot_engine(tokenizer):
    """A started engine on the parrot (tests/parrot.py): every note it writes is the same."""
    from streamer.sessions.engine import Engine, EngineLimits

    engine = Engine(parrot_runner(tokenizer), EngineLimits(max_context_tokens=1024, max_answer_tokens=64)).start()
    yield engine
    engine.stop()


def test_a_repeated_note_is_refused_over_the_websocket(parrot_engine):
    """The second and third notes repeat the first: each arrives as reasoning.done with repeated
    true, and session state counts them; the new settings are accepted and shown,
    a bad penalty is refused."""
    async def test(url, server):
        producer = await raw(url)
        created = await producer.request({"type": "session.create", "thinking": {
            "mode": "dual", "unit_tokens": 6, "stop": "budget", "quote_tokens": 16,
            "presence_penalty": 0.25, "frequency_penalty": 0.0, "repetition_penalty": 1.0}})
        sid = created["session_id"]
        shown = created["session"]["thinking"]
        assert shown["quote_tokens"] == 16 and shown["presence_penalty"] == 0.25 and shown["repeated_units"] == 0
        done = []
        for i, row in enumerate(["row 1: temp=20.1C\n", "row 2: temp=20.3C\n", "row 3: temp=87.5C\n"]):
            await producer.request({"type": "input.text.append", "session_id": sid, "text": row})
            done.append(await next_of(producer, "reasoning.done"))  # the unit of this row
            assert done[-1]["unit"] == i and done[-1]["seq_range"] == [i + 1, i + 1]
        assert done[0]["text"].split() == ["same"] * 6 and done[0]["tokens"] > 6
        assert [(d["repeated"], d["text"]) for d in done[1:]] == [(True, done[0]["text"])] * 2
        assert all(d["tokens"] > 6 for d in done)  # what each wrote (the refused ones' were cropped)
        state = (await producer.request({"type": "session.get", "session_id": sid}))["session"]["thinking"]
        assert state["repeated_units"] == 2 and state["units"] == 1
        assert [u["text"] for u in state["recent"]] == [done[0]["text"]]
        check_error(await producer.request({"type": "session.update", "session_id": sid, "thinking": {
            "mode": "dual", "presence_penalty": 9.0}}), "invalid_field")
        await producer.still_serving(sid)

    serve(parrot_engine, test)
