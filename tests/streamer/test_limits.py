"""Every limit of the service: each has its own error code, and the server keeps serving other
sessions (and, where the connection survives, the offending session) afterwards."""

import asyncio
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamer.protocol import ProtocolLimits
from helpers import until
from wsutil import Raw, check_error, raw, serve


@pytest.fixture(scope="module")
def limited_engine(tokenizer):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=11)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name),
                    EngineLimits(max_context_tokens=400, max_answer_tokens=16, max_question_tokens=24,
                                 max_flash_per_session=2, max_sessions=8)).start()
    yield engine
    engine.stop()


async def bystander(url):
    """Another client with its own session, checked after each offence."""
    peer = await raw(url)
    sid = await peer.create()
    return peer, sid


async def survives(bystanders):
    for peer, sid in bystanders:
        await peer.still_serving(sid)


SMALL = ProtocolLimits(max_message_bytes=4096, max_text_chars=600, max_question_chars=200,
                       max_system_prompt_chars=100, max_pattern_chars=50, max_flash_at_create=2)


@pytest.mark.parametrize("msg,code", [
    ({"type": "input.text.append", "text": "x" * 601}, "text_too_long"),
    ({"type": "input.text.revise", "text": "x" * 601}, "text_too_long"),
    ({"type": "query.create", "question": "q" * 201}, "question_too_long"),
    ({"type": "query.create", "question": "word " * 100}, "question_too_long"),  # chars fit, tokens do not
    ({"type": "query.create", "question": "q", "max_tokens": 17}, "max_tokens_too_large"),
    ({"type": "flash.register", "question": "q", "max_tokens": 17}, "max_tokens_too_large"),
    ({"type": "flash.register", "question": "word " * 30, "max_tokens": 4}, "question_too_long"),
    ({"type": "action.rule", "flash_id": "f", "pattern": "p" * 51, "command": {}}, "pattern_too_long"),
    ({"type": "input.text.append", "text": "y" * 5000}, "message_too_large"),
])
def test_session_limits(limited_engine, msg, code):
    async def test(url, server):
        others = [await bystander(url)]
        peer = await raw(url)
        sid = await peer.create()
        if code == "message_too_large":  # refused before parsing: the error cannot name the message
            await peer.send({**msg, "session_id": sid})
            check_error(await peer.recv(), code)
        else:
            check_error(await peer.request({**msg, "session_id": sid}), code)
        await peer.still_serving(sid)
        await survives(others)

    serve(limited_engine, test, protocol=SMALL)


def test_create_limits(limited_engine):
    async def test(url, server):
        others = [await bystander(url)]
        peer = await raw(url)
        check_error(await peer.request({"type": "session.create", "system_prompt": "s" * 101}), "system_prompt_too_long")
        check_error(await peer.request({"type": "session.create", "flash": [{"question": "q"}] * 3}), "flash_limit")
        sid = await peer.create()
        for i in range(2):
            assert (await peer.request({"type": "flash.register", "session_id": sid, "question": f"q{i}?",
                                        "max_tokens": 2}))["type"] == "flash.registered"
        check_error(await peer.request({"type": "flash.register", "session_id": sid, "question": "third?"}),
                    "flash_limit")
        # the engine's session limit: 8 live sessions (bystander + this one + 6 more)
        extra = [await peer.create() for _ in range(6)]
        check_error(await peer.request({"type": "session.create"}), "too_many_sessions")
        for x in extra:
            await peer.request({"type": "session.close", "session_id": x})
        await peer.still_serving(sid)
        await survives(others)

    serve(limited_engine, test, protocol=SMALL)


def test_frame_beyond_websocket_limit_closes_only_that_connection(limited_engine):
    async def test(url, server):
        others = [await bystander(url)]
        peer = await raw(url)
        await peer.send("z" * 70_000)
        with pytest.raises(ConnectionClosed) as info:
            await peer.recv(timeout=10)
        assert info.value.rcvd.code == 1009
        await survives(others)

    serve(limited_engine, test, max_frame_bytes=65_536)


