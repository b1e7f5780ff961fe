"""No client can lock out the others at the edge (issue 33, items 2-4), over real sockets:
bytes are counted as they are read, for every frame, and a connection that stays over its byte
rate is slowed and then closed; connections are capped per client address, per API key and on
the server, each refusal with its own HTTP status, JSON code and metric; the server's message
budget is shared fairly, so connections each under their own limit cannot take a bystander's
share. 127.0.0.2 is a second loopback client address (the client socket is bound to it)."""

import asyncio
import contextlib
import json
import resource
import socket

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from streamer.auth import ApiKeys
from helpers import until
from wsutil import Raw, raw, serve


@pytest.fixture(scope="module")
def engine(tokenizer):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=11)
    eng = Engine(ModelRunner(lm.model, tokenizer, lm.name),
                 EngineLimits(max_context_tokens=400, max_answer_tokens=16, max_question_tokens=24,
                              max_sessions=16)).start()
    yield eng
    eng.stop()


async def connect_from(url: str, address: str = "127.0.0.1", api_key: str | None = None) -> Raw:
    """A websocket client whose socket is bound to `address` (a loopback address)."""
    host, port = url.removeprefix("ws://").split(":")
    sock = socket.socket()
    sock.bind((address, 0))
    sock.connect((host, int(port)))
    sock.setblocking(False)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    return Raw(await connect(url, sock=sock, max_size=None, additional_headers=headers))


async def refused_with(url: str, status: int, code: str, address: str = "127.0.0.1", api_key: str | None = None):
    with pytest.raises(InvalidStatus) as info:
        await connect_from(url, address, api_key)
    response = info.value.response
    assert response.status_code == status, response
    body = json.loads(response.body)
    assert body["code"] == code and body["error"], body
    assert response.headers["Retry-After"]
    return body


# ---- bytes ---------------------------------------------------------------------------------

JUNK = {
    "text": lambda i: "x" * 60_000,  # not JSON: invalid_json
    "binary": lambda i: b"\x00" * 60_000,  # no media on this server: unexpected_binary
    "invalid_utf8": lambda i: b"\xff" * 60_000,  # a text frame that is not UTF-8
    "deflated": lambda i: "x" * 60_000,  # compressed on the wire to a few hundred bytes
}


@pytest.mark.parametrize("kind", sorted(JUNK))
def test_bytes_of_refused_frames_count_and_a_sender_over_its_byte_rate_is_closed(engine, kind):
    """Every byte read counts, whatever the frame: 24 MB of refused frames sent as fast as the
    socket takes them are not read at the socket's speed; the sender is held back and then
    closed with byte_rate_limited (1008) long before the server has read half of them, and a
    bystander is served throughout. (Before: refused frames took nothing from the byte bucket,
    so all of them were read and the connection never closed.)"""
    frames, size = 400, 60_000

    async def test(url, server):
        other = await raw(url)
        other_sid = await other.create()
        attacker = await raw(url, compression="deflate" if kind == "deflated" else None)

        async def send_all() -> None:
            try:
                for i in range(frames):
                    frame = JUNK[kind](i)
                    await attacker.ws.send(frame, text=True) if kind == "invalid_utf8" else await attacker.send(frame)
            except ConnectionClosed:
                pass

        sender = asyncio.create_task(send_all())
        codes = []
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                codes.append((await attacker.recv(timeout=20))["error"])
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008, closed.value
        await asyncio.wait_for(sender, 20)
        assert codes[-1]["code"] == "byte_rate_limited" and codes[-1]["recoverable"] is False, codes[-1]
        assert {c["code"] for c in codes[:-1]} <= {"invalid_json", "unexpected_binary", "invalid_utf8"}, codes
        assert server.edge["byte_rate_closed"] == 1
        if kind != "deflated":  # slowed first, and stopped long before (one deflated read can inflate to most of it)
            assert server.edge["byte_throttled"] >= 1
            assert server.edge["bytes_read"] < frames * size // 2, server.edge["bytes_read"]
        await other.still_serving(other_sid)

    serve(engine, test, bytes_per_s=256_000, bytes_burst=65_536, max_frame_bytes=65_536, byte_throttle_s=2,
          refused_burst=100_000, refused_per_s=100_000, media=None)


# ---- connection caps -------------------------------------------------------------------------

