"""The websocket service on a real port: the happy path, and every kind of bad input gets an
`error` event (code, message, recoverable) while the connection and other sessions go on."""

import asyncio
import json
import time
import urllib.error
import urllib.request

from helpers import until
from wsutil import check_error, raw, serve

from streamer.clients.client import StreamerClient, StreamerError


def test_append_ask_roundtrip(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "event_id": "e1"})
        assert created["type"] == "session.created" and created["reply_to"] == "e1"
        assert created["session"]["context_window"] == 400
        assert {"event_id", "ts", "session_id"} <= set(created)
        sid = created["session_id"]
        sent = time.monotonic()
        ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": "Ada keeps the light."})
        round_trip_ms = (time.monotonic() - sent) * 1000
        assert ack["type"] == "input.ack" and ack["seq"] == 1 and ack["data_version"] == 1
        assert ack["tokens"] > 0 and ack["total_tokens"] == created["session"]["tokens"] + ack["tokens"]
        assert 0 < ack["lag_ms"] <= round_trip_ms + 0.01  # submitted -> in the cache, inside the round trip
        await peer.send({"type": "query.create", "session_id": sid, "question": "Who?", "max_tokens": 5,
                         "query_id": "q1"})
        events = await peer.until("query.done")
        deltas = [e for e in events if e["type"] == "query.delta"]
        done = events[-1]
        assert done["query_id"] == "q1" and done["tokens"] == 5 and done["finish_reason"] == "length"
        assert "".join(d["delta"] for d in deltas) == done["text"]
        assert [d["index"] for d in deltas] == list(range(len(deltas)))
        assert set(done["timing"]) >= {"queue_ms", "prefill_ms", "first_token_ms", "total_ms"}
        assert done["context_tokens"] == ack["total_tokens"] and done["data_version"] == 1
        state = await peer.request({"type": "session.get", "session_id": sid})
        assert state["type"] == "state" and state["session"]["tokens"] == ack["total_tokens"]
        closed = await peer.request({"type": "session.close", "session_id": sid})
        assert closed["type"] == "session.closed"

    serve(tiny_engine, test)


def test_revise_and_input_end(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "Partial transcr"})
        ack = await peer.request({"type": "input.text.revise", "session_id": sid, "text": "Partial transcript."})
        assert ack["type"] == "input.ack" and ack["replaced_seqs"] == [1] and ack["seq"] == 2
        assert ack["kept_tokens"] >= 1
        ended = await peer.request({"type": "input.end", "session_id": sid})
        assert ended["ended"] is True
        refused = await peer.request({"type": "input.text.append", "session_id": sid, "text": "more"})
        assert refused["error"]["code"] == "input_ended"
        await peer.send({"type": "query.create", "session_id": sid, "question": "What?", "max_tokens": 2})
        assert (await peer.until("query.done"))[-1]["tokens"] == 2

    serve(tiny_engine, test)


def test_healthz_and_unknown_path(tiny_engine):
    async def test(url, server):
        base = url.replace("ws://", "http://")
        health = await asyncio.to_thread(lambda: json.load(urllib.request.urlopen(base + "/healthz")))
        assert health["status"] == "ok" and health["model"].startswith("tiny-llama")
        try:
            await asyncio.to_thread(urllib.request.urlopen, base + "/nope")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        else:
            raise AssertionError("expected 404")

    serve(tiny_engine, test)


def test_health_and_metrics_requests_log_at_debug(tiny_engine, caplog):
    """A proxy probing /healthz every few seconds must not fill the service log: successful
    plain HTTP requests log at debug; a refused one (404) and websocket connections keep INFO."""
    caplog.set_level("INFO", logger="streamer.wire")

    async def test(url, server):
        base = url.replace("ws://", "http://")
        for path in ("/healthz", "/metrics", "/healthz"):
            await asyncio.to_thread(lambda: urllib.request.urlopen(base + path).read())
        try:
            await asyncio.to_thread(urllib.request.urlopen, base + "/nope")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        peer = await raw(url)
        await peer.create()
        await peer.ws.close()
        await until(lambda: sum("connection closed" in r.getMessage() for r in caplog.records) >= 2, 10,
                    "the 404's and the websocket's close lines")

    serve(tiny_engine, test)
    info = [r.getMessage() for r in caplog.records if r.name == "streamer.wire" and r.levelname == "INFO"]
    assert not any("(200 OK)" in m for m in info), info
    assert "HTTP response sent (404 Not Found)" in info and "connection open" in info
    assert info.count("connection closed") == 2, info  # the 404's and the websocket's, not the health checks'