def test_message_rate(limited_engine):
    async def test(url, server):
        others = [await bystander(url)]
        peer = await raw(url)
        sid = await peer.create()
        await asyncio.sleep(1.2)  # refill the bucket
        for i in range(12):
            await peer.send({"type": "session.get", "session_id": sid, "event_id": f"g{i}"})
        replies = [await peer.recv() for _ in range(12)]
        limited = [r for r in replies if r["type"] == "error"]
        assert limited and all(r["error"]["code"] == "rate_limited" for r in limited)
        assert sum(r["type"] == "state" for r in replies) >= 5
        assert server.edge["rate_limited"] >= len(limited)
        await asyncio.sleep(1.5)  # the rate comes back
        await peer.still_serving(sid)
        await survives(others)

    serve(limited_engine, test, messages_per_s=5, messages_burst=5)


def test_byte_rate(limited_engine):
    """Over the byte rate a connection is slowed, not refused: reading pauses until the deficit
    is paid, and every frame is then processed in order."""
    async def test(url, server):
        others = [await bystander(url)]
        peer = await raw(url)
        sid = await peer.create()
        for i in range(3):  # ~260 bytes each against a 600-byte burst, back to back
            await peer.send({"type": "input.text.append", "session_id": sid, "text": "w " * 80, "event_id": f"a{i}"})
        replies = [await peer.recv() for _ in range(3)]
        assert [r["type"] for r in replies] == ["input.ack"] * 3, replies
        assert [r["reply_to"] for r in replies] == ["a0", "a1", "a2"]
        assert server.edge["byte_throttled"] >= 1 and server.edge["byte_rate_closed"] == 0
        await peer.still_serving(sid)
        await survives(others)

    serve(limited_engine, test, bytes_per_s=200, bytes_burst=600, max_frame_bytes=600,
          protocol=ProtocolLimits(max_message_bytes=600))


def test_idle_timeout(limited_engine):
    async def test(url, server):
        others = [await bystander(url)]
        idle = await raw(url)
        err = await idle.recv(timeout=10)
        check_error(err, "idle_timeout", recoverable=False)
        with pytest.raises(ConnectionClosed) as info:
            await idle.recv(timeout=10)
        assert info.value.rcvd.code == 1000
        assert server.edge["idle_closed"] >= 1
        await asyncio.sleep(1.0)  # connections holding a session are not idle
        await survives(others)

    serve(limited_engine, test, idle_timeout_s=0.6)