def test_connections_are_capped_per_address_and_another_address_still_connects(engine):
    async def test(url, server):
        held = [await connect_from(url) for _ in range(3)]
        await refused_with(url, 429, "too_many_connections_address")
        assert server.edge["connections_refused_address"] == 1
        legit = await connect_from(url, "127.0.0.2")  # another client: not affected
        await legit.still_serving(await legit.create())
        await held[0].ws.close()  # a slot frees: the first address connects again
        await until(lambda: server.gate.by_address["127.0.0.1"] < 3, 10, "the closed socket to be counted")
        again = await connect_from(url)
        assert (await again.request({"type": "session.get", "session_id": "nosuch"}))["type"] == "error"
        health = await server_metrics(url)
        assert "streamer_connections_refused_address_total 1" in health

    serve(engine, test, max_connections_per_address=3)


async def server_metrics(url: str) -> str:
    host, port = url.removeprefix("ws://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
    writer.write(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return data.decode()


def test_connections_are_capped_per_api_key(engine):
    keys = ApiKeys({"alpha": "alpha-key-0123456789", "beta": "beta-key-0123456789"})

    async def test(url, server):
        held = [await connect_from(url, api_key="alpha-key-0123456789") for _ in range(2)]
        await refused_with(url, 429, "too_many_connections_key", address="127.0.0.2",
                           api_key="alpha-key-0123456789")  # another address, the same key
        assert server.edge["connections_refused_key"] == 1
        beta = await connect_from(url, api_key="beta-key-0123456789")
        await beta.still_serving(await beta.create())
        await held[1].ws.close()
        await until(lambda: server.gate.by_key["alpha"] < 2, 10, "the closed connection to be counted")
        await connect_from(url, api_key="alpha-key-0123456789")

    serve(engine, test, api_keys=keys, max_connections_per_key=2)


def test_connections_are_capped_on_the_server(engine):
    async def test(url, server):
        held = [await connect_from(url, address) for address in ("127.0.0.1", "127.0.0.2", "127.0.0.3")]
        await refused_with(url, 503, "server_full", address="127.0.0.4")
        assert server.edge["connections_refused_server"] == 1
        await held[0].ws.close()
        await until(lambda: server.gate.sockets < 3, 10, "the closed socket to be counted")
        late = await connect_from(url, "127.0.0.4")
        await late.still_serving(await late.create())

    serve(engine, test, max_connections=3)


def test_a_storm_of_handshakes_waits_its_turn_at_the_server_rate_and_what_cannot_wait_gets_server_busy(engine):
    """Twelve connections opened at once against a rate of 2 handshakes a second (bursts of 2,
    up to 1 s of waiting): the burst is answered at once, the next ones wait their turn (and
    open), and the ones whose turn is more than a second away get HTTP 503 `server_busy` with
    Retry-After; a session on a connection opened before goes on meanwhile."""

    async def test(url, server):
        held = await connect_from(url, "127.0.0.2")
        sid = await held.create()
        await asyncio.sleep(1.1)  # the bucket is full again (2 at 2/s)
        tries = await asyncio.gather(*(connect_from(url, f"127.0.0.{3 + i}") for i in range(12)),
                                     return_exceptions=True)
        opened = [t for t in tries if isinstance(t, Raw)]
        refused = [t for t in tries if isinstance(t, InvalidStatus)]
        assert len(opened) + len(refused) == 12, tries
        # 2 from the burst plus the turns within the 1 s wait (2/s): 4, give or take the clock
        assert 3 <= len(opened) <= 8 and refused, (len(opened), len(refused))
        assert server.edge["handshakes_paced"] >= 1 and server.edge["handshakes_refused"] == len(refused)
        for info in refused:
            assert info.response.status_code == 503
            body = json.loads(info.response.body)
            assert body["code"] == "server_busy" and "connections a second" in body["error"], body
            assert int(info.response.headers["Retry-After"]) >= 1
        await held.still_serving(sid)
        for peer in opened:
            await peer.still_serving(await peer.create())
        await asyncio.sleep(1.5)
        late = await connect_from(url, "127.0.0.20")  # the storm is over: answered again
        await late.still_serving(await late.create())

    serve(engine, test, handshakes_per_s=2, handshakes_burst=2, handshake_wait_s=1.0)


def test_sockets_past_twice_an_address_cap_are_closed_unanswered(engine):
    """Bare TCP sockets that never handshake hold descriptors: from one address, those past
    twice its cap are closed at once, so they cannot fill the server's descriptors; another
    address still connects."""

    async def test(url, server):
        host, port = url.removeprefix("ws://").split(":")
        loop = asyncio.get_running_loop()
        bare = []
        for _ in range(4):  # 2 x the cap: held open (until the handshake timeout)
            bare.append(socket.create_connection((host, int(port))))
        await until(lambda: server.gate.by_address["127.0.0.1"] == 4, 10, "the sockets to be accepted")
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(10)
        try:
            data = await loop.run_in_executor(None, extra.recv, 1)
        except ConnectionResetError:
            data = b""
        assert data == b""  # closed by the server, unanswered
        assert server.edge["connections_reset"] == 1
        legit = await connect_from(url, "127.0.0.2")
        await legit.still_serving(await legit.create())
        for s in [*bare, extra]:
            s.close()

    serve(engine, test, max_connections_per_address=2)


def test_the_soft_open_file_limit_is_raised_at_start(engine):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard < 256:
        pytest.skip(f"hard open-file limit {hard}: nothing to raise toward")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard // 2, hard))
    try:
        async def test(url, server):
            assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
            assert server.gate.reset_at == hard - 64 and server.gate.total <= hard - 128

        serve(engine, test)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ---- the server's message budget --------------------------------------------------------------

def test_the_message_budget_is_shared_fairly(engine):
    """Three connections, each far under its own message rate, flood the server past its
    budget: each is slowed to its fair share (nothing refused: every request is answered in
    the end), and a bystander within its share is answered while they still wait."""

    async def test(url, server):
        bystander = await connect_from(url, "127.0.0.2")
        mine = await bystander.create()
        flooders = [await connect_from(url) for _ in range(3)]
        sids = [await f.create() for f in flooders]
        for f, sid in zip(flooders, sids):  # every frame in flight before the bystander asks
            for i in range(FLOOD):
                await f.send({"type": "session.get", "session_id": sid, "event_id": f"g{i}"})
        answered = [await bystander.request({"type": "session.get", "session_id": mine}) for _ in range(4)]
        assert all(a["type"] == "state" for a in answered), answered
        waiting = 0  # the flooders' requests not answered yet when the bystander was done
        for f in flooders:
            replies = []
            with contextlib.suppress(TimeoutError):
                while len(replies) < FLOOD:
                    replies.append(await f.recv(timeout=0.02))
            waiting += FLOOD - len(replies)
            replies += [await f.recv() for _ in range(FLOOD - len(replies))]
            assert [r["type"] for r in replies] == ["state"] * FLOOD, [r for r in replies if r["type"] != "state"][:3]
            assert [r["reply_to"] for r in replies] == [f"g{i}" for i in range(FLOOD)]
        assert waiting > 0, "the flood was answered before the bystander: nothing was slowed"
        assert server.edge["server_busy"] >= 3 and server.edge["rate_limited"] == 0
        await bystander.still_serving(mine)

    serve(engine, test, server_messages_per_s=40, server_messages_burst=40, messages_per_s=1000,
          messages_burst=1000, refused_burst=100_000, refused_per_s=100_000)


FLOOD = 60  # requests each flooder sends at once: at the budget of 40/s, ~4 s to answer all


# ---- idle connections cost no CPU ------------------------------------------------------------

def test_idle_connections_arm_no_timer_that_fires_within_a_second(engine):
    """Idle-connection and slow-consumer checks are one timer per connection, due when the
    condition could first hold (`idle_timeout_s`, `slow_consumer_s` after congestion), not a
    poll: with 600 idle connections open, the event loop has almost nothing due in the next
    second (a poll every 0.25 s per connection put 600 wakeups there, 2,400 a second). That the
    timers still close (test_limits::test_idle_timeout) and drop (::test_slow_consumer_is_dropped)
    is tested there."""
    n = 600

    async def test(url, server):
        loop = asyncio.get_running_loop()
        held = [Raw(await connect(url, max_size=None, ping_interval=None)) for _ in range(n)]
        await until(lambda: len(server.connections) >= n, 30, "the connections to be served")
        await asyncio.sleep(0.5)  # past any start-up work of the connections
        now = loop.time()
        due = [h for h in loop._scheduled if not h.cancelled() and h.when() < now + 1.0]
        assert len(due) < 30, (len(due), due[:5])
        assert server.edge["idle_closed"] == 0
        for peer in held:
            await peer.ws.close()

    serve(engine, test, idle_timeout_s=120.0, max_connections_per_address=n + 10)
