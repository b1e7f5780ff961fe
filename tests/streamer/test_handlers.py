"""The command table without a socket: a handler takes a parsed command, a peer whose `send`
collects events and the server's services, and says what to answer; the engine is driven by
hand, the store is the in-process one."""

import asyncio
import json
from collections import defaultdict

import pytest
from helpers import Deadline, driven

from streamer import handlers
from streamer.directory import Directory
from streamer.eventlog import EventLog
from streamer.handlers import Await, Peer, Services
from streamer.protocol import ServerProtocol
from streamer.resume import Resumer
from streamer.server import ServerConfig
from streamer.sessions.errors import EngineError
from streamer.snapshots import Snapshots
from streamer.store import Store, StoreError


def services(engine, store=None):
    store = store or Store()
    directory = Directory(keys_enabled=False, sessions_per_key=32)
    events = EventLog(store, directory)
    snapshots = Snapshots(engine, store, directory, lambda sid, snap: None)
    resumer = Resumer(engine, store, directory, events, snapshots)
    return Services(engine, ServerConfig(), directory, events, resumer, snapshots, store,
                    take_over=lambda sid, peer: None, edge=defaultdict(int))


def peer():
    sent = []
    return Peer(ServerProtocol(), sent.append, asyncio.get_running_loop()), sent


def command(proto, **msg):
    return proto.receive_text(json.dumps(msg))


async def settle(engine, outcome):
    """Run the engine until the handler's outcome is answered; the reply as a dict."""
    assert isinstance(outcome, Await)
    future = outcome.future
    future = asyncio.wrap_future(future) if not asyncio.isfuture(future) else future
    deadline = Deadline(60, "the engine to answer the handler's command")
    while not future.done():  # the event log's task logs the change, then hands it to the engine
        deadline.check()
        engine.run_until_idle()
        await asyncio.sleep(0.001)
    result = await future
    if outcome.durable is not None:
        await outcome.durable
    reply = outcome.reply(result)
    if asyncio.iscoroutine(reply):
        reply = await reply
    return json.loads(reply)


def test_create_append_ask_and_what_the_log_holds(tiny):
    engine = driven(tiny[0])

    async def run():
        svc, (p, sent) = services(engine), peer()
        created = await settle(engine, handlers.session_create(command(p.proto, type="session.create",
                                                                       event_id="c1"), p, svc))
        sid = created["session_id"]
        assert created["type"] == "session.created" and created["reply_to"] == "c1" and sid in p.sessions
        ack = await settle(engine, handlers.input_append(command(p.proto, type="input.text.append", session_id=sid,
                                                                 text="Ada keeps the light.", client_seq=1,
                                                                 event_id="a1"), p, svc))
        assert (ack["type"], ack["reply_to"], ack["seq"], ack["client_seq"]) == ("input.ack", "a1", 1, 1)
        log = await svc.store.read_log(sid)
        assert [r["kind"] for r in log] == ["create", "append"]  # durable before the ack was made
        assert log[1]["text"] == "Ada keeps the light." and log[1]["client_seq"] == 1
        assert log[1]["first"] is True and "seq" not in log[1]  # logged before it was applied
        again = handlers.input_append(command(p.proto, type="input.text.append", session_id=sid, text="x",
                                              client_seq=1, event_id="a2"), p, svc)
        assert json.loads(again)["duplicate"] is True  # answered at once, not applied
        answer = await settle(engine, handlers.query_create(command(p.proto, type="query.create", session_id=sid,
                                                                    question="Who?", max_tokens=3,
                                                                    event_id="q1"), p, svc))
        assert answer["type"] == "query.done" and answer["reply_to"] == "q1" and answer["tokens"] >= 1
        await asyncio.sleep(0)  # the deltas were handed to the loop by the engine thread's callback
        deltas = [json.loads(e) for e in sent if '"query.delta"' in e]
        assert "".join(d["delta"] for d in deltas) == answer["text"]
        assert (await svc.store.read_log(sid))[-1]["kind"] == "append"  # a question is not logged

    asyncio.run(run())


def test_refusals_are_raised_with_their_codes(tiny):
    engine = driven(tiny[0])

    async def run():
        svc, (owner, _), (stranger, _) = services(engine), peer(), peer()
        sid = (await settle(engine, handlers.session_create(command(owner.proto, type="session.create"),
                                                            owner, svc)))["session_id"]
        for kind, fields in (("input.text.append", {"text": "x"}), ("session.get", {}), ("query.create",
                                                                                          {"question": "q"})):
            with pytest.raises(EngineError) as info:
                handlers.HANDLERS[kind](command(stranger.proto, type=kind, session_id=sid, **fields), stranger, svc)
            assert info.value.code == "session_not_found"
        stranger.subscriptions[sid] = object()  # a read-only peer may read, never write
        with pytest.raises(EngineError) as info:
            handlers.input_append(command(stranger.proto, type="input.text.append", session_id=sid, text="x"),
                                  stranger, svc)
        assert info.value.code == "forbidden"
        gone = handlers.flash_unregister(command(owner.proto, type="flash.unregister", session_id=sid,
                                                 flash_id="nope"), owner, svc)
        with pytest.raises(EngineError) as info:
            await settle(engine, gone)
        assert info.value.code == "flash_not_found"
        with pytest.raises(EngineError) as info:
            handlers.session_update(command(owner.proto, type="session.update", session_id=sid), owner, svc)
        assert info.value.code == "missing_field"

    asyncio.run(run())


class FailingStore(Store):
    """An in-process store whose appends fail once `down` is set."""

    down = False

    async def append(self, session_id, record, n=None, rid=None):
        if self.down:
            raise StoreError("the store is down")
        return await super().append(session_id, record, n, rid)


def test_a_change_the_store_cannot_log_is_not_acknowledged(tiny):
    engine = driven(tiny[0])

    async def run():
        store = FailingStore()
        svc, (p, _) = services(engine, store), peer()
        sid = (await settle(engine, handlers.session_create(command(p.proto, type="session.create"), p, svc)))[
            "session_id"]
        store.down = True
        append = lambda seq: handlers.input_append(command(p.proto, type="input.text.append",  # noqa: E731
                                                           session_id=sid, text="lost?", client_seq=seq), p, svc)
        with pytest.raises(EngineError) as info:
            await settle(engine, append(1))
        assert info.value.code == "store_unavailable" and info.value.recoverable
        assert svc.events.counters["log_errors"] == 1
        state = await asyncio.wrap_future(engine.session_state(sid))
        assert state["inputs"] == 0 and state["last_seq"] == 0  # not applied, no seq taken
        with pytest.raises(EngineError) as later:  # an input above the failed one waits for its resend
            await settle(engine, append(2))
        assert later.value.code == "store_unavailable" and "resend from" in later.value.message
        store.down = False
        ack = await settle(engine, append(1))  # the resend is accepted, not a duplicate
        assert ack["type"] == "input.ack" and ack["seq"] == 1 and not ack.get("duplicate")
        assert (await settle(engine, append(2)))["seq"] == 2
        assert json.loads(append(2))["duplicate"] is True
        kinds = [r["kind"] for r in await store.read_log(sid)]
        assert kinds == ["create", "void", "append", "append"]  # the failed write's position is fenced

    asyncio.run(run())
