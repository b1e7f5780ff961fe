"""Async Python client for a streamer service.

    async with await StreamerClient.connect("ws://127.0.0.1:8765") as client:
        session = await client.create_session()
        await session.append("The keeper's name is Ada Morrow. ")
        answer = await session.ask("Who is the keeper?")
        print(answer.text, answer.timing["total_ms"])

One reader task dispatches server events: replies resolve by `reply_to` (every command sends a
fresh `event_id`), query deltas go to the query's stream by `query_id`. An `error` event
becomes a `StreamerError` raised from the call that caused it.

Sessions it creates get SYSTEM_PROMPT, and its questions and flash questions ANSWER_STYLE,
where the call does not say otherwise: an explicit argument wins, and `system_prompt=None` or a
style field passed as None leaves that to the service's default. Without them the embedded model
answered "Who is the keeper?" after "The keeper's name is Ada Morrow." with "The document is a
collection of books...", and looped ("The video was cut to the next frame, and the next frame
was cut to the next frame, ...").
"""

from __future__ import annotations

import asyncio
import os
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

from streamer.protocol import command, media_frame, media_header
from streamer.sessions.errors import Code


CONNECTION_CLOSED = "connection_closed"  # the SDK's own code: the websocket closed under a request
# What sessions created here are told. The service's default speaks of a streamed document and
# asks for answers "briefly and accurately"; on the embedded model a few words answer the
# question asked, about text or video, where the default drifted ("a collection of books").
SYSTEM_PROMPT = "You are a helpful assistant. Answer in a few words."
# The answer style of questions and flash questions asked here (`streamer demo` asks with it too).
# The embedded model answers in its first sentence, then loops ("The island has 12 kittens. The
# island has 12 kittens. ...") or invents more; the end bias lets it stop after the sentence that
# answers, the frequency penalty breaks a loop that starts anyway (docs/protocol.md, "Penalties").
ANSWER_STYLE: dict[str, float] = {"frequency_penalty": 0.3, "end_bias": 3.0}


