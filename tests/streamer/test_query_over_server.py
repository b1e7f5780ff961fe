"""query.create `over` on a real server: a session with a backlog of unread input answers a
question `over: "read"` at once, over what it has read (`data_version` below the latest,
`unread_inputs` > 0), while `over: "sent"` sees everything; a bad value is refused; the session
is left as it was. The backlog is made exact by holding the engine thread (a command that waits
on an event) while the inputs and the questions are handed to it: no timing is involved."""

from __future__ import annotations

import threading
from contextlib import contextmanager

from helpers import until
from wsutil import check_error, raw, serve

from streamer.clients.client import StreamerClient, StreamerError
from streamer.protocol import command

READ = ["Ada keeps the light. ", "The cat is Pepper. "]
BACKLOG = ["The boat is Marigold. ", "It sails on Tuesday. ", "The dog is Rex. ", "Rain at noon. "]
QUESTION = "Who keeps the light?"
PLAIN = {"max_tokens": 6, "end_bias": 0.0, "frequency_penalty": 0.0}  # whatever answer style the SDK defaults to


@contextmanager
def held(engine):
    """The engine thread waits inside a command until the block ends: nothing is read meanwhile."""
    holding, release = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(120)

    engine.call(hold)
    try:
        if not holding.wait(60):
            raise AssertionError("the engine thread never took the hold")
        yield
    finally:
        release.set()


def asked(server, sid: str, *query_ids: str) -> bool:
    """Whether the server has handed each of these questions to the engine."""
    running = {key for conn in server.connections for key in conn.peer.queries}
    return all((sid, q) in running for q in query_ids)


def test_read_answers_over_what_was_read_while_sent_sees_everything(tiny_engine):
    async def test(url, server):
        async with await StreamerClient.connect(url) as client:
            session = await client.create_session()
            for text in READ:
                await session.append(text)
            before = await session.state()
            with held(tiny_engine):
                for i, text in enumerate(BACKLOG):  # sent, not acknowledged: the engine is held
                    await client.send(command("input.text.append", session_id=session.id, text=text,
                                              client_seq=100 + i))
                read = await session.ask_stream(QUESTION, over="read", query_id="read", **PLAIN)
                sent = await session.ask_stream(QUESTION, query_id="sent", **PLAIN)
                await until(lambda: asked(server, session.id, "read", "sent"), 60, "both questions handed over")
            r, s = await read.result(), await sent.result()
            assert (r.over, r.data_version, r.unread_inputs) == ("read", len(READ), len(BACKLOG))
            assert r.context_tokens == before["tokens"]
            assert (s.over, s.data_version, s.unread_inputs) == ("sent", len(READ) + len(BACKLOG), 0)
            after = await session.state()
            assert after["data_version"] == len(READ) + len(BACKLOG) > r.data_version
            assert s.context_tokens == after["tokens"] > r.context_tokens

            # Left as it was: a session that got the same input and never the questions answers the same.
            twin = await client.create_session()
            for text in READ + BACKLOG:
                await twin.append(text)
            twin_state = await twin.state()
            assert {k: after[k] for k in ("tokens", "inputs", "data_version", "last_seq", "next_position")} == \
                   {k: twin_state[k] for k in ("tokens", "inputs", "data_version", "last_seq", "next_position")}
            again = await session.ask(QUESTION, **PLAIN)
            assert again.tokens == s.tokens > 0  # an answer to compare, not two empty ones
            assert again.text == (await twin.ask(QUESTION, **PLAIN)).text == s.text
            # and the read answer is the answer over exactly the read inputs
            short = await client.create_session()
            for text in READ:
                await short.append(text)
            assert r.tokens > 0 and (await short.ask(QUESTION, **PLAIN)).text == r.text

    serve(tiny_engine, test)


def test_query_done_says_what_it_was_asked_over(tiny_engine):
    """Without `over` (the default, "sent") and with nothing unread, both modes report it."""
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.request({"type": "input.text.append", "session_id": sid, "text": READ[0]})
        for over in (None, "sent", "read"):
            msg = {"type": "query.create", "session_id": sid, "question": "Who?", "max_tokens": 3, "stream": False}
            if over is not None:
                msg["over"] = over
            done = await peer.request(msg)
            assert done["type"] == "query.done", done
            assert (done["over"], done["unread_inputs"], done["data_version"]) == (over or "sent", 0, 1)

    serve(tiny_engine, test)


def test_bad_over_is_refused_and_the_connection_goes_on(tiny_engine):
    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        for value in ("later", "", 1, ["read"]):
            error = await peer.request({"type": "query.create", "session_id": sid, "question": "Who?", "over": value})
            err = check_error(error, "invalid_field")
            assert err["param"] == "over" and "'over'" in err["message"]
            assert error["session_id"] == sid
        await peer.still_serving(sid)
        async with await StreamerClient.connect(url) as client:  # the SDK passes the refusal on
            session = await client.create_session()
            try:
                await session.ask("Who?", over="now")
            except StreamerError as exc:
                assert exc.code == "invalid_field" and exc.param == "over" and exc.recoverable
            else:
                raise AssertionError("over='now' was accepted")

    serve(tiny_engine, test)


def test_the_sdk_sends_over_only_when_given(tiny_engine):
    async def test(url, server):
        async with await StreamerClient.connect(url) as client:
            session = await client.create_session()
            await session.append(READ[0])
            default = await session.ask("Who?", **PLAIN)
            read = await session.ask("Who?", over="read", **PLAIN)
            assert (default.over, default.unread_inputs) == ("sent", 0)
            assert (read.over, read.unread_inputs, read.data_version) == ("read", 0, 1)
            assert read.tokens == default.tokens > 0 and read.text == default.text

    serve(tiny_engine, test)