def bad_input_case(engine, payload, code, **config):
    """Send one bad frame on a connection that owns a session; expect the error, then show
    the same connection, its session and another connection's session all still work."""

    async def test(url, server):
        peer, other = await raw(url), await raw(url)
        sid, other_sid = await peer.create(), await other.create()
        await peer.still_serving(sid)
        before = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        await peer.send(payload)
        error = check_error(await peer.recv(), code)
        after = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert after["tokens"] == before["tokens"] and after["data_version"] == before["data_version"]
        await peer.still_serving(sid)
        await other.still_serving(other_sid)
        return error

    return serve(engine, test, **config)


def test_malformed_json(tiny_engine):
    err = bad_input_case(tiny_engine, '{"type": "session.create",', "invalid_json")
    assert "not valid JSON" in err["message"]


def test_not_an_object(tiny_engine):
    bad_input_case(tiny_engine, "[1, 2]", "not_an_object")


def test_unknown_type(tiny_engine):
    err = bad_input_case(tiny_engine, {"type": "input.text.shout", "text": "x"}, "unknown_type")
    assert "input.text.shout" in err["message"]


def test_missing_field(tiny_engine):
    err = bad_input_case(tiny_engine, {"type": "input.text.append", "session_id": "x"}, "missing_field")
    assert err["param"] == "text"


def test_wrong_field_type(tiny_engine):
    async def _(): ...
    err = bad_input_case(tiny_engine, {"type": "query.create", "session_id": "x", "question": "q",
                                       "temperature": "hot"}, "invalid_field")
    assert err["param"] == "temperature" and "hot" in err["message"]


def test_oversized_message(tiny_engine):
    text = "x" * (70 * 1024)
    err = bad_input_case(tiny_engine, {"type": "input.text.append", "session_id": "s", "text": text},
                         "message_too_large", protocol=__import__("streamer.protocol", fromlist=["x"])
                         .ProtocolLimits(max_message_bytes=64 * 1024))
    assert "65536" in err["message"]


