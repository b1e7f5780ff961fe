"""Helpers for tests that talk to a real server over a real socket."""

import asyncio
import json

from websockets.asyncio.client import connect

from streamer.server import ServerConfig, StreamerServer


class Raw:
    """A bare websocket peer: sends exactly what a test says, reads events as dicts."""

    def __init__(self, ws):
        self.ws = ws
        self.sent = 0
        self.pending = []  # events that arrived while waiting for a reply

    async def send(self, msg):
        await self.ws.send(msg if isinstance(msg, (str, bytes)) else json.dumps(msg))

    async def recv(self, timeout=30.0):
        if self.pending:
            return self.pending.pop(0)
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, kind, timeout=60.0):
        """Events up to and including the first of type `kind`."""
        seen = []
        while True:
            event = await self.recv(timeout)
            seen.append(event)
            if event["type"] == kind:
                return seen

    async def request(self, msg):
        """Send and return the reply: the event whose reply_to is this message's event_id
        (events pushed meanwhile, like action chunks, are kept for `recv`)."""
        if isinstance(msg, dict) and "event_id" not in msg:
            self.sent += 1
            msg = {**msg, "event_id": f"t{self.sent}"}
        await self.send(msg)
        if not isinstance(msg, dict):
            return await self.recv()
        while True:
            event = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if event.get("reply_to") == msg["event_id"]:
                return event
            self.pending.append(event)

    async def create(self, **fields):
        created = await self.request({"type": "session.create", **fields})
        assert created["type"] == "session.created", created
        return created["session_id"]

    async def still_serving(self, sid):
        """The connection and the session work after whatever just happened."""
        ack = await self.request({"type": "input.text.append", "session_id": sid, "text": " Still here."})
        assert ack["type"] == "input.ack", ack
        await self.send({"type": "query.create", "session_id": sid, "question": "Ok?", "max_tokens": 3})
        events = await self.until("query.done")
        assert events[-1]["finish_reason"] in ("length", "stop")
        return ack


def serve(engine, test, **config):
    """Run `test(url, server)` against a real server on a free port."""

    async def main():
        server = await StreamerServer(engine, ServerConfig(port=0, **config)).start()
        try:
            return await test(f"ws://127.0.0.1:{server.port}", server)
        finally:
            await server.stop()

    return asyncio.run(main())


async def raw(url, api_key=None, **kwargs):
    if api_key is not None:
        kwargs["additional_headers"] = {"Authorization": f"Bearer {api_key}"}
    return Raw(await connect(url, max_size=None, **kwargs))


def check_error(event, code, recoverable=True):
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    assert event["error"]["recoverable"] is recoverable
    assert event["error"]["message"]
    return event["error"]


async def next_of(peer, kind, timeout=60):
    """The next event of type `kind`, skipping others."""
    while True:
        event = await peer.recv(timeout)
        if event["type"] == kind:
            return event
