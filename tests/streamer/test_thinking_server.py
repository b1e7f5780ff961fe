"""Thinking over the websocket: reasoning events to producer and subscribers, settings, errors."""

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