def test_invalid_utf8(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.ws.send(b'{"type": "session.get", "session_id": "\xff\xfe"}', text=True)
        check_error(await peer.recv(), "invalid_utf8")
        await peer.still_serving(sid)

    serve(tiny_engine, test)


def test_binary_frame(tiny_engine):
    err = bad_input_case(tiny_engine, b"\x00\x01binary", "media_header_invalid")
    assert "header length 90729" in err["message"]
    err = bad_input_case(tiny_engine, b"\x00\x01binary", "unexpected_binary", media=None)
    assert "binary frame of 8 bytes" in err["message"]


def test_query_unknown_session(tiny_engine):
    err = bad_input_case(tiny_engine, {"type": "query.create", "session_id": "nope", "question": "q"},
                         "session_not_found")
    assert "nope" in err["message"]


def test_query_closed_session(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid, keep = await peer.create(), await peer.create()
        assert (await peer.request({"type": "session.close", "session_id": sid}))["type"] == "session.closed"
        err = check_error(await peer.request({"type": "query.create", "session_id": sid, "question": "q"}),
                          "session_not_found")
        assert sid in err["message"]
        await peer.still_serving(keep)

    serve(tiny_engine, test)


def test_input_beyond_context_window(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        ok = await peer.request({"type": "input.text.append", "session_id": sid, "text": "Kept data. " * 10})
        err = check_error(await peer.request({"type": "input.text.append", "session_id": sid,
                                              "text": "word " * 1000}), "context_overflow")
        assert "window of" in err["message"]  # a default session is bounded by its window
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["tokens"] == ok["total_tokens"] and state["last_seq"] == 1  # accepted data kept
        await peer.still_serving(sid)
        unbounded = (await peer.request({"type": "session.create", "window": None}))["session_id"]
        err = check_error(await peer.request({"type": "input.text.append", "session_id": unbounded,
                                              "text": "word " * 1000}), "context_overflow")
        assert "400 tokens" in err["message"]  # an unbounded one by the model's window

    serve(tiny_engine, test)


def test_answer_is_clamped_at_the_context_window(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = (await peer.request({"type": "session.create", "window": None}))["session_id"]  # unbounded
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "word " * 300})
        await peer.send({"type": "query.create", "session_id": sid, "question": "Count?", "max_tokens": 64})
        done = (await peer.until("query.done"))[-1]
        assert done["finish_reason"] == "context_window"
        assert done["context_tokens"] + done["question_tokens"] + done["tokens"] == 400

    serve(tiny_engine, test)


def test_engine_limit_errors(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        err = check_error(await peer.request({"type": "query.create", "session_id": sid, "question": "q",
                                              "max_tokens": 10_000}), "max_tokens_too_large")
        assert "max_tokens" in err["message"]
        err = check_error(await peer.request({"type": "input.text.revise", "session_id": sid, "text": "x"}),
                          "invalid_field")
        assert "no input to revise" in err["message"]
        await peer.still_serving(sid)

    serve(tiny_engine, test)


def test_query_cancel(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "Some data."})
        await peer.send({"type": "query.create", "session_id": sid, "question": "Long?", "max_tokens": 60,
                         "query_id": "long"})
        await peer.send({"type": "query.cancel", "session_id": sid, "query_id": "long"})
        done = (await peer.until("query.done"))[-1]
        assert done["finish_reason"] == "cancelled" and done["tokens"] < 60
        err = check_error(await peer.request({"type": "query.cancel", "session_id": sid, "query_id": "long"}),
                          "query_not_found")
        assert "long" in err["message"]

    serve(tiny_engine, test)


def test_sessions_belong_to_their_connection_and_close_with_it(tiny_engine):
    async def test(url, server):
        owner, stranger = await raw(url), await raw(url)
        sid = await owner.create()
        check_error(await stranger.request({"type": "session.get", "session_id": sid}), "session_not_found")
        await owner.ws.close()
        await until(lambda: sid not in tiny_engine.sessions, 5, "the closed connection's session to close")

    serve(tiny_engine, test, detach_ttl_s=0)  # 0: no detaching (resume: tests/streamer/test_durability.py)


def test_client_sdk_many_sessions_concurrently(tiny_engine):
    async def test(url, server):
        async def one(i):
            async with await StreamerClient.connect(url) as client:
                session = await client.create_session(system_prompt=f"Session {i}.")
                for k in range(3):
                    ack = await session.append(f"Fact {k} of session {i}. ")
                    assert ack.seq == k + 1
                answer = await session.ask("Which session?", max_tokens=4, end_bias=None)  # no SDK end bias: 4 tokens
                assert answer.tokens == 4 and answer.context_tokens == ack.total_tokens
                with_error = None
                try:
                    await session.revise("x", from_seq=99)
                except StreamerError as exc:
                    with_error = exc
                assert with_error is not None and with_error.code == "invalid_field"
                return answer

        answers = await asyncio.gather(*(one(i) for i in range(4)))
        assert len(answers) == 4

    serve(tiny_engine, test)


def test_metrics_endpoint(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.still_serving(sid)
        base = url.replace("ws://", "http://")
        response = await asyncio.to_thread(urllib.request.urlopen, base + "/metrics")
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
        samples = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                   if line and not line.startswith("#")}
        assert samples["streamer_sessions"] >= 1 and samples["streamer_connections"] >= 1
        assert samples["streamer_steps_total"] > 0 and samples["streamer_queries_total"] >= 1
        assert samples["streamer_pool_used_bytes"] > 0 and samples["streamer_pool_budget_bytes"] > 0
        assert samples[f'streamer_session_cache_tokens{{session="{sid}"}}'] > 0
        assert 'streamer_queue_depth{class="admission"}' in samples
        assert samples['streamer_weights_info{format="fp32",requested="fp32",source="checkpoint",kernels="torch"}'] == 1
        assert samples["streamer_linear_weight_bytes"] > 0
        health = json.loads((await asyncio.to_thread(urllib.request.urlopen, base + "/healthz")).read())
        assert health["weights"]["format"] == "fp32" and health["weights"]["linear_bytes"] > 0
        state = await peer.request({"type": "session.get", "session_id": sid})
        assert state["session"]["weights"] == "fp32"
        for line in text.splitlines():  # every sample line has a HELP and TYPE above it
            if line and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                assert f"# TYPE {name} " in text

    serve(tiny_engine, test)