async def _not_reading(url, **kwargs):
    """A client whose socket buffer is tiny and who never reads."""
    host, port = url.removeprefix("ws://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    return Raw(await connect(url, sock=sock, max_queue=1, max_size=None, **kwargs))


@pytest.mark.parametrize("role", ["producer", "subscriber"])
def test_slow_consumer_is_dropped(limited_engine, role, caplog):
    async def test(url, server):
        others = [await bystander(url)]
        owner = await raw(url)
        created = await owner.request({"type": "session.create"})
        sid = created["session_id"]
        await owner.request({"type": "input.text.append", "session_id": sid, "text": "Lighthouse log. " * 20})
        if role == "producer":
            slow, target = owner, sid
        else:
            slow = await _not_reading(url)
            await slow.send({"type": "subscribe", "session_id": sid, "token": created["tokens"]["subscriber"]})
            target = sid
        if role == "producer":  # the producer itself stops reading: use a fresh connection that does
            slow = await _not_reading(url)
            target = await slow.create()
        peak = 0
        try:
            for i in range(3000):  # replies it never reads
                await asyncio.wait_for(slow.send({"type": "session.get", "session_id": target}), 5)
                conns = [c for c in server.connections if c.outbox.bytes]
                peak = max([peak, *[c.outbox.bytes for c in conns]])
        except (ConnectionClosed, asyncio.TimeoutError):
            pass
        await until(lambda: server.edge["slow_consumers_dropped"], 10, "the slow consumer to be dropped")
        assert server.edge["slow_consumers_dropped"] == 1
        assert peak <= server.config.outbox_max_bytes
        assert "slow_consumer" in caplog.text
        await survives(others)
        if role == "subscriber":
            await owner.still_serving(sid)  # the session it watched is untouched

    serve(limited_engine, test, send_buffer_bytes=4096, outbox_high_bytes=16_384, outbox_low_bytes=4096,
          slow_consumer_s=0.5, messages_per_s=10_000, messages_burst=10_000)


def test_inflight_backpressure_loses_nothing(limited_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        for i in range(40):
            await peer.send({"type": "input.text.append", "session_id": sid, "text": f" part {i}.",
                             "event_id": f"a{i}"})
        acks = [await peer.recv() for _ in range(40)]
        assert [a["reply_to"] for a in acks] == [f"a{i}" for i in range(40)]
        assert [a["seq"] for a in acks] == list(range(1, 41))
        assert server.edge["backpressure_pauses"] >= 1
        state = await peer.request({"type": "session.get", "session_id": sid})
        assert state["session"]["last_seq"] == 40

    serve(limited_engine, test, max_inflight=2)


def test_a_flood_of_junk_is_throttled_then_closed(limited_engine):
    """Invalid frames count against the rate limits before they are parsed; a connection that
    keeps sending refused or invalid frames is closed (rate_limited, 1008), and a bystander's
    session keeps answering throughout."""

    async def test(url, server):
        others = [await bystander(url)]
        attacker = await raw(url)
        codes = []
        try:
            for i in range(5000):
                await attacker.send("{not json" if i % 2 else b"\x00" * 2048)
        except ConnectionClosed:
            pass  # closed while it was still sending
        try:
            while True:
                codes.append((await attacker.recv(timeout=10))["error"])
        except ConnectionClosed as closed:
            assert closed.rcvd is not None and closed.rcvd.code == 1008, closed
        assert {c["code"] for c in codes} <= {"invalid_json", "unexpected_binary", "rate_limited", "byte_rate_limited"}
        assert codes[-1]["code"] == "rate_limited" and codes[-1]["recoverable"] is False, codes[-1]
        assert "refused or invalid frames" in codes[-1]["message"]
        assert len(codes) <= 102  # errors stop at the refused-frame burst: junk is not answered in kind
        assert server.edge["junk_closed"] == 1 and server.edge["rate_limited"] >= 1
        await survives(others)

    serve(limited_engine, test, messages_per_s=50, messages_burst=50, refused_per_s=20, refused_burst=100,
          media=None)


def test_detached_sessions_are_capped_per_client(limited_engine):
    """A client that leaves sessions detached holds at most `max_detached_per_client` of them:
    past it its oldest detached session closes (resume: session_not_found), the newer ones
    resume."""

    async def test(url, server):
        made = []
        for _ in range(3):
            peer = await raw(url)
            created = await peer.request({"type": "session.create"})
            made.append((created["session_id"], created["tokens"]["producer"]))
            await peer.ws.close()
            await until(lambda: server.directory.detached() + server.resumer.counters["detached_evicted"]
                        == len(made), 10, "the session to be detached")
        assert server.resumer.counters["detached_evicted"] == 1 and server.directory.detached() == 2
        peer = await raw(url)
        check_error(await peer.request({"type": "session.resume", "session_id": made[0][0], "token": made[0][1]}),
                    "session_not_found")
        for sid, token in made[1:]:
            resumed = await peer.request({"type": "session.resume", "session_id": sid, "token": token})
            assert resumed["type"] == "session.resumed", resumed

    serve(limited_engine, test, max_detached_per_client=2)


def test_limits_are_documented():
    """docs/limits.md lists every limit field with its default (one place for all of them)."""
    import dataclasses
    from pathlib import Path

    from streamer.cli import NOT_LIMITS
    from streamer.server import ServerConfig
    from streamer.sessions.engine import EngineLimits

    doc = (Path(__file__).resolve().parents[2] / "docs" / "limits.md").read_text()
    for cls in (ProtocolLimits, ServerConfig, EngineLimits):
        for f in dataclasses.fields(cls):
            if f.name in NOT_LIMITS:
                continue
            assert f"`{f.name}`" in doc, f"{cls.__name__}.{f.name} missing from docs/limits.md"


def test_cli_limit_overrides(capsys):
    from streamer.cli import apply_limits
    from streamer.server import ServerConfig
    from streamer.sessions.engine import EngineLimits

    config, limits = apply_limits(["messages_per_s=50", "max_text_chars=1000", "max_sessions=3",
                                   "park_to_disk=true", "kv_budget_bytes=none", "send-buffer-bytes=8192"],
                                  ServerConfig(), EngineLimits(kv_budget_bytes=5))
    assert config.messages_per_s == 50.0 and config.protocol.max_text_chars == 1000
    assert config.send_buffer_bytes == 8192
    assert limits.max_sessions == 3 and limits.park_to_disk is True and limits.kv_budget_bytes is None
    for bad in ("nope=1", "messages_per_s", "max_sessions=x", "max_sessions=-1", "park_to_disk=maybe"):
        with pytest.raises(ValueError, match="--limit"):
            apply_limits([bad], ServerConfig(), EngineLimits())
    assert apply_limits(["help"], ServerConfig(), EngineLimits()) == (None, None)
    assert "messages_per_s = 200.0  (server)" in capsys.readouterr().out


def _read_until_eof(sock, timeout):
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def test_handshake_timeout_and_dead_peer_keepalive(limited_engine):
    """A TCP peer that never completes the handshake, and one that completes it but never
    answers a ping, are both closed; a live client on the same server keeps working."""
    import base64
    import os

    async def test(url, server):
        others = [await bystander(url)]
        host, port = url.removeprefix("ws://").split(":")
        silent = socket.create_connection((host, int(port)))
        deaf = socket.create_connection((host, int(port)))
        key = base64.b64encode(os.urandom(16)).decode()
        deaf.sendall((f"GET / HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        loop = asyncio.get_running_loop()
        # both reads run in threads: the server must close each socket for them to return
        silent_data, deaf_data = await asyncio.gather(loop.run_in_executor(None, _read_until_eof, silent, 20),
                                                      loop.run_in_executor(None, _read_until_eof, deaf, 20))
        assert silent_data == b"" or b"HTTP" not in silent_data[:4]
        assert deaf_data.startswith(b"HTTP/1.1 101")  # upgraded, then pinged (0x89) and dropped
        assert b"\x89" in deaf_data[deaf_data.index(b"\r\n\r\n"):]
        silent.close()
        deaf.close()
        await survives(others)

    serve(limited_engine, test, open_timeout_s=0.5, ping_interval=0.3, ping_timeout=0.3)


def test_frames_queued_during_a_backpressure_pause_are_no_burst():
    """While the server pauses reading (its own backpressure), a producer's frames queue in the
    socket at the allowed rate; read back to back after the pause they must not trip the rate
    limit (and then the flood guard) as if they were a burst."""
    from streamer.connection import TokenBucket

    bucket = TokenBucket(rate=5, burst=5)
    assert all(bucket.take() for _ in range(5)) and not bucket.take()
    bucket.credit(2.0)  # paused for 2 s: up to 10 frames arrived at the allowed rate
    assert all(bucket.take() for _ in range(10)) and not bucket.take()
    bucket.credit(1e6)  # the credit is capped (a minute at the rate)
    assert sum(bucket.take() for _ in range(400)) == 300
