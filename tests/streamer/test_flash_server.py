"""Flash questions over the websocket: registration, pushes to producer and subscribers,
cached answers, and the errors around them."""

from helpers import until
from wsutil import check_error, next_of, raw, serve


def test_flash_pushes_to_producer_and_subscriber_and_serves_cached_answers(tiny_engine):
    async def test(url, server):
        producer, watcher = await raw(url), await raw(url)
        created = await producer.request({"type": "session.create", "flash": [
            {"question": "Who keeps the light?", "flash_id": "keeper", "max_tokens": 8}]})
        sid, token = created["session_id"], created["subscribe_token"]
        assert created["session"]["flash"][0]["flash_id"] == "keeper"
        await producer.request({"type": "input.text.append", "session_id": sid, "text": "Ada keeps the light."})
        first = await next_of(producer, "flash.updated")  # evaluated after the first input, not before
        assert first["flash_id"] == "keeper" and first["data_version"] == 1
        assert first["staleness_ms"] > 0 and first["staleness_ms"] >= first["eval_ms"] - 0.1  # spans the evaluation
        assert set(first["confidence"]) == {"logit_gap", "mean_prob"} and first["eval_ms"] > 0

        check_error(await watcher.request({"type": "subscribe", "session_id": sid, "token": "wrong"}),
                    "session_not_found")
        subscribed = await watcher.request({"type": "subscribe", "session_id": sid, "token": token})
        assert subscribed["type"] == "subscribed" and subscribed["session"]["flash"][0]["answer"] == first["answer"]
        check_error(await watcher.request({"type": "input.text.append", "session_id": sid, "text": "x"}),
                    "forbidden")  # a subscriber cannot write

        registered = await producer.request({"type": "flash.register", "session_id": sid,
                                             "question": "What is the cat called?", "max_tokens": 8,
                                             "confirm": 2, "min_interval_ms": 10, "priority": 3})
        assert registered["type"] == "flash.registered" and registered["flash"]["confirm"] == 2
        fid = registered["flash"]["flash_id"]
        for peer in (producer, watcher):  # the first answer of a new question reaches both
            pushed = await next_of(peer, "flash.updated")
            assert pushed["flash_id"] == fid

        await producer.request({"type": "input.text.append", "session_id": sid, "text": "Ada keeps it."})

        async def current():  # the answer is current for the new data
            state = (await producer.request({"type": "session.get", "session_id": sid}))["session"]
            keeper = next(f for f in state["flash"] if f["flash_id"] == "keeper")
            return keeper if keeper.get("data_version") == 2 else None

        keeper = await until(current, what="the flash answer of data_version 2")
        await producer.send({"type": "query.create", "session_id": sid, "question": "who keeps the light",
                             "max_tokens": 8})
        done = await next_of(producer, "query.done")
        assert done["cached"] is True and done["data_version"] == 2 and done["text"] == keeper["answer"]

        check_error(await producer.request({"type": "flash.register", "session_id": sid,
                                            "question": "WHO keeps the light"}), "flash_duplicate")
        check_error(await producer.request({"type": "flash.unregister", "session_id": sid, "flash_id": "nope"}),
                    "flash_not_found")
        gone = await producer.request({"type": "flash.unregister", "session_id": sid, "flash_id": fid})
        assert gone["type"] == "flash.unregistered" and gone["flash_id"] == fid
        assert (await watcher.request({"type": "unsubscribe", "session_id": sid}))["type"] == "unsubscribed"
        check_error(await watcher.request({"type": "unsubscribe", "session_id": sid}), "session_not_found")

    serve(tiny_engine, test)


def test_bad_flash_registrations(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        before = set(tiny_engine.sessions)
        err = check_error(await peer.request({"type": "session.create", "flash": [{"question": "q", "bogus": 1}]}),
                          "unknown_field")
        assert "flash[0]" in err["message"]
        check_error(await peer.request({"type": "session.create", "flash": ["q"]}), "invalid_field")
        check_error(await peer.request({"type": "session.create", "flash": [{"max_tokens": 3}]}), "missing_field")
        err = check_error(await peer.request({"type": "session.create", "flash": [
            {"question": "Same?"}, {"question": "same"}]}), "flash_duplicate")
        assert set(tiny_engine.sessions) == before  # every refused creation left no session behind
        sid = await peer.create()
        check_error(await peer.request({"type": "flash.register", "session_id": sid, "question": "q",
                                        "max_tokens": 1000}), "max_tokens_too_large")
        check_error(await peer.request({"type": "flash.register", "session_id": sid, "question": "q",
                                        "confirm": 0}), "invalid_field")
        await peer.still_serving(sid)

    serve(tiny_engine, test)