class StreamerError(Exception):
    """An `error` event from the server. `code` is a `Code` (streamer.sessions.errors), or the
    SDK's own `connection_closed`."""

    def __init__(self, code: str, message: str, recoverable: bool = True, param: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code: Code | str = Code(code) if code in Code._value2member_map_ else code
        self.message, self.recoverable, self.param = message, recoverable, param


@dataclass(slots=True)
class Ack:
    seq: int
    tokens: int
    total_tokens: int
    data_version: int
    lag_ms: float
    raw: dict = field(repr=False, default_factory=dict)


@dataclass(slots=True)
class Answer:
    query_id: str
    text: str
    finish_reason: str
    tokens: int
    data_version: int
    context_tokens: int
    timing: dict
    client_ms: float = 0.0  # round trip measured by the client: send -> query.done
    over: str = "sent"  # what it was asked over: "sent" (every input sent before it) or "read" (what was read)
    unread_inputs: int = 0  # inputs sent before the question that the answer did not see (0 for "sent")


class QueryStream:
    """Deltas of one running question; iterate for text pieces, then read `answer`."""

    def __init__(self, session: "Session", query_id: str) -> None:
        self.session = session
        self.query_id = query_id
        self.answer: Answer | None = None
        self._queue: asyncio.Queue[dict] = asyncio.Queue()

    def _feed(self, event: dict) -> None:
        self._queue.put_nowait(event)

    def __aiter__(self) -> AsyncIterator[str]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[str]:
        while True:
            event = await self._queue.get()
            if event["type"] == "query.delta":
                yield event["delta"]
            elif event["type"] == "error":
                err = event["error"]
                raise StreamerError(err["code"], err["message"], err.get("recoverable", True), err.get("param"))
            else:  # query.done
                self.answer = _answer(event)
                return

    async def result(self) -> Answer:
        async for _ in self:
            pass
        return self.answer

    async def cancel(self) -> None:
        await self.session.client.send(command("query.cancel", session_id=self.session.id, query_id=self.query_id))


def _answer(event: dict) -> Answer:
    return Answer(event["query_id"], event["text"], event["finish_reason"], event["tokens"],
                  event["data_version"], event["context_tokens"], event.get("timing", {}),
                  over=event.get("over", "sent"), unread_inputs=event.get("unread_inputs", 0))


class Session:
    """A server-side session seen from the client."""

    def __init__(self, client: "StreamerClient", created: dict) -> None:
        self.client = client
        self.id: str = created["session_id"]
        self.info: dict = created.get("session", {})
        self.model: str = created.get("model", "")
        self.tokens: dict[str, str] = created.get("tokens", {})  # role -> capability token
        self.subscribe_token: str | None = created.get("subscribe_token")  # give to read-only watchers
        # Inputs carry a client_seq; those not yet acknowledged are kept so `client.resume`
        # can resend exactly what the server lacks after a lost connection or a crashed worker.
        self.next_client_seq = 1
        self.unacked: dict[int, dict] = {}
        self.last_ack: Ack | None = None  # the newest input.ack (its lag_ms: how far behind the session reads)

    async def _input(self, msg: dict) -> Ack:
        if "client_seq" not in msg:
            msg["client_seq"] = self.next_client_seq
            self.next_client_seq += 1
        self.unacked[msg["client_seq"]] = msg
        event = await self.client.request(dict(msg))
        self.unacked.pop(msg["client_seq"], None)
        self.last_ack = _ack(event)
        return self.last_ack

    async def append(self, text: str) -> Ack:
        return await self._input(command("input.text.append", session_id=self.id, text=text))

    async def revise(self, text: str, from_seq: int | None = None) -> Ack:
        return await self._input(command("input.text.revise", session_id=self.id, text=text, from_seq=from_seq))

    async def end_input(self) -> dict:
        return await self.client.request(command("input.end", session_id=self.id))

    async def state(self) -> dict:
        return (await self.client.request(command("session.get", session_id=self.id)))["session"]

    async def ask_stream(self, question: str, *, over: str | None = None, **options: Any) -> QueryStream:
        """Start a question; returns its stream at once (options: max_tokens, temperature,
        top_p, top_k, seed, stop, repetition_penalty, presence_penalty, frequency_penalty, end_bias;
        ANSWER_STYLE where not given).
        `over="read"`: answer now over what the session has read, without waiting for its backlog
        of unread input (the answer's `unread_inputs` says how many inputs it did not see);
        "sent" (the server's default): over every input sent before the question."""
        options = {**ANSWER_STYLE, **options}  # what the call names wins
        query_id = options.pop("query_id", None) or f"c{next(self.client._ids)}"
        stream = QueryStream(self, query_id)
        self.client._streams[(self.id, query_id)] = stream
        msg = command("query.create", session_id=self.id, question=question, query_id=query_id, over=over,
                      **options)
        event_id = await self.client.send(msg)
        self.client._stream_by_event[event_id] = stream
        return stream

    async def ask(self, question: str, *, over: str | None = None, **options: Any) -> Answer:
        """Ask and wait for the whole answer (`over` and options as for `ask_stream`)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await (await self.ask_stream(question, over=over, **options)).result()
        answer.client_ms = round((loop.time() - started) * 1000, 2)
        return answer

    async def register_flash(self, question: str, **options: Any) -> dict:
        """Register a flash question (options: flash_id, max_tokens, priority, min_interval_ms,
        confirm, repetition_penalty, presence_penalty, frequency_penalty, end_bias; ANSWER_STYLE
        unless given); its `flash.updated` events arrive on `client.events()`."""
        msg = command("flash.register", session_id=self.id, question=question, **{**ANSWER_STYLE, **options})
        return (await self.client.request(msg))["flash"]

    async def unregister_flash(self, flash_id: str) -> None:
        await self.client.request(command("flash.unregister", session_id=self.id, flash_id=flash_id))

    async def set_thinking(self, **thinking: Any) -> dict:
        """Change the thinking settings (mode="off"|"interleaved"|"dual", unit_tokens, ...)."""
        msg = command("session.update", session_id=self.id, thinking=thinking)
        return (await self.client.request(msg))["session"]

    async def send_media(self, kind: str, fmt: str, payload: bytes, seq: int, ts: float | None = None,
                         **extra: Any) -> None:
        """Send one binary media frame (docs/protocol.md, "Media frames"). Its `input.ack`
        (with `media_seq`), `media.observation` and `media.transcript` events arrive on
        `client.events()`; `extra`: sample_rate, channels, end, live."""
        header = media_header(session_id=self.id, kind=kind, format=fmt, seq=seq,
                              ts=time.time() if ts is None else ts, **extra)
        await self.client.ws.send(media_frame(header, payload))

    async def close(self) -> dict:
        return await self.client.request(command("session.close", session_id=self.id))


def _ack(event: dict) -> Ack:
    return Ack(event.get("seq", 0), event.get("tokens", 0), event.get("total_tokens", 0),
               event.get("data_version", 0), event.get("lag_ms", 0.0), event)


class StreamerClient:
    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[str, asyncio.Future] = {}
        self._streams: dict[tuple[str, str], QueryStream] = {}
        self._stream_by_event: dict[str, QueryStream] = {}
        self.unsolicited: asyncio.Queue[dict] = asyncio.Queue()  # events no call waits for
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(cls, url: str, api_key: str | None = None, **kwargs: Any) -> "StreamerClient":
        """Open a connection; `api_key` (default: $STREAMER_API_KEY) lets it create sessions."""
        kwargs.setdefault("max_size", 16 << 20)
        api_key = api_key or os.environ.get("STREAMER_API_KEY")
        if api_key:
            kwargs["additional_headers"] = {**dict(kwargs.get("additional_headers") or {}),
                                            "Authorization": f"Bearer {api_key}"}
        return cls(await connect(url, **kwargs))

    async def __aenter__(self) -> "StreamerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()

    async def create_session(self, system_prompt: str | None = SYSTEM_PROMPT, session_id: str | None = None,
                             flash: list[dict] | None = None, thinking: dict | None = None,
                             window: dict | None = None) -> Session:
        """A new session (`system_prompt=None`: the service's default prompt; each `flash`
        question takes ANSWER_STYLE where it does not say)."""
        flash = [{**ANSWER_STYLE, **question} for question in flash] if flash else flash
        msg = command("session.create", system_prompt=system_prompt, session_id=session_id, flash=flash,
                      thinking=thinking, window=window)
        return Session(self, await self.request(msg))

    async def resume(self, session: Session | str, token: str | None = None) -> Session:
        """Re-attach to a session after a lost connection, a restart or a failover (its
        producer token: `session.tokens["producer"]`). Given the old `Session`, inputs it sent
        that the server never logged are resent, in order; the rest are not (no duplicates).
        A `moved` StreamerError names the worker that owns the session; behind a cluster's
        proxy use streamer.clients.failover.ClusterSession, which retries the same URL instead
        and never raises `moved`."""
        old = session if isinstance(session, Session) else None
        sid = old.id if old is not None else session
        token = token or (old.tokens.get("producer") if old is not None else None)
        if not token:
            raise ValueError("resume needs the session's producer token")
        resumed = await self.request(command("session.resume", session_id=sid, token=token))
        new = Session(self, {"session_id": sid, "session": resumed["session"],
                             "tokens": old.tokens if old is not None else {"producer": token}})
        new.resumed = resumed
        if old is not None:
            new.next_client_seq = max(old.next_client_seq, resumed["last_client_seq"] + 1)
            for seq, msg in sorted(old.unacked.items()):
                if seq > resumed["last_client_seq"]:
                    await new._input(dict(msg))
        return new

    async def subscribe(self, session_id: str, token: str) -> dict:
        """Watch another connection's session read-only; returns its state. Its events
        (`flash.updated`, `reasoning.*`) arrive on `events()`."""
        return (await self.request(command("subscribe", session_id=session_id, token=token)))["session"]

    async def events(self) -> AsyncIterator[dict]:
        """Events no call waits for: flash.updated, reasoning.delta/done, ..."""
        while True:
            yield await self.unsolicited.get()

    async def send(self, msg: dict) -> str:
        event_id = msg.setdefault("event_id", f"c{next(self._ids)}")
        await self.ws.send(json.dumps(msg))
        return event_id

    async def request(self, msg: dict, timeout: float | None = None) -> dict:
        """Send a command and wait for the event that replies to it; errors raise."""
        event_id = f"c{next(self._ids)}"
        msg["event_id"] = event_id
        fut = asyncio.get_running_loop().create_future()
        self._pending[event_id] = fut
        try:
            await self.ws.send(json.dumps(msg))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(event_id, None)

    async def _read(self) -> None:
        why = "connection closed"
        try:
            async for frame in self.ws:
                self._dispatch(json.loads(frame))
        except Exception as exc:  # connection gone (cut, not closed): fail everything that waits
            why = f"connection closed: {exc}"
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        for stream in self._streams.values():  # running questions end with the error, however it closed
            stream._feed({"type": "error", "error": {"code": CONNECTION_CLOSED, "message": "connection closed",
                                                     "recoverable": False}})

    def _dispatch(self, event: dict) -> None:
        kind = event.get("type")
        if kind in ("query.delta", "query.done"):
            stream = self._streams.get((event.get("session_id"), event.get("query_id")))
            if stream is not None:
                stream._feed(event)
                if kind == "query.done":
                    self._streams.pop((stream.session.id, stream.query_id), None)
                    self._stream_by_event.pop(event.get("reply_to"), None)
                return
        reply_to = event.get("reply_to")
        if kind == "error" and reply_to in self._stream_by_event:
            stream = self._stream_by_event.pop(reply_to)
            self._streams.pop((stream.session.id, stream.query_id), None)
            stream._feed(event)
            return
        fut = self._pending.get(reply_to)
        if fut is not None and not fut.done():
            if kind == "error":
                err = event["error"]
                fut.set_exception(StreamerError(err["code"], err["message"], err.get("recoverable", True),
                                                err.get("param")))
            else:
                fut.set_result(event)
            return
        self.unsolicited.put_nowait(event)
