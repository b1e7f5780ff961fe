"""Sessions that outlive their worker: reconnect through one URL and resume, with no help from
the caller (docs/cluster.md).

    session = await ClusterSession.create("ws://proxy:8700", flash=[{"question": "Who is here?"}])
    await session.append("row 1 ...")          # a worker dies: this call reconnects and resumes
    answer = await session.ask("Who is here?")
    async for event in session.events():       # flash.updated etc., across reconnects
        ...

Every websocket of the session goes to the same URL with `?session=<id>`, the key a proxy
hashes (streamer.cluster): the id is chosen here, so the session is created on the worker the
proxy routes it to, and every reconnect reaches the worker that owns it now. When the
connection drops (its worker died) or the server answers `moved` (a worker that has not yet
seen the owner's death), the session reconnects through the same URL with backoff for up to
`reconnect_timeout_s`, resumes with its producer token, and resends the inputs the server never
logged (client_seq makes a resend idempotent). A call that failed with the connection is then
finished: an input by its resend, a question asked again. `moved` never reaches the caller.
`ClusterWatcher` does the same for a read-only subscriber.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

from websockets.exceptions import ConnectionClosed, InvalidHandshake

from .client import CONNECTION_CLOSED, Ack, Answer, Session, StreamerClient, StreamerError

log = logging.getLogger(__name__)

ROUTE_PARAM = "session"  # streamer.cluster.ROUTE_PARAM
# Failures after which the session reconnects and resumes: the socket went away, or the server
# says another (or no live) worker holds it for now.
RETRY_CODES = {CONNECTION_CLOSED, "moved", "shutting_down", "store_unavailable"}


def routed_url(url: str, key: str) -> str:
    """`url` with `?session=<key>` (any other query parameters kept)."""
    parts = urlsplit(url)
    query = "&".join(p for p in parts.query.split("&") if p and not p.startswith(f"{ROUTE_PARAM}="))
    query = f"{query}&" if query else ""
    return urlunsplit(parts._replace(query=f"{query}{ROUTE_PARAM}={quote(key, safe='')}"))


def _retryable(exc: BaseException, codes: frozenset[str] | set[str] = RETRY_CODES) -> bool:
    if isinstance(exc, StreamerError):
        return str(exc.code) in codes
    return isinstance(exc, (ConnectionError, ConnectionClosed, InvalidHandshake, OSError, asyncio.TimeoutError))


class _Reconnecting:
    """One connection at a time to `url?session=<key>`, replaced when it fails."""

    def __init__(self, url: str, key: str, api_key: str | None, reconnect_timeout_s: float) -> None:
        self.url = routed_url(url, key)
        self.key, self.api_key = key, api_key
        self.reconnect_timeout_s = reconnect_timeout_s
        self.client: StreamerClient | None = None
        self.reconnects = 0
        self._generation = 0
        self._lock = asyncio.Lock()
        self._events: asyncio.Queue[dict] = asyncio.Queue()
        self._pump: asyncio.Task | None = None
        self._closed = False

    async def _connect(self) -> StreamerClient:
        client = await StreamerClient.connect(self.url, api_key=self.api_key, open_timeout=5)
        if self._pump is not None:
            self._pump.cancel()
        self._pump = asyncio.get_running_loop().create_task(self._forward(client))
        self.client = client
        return client

    async def _forward(self, client: StreamerClient) -> None:
        while True:
            self._events.put_nowait(await client.unsolicited.get())

    retry_codes = RETRY_CODES

    async def _again(self, generation: int, attach: Callable[[StreamerClient], Awaitable[None]]) -> None:
        """Reconnect (once for all the calls that failed on connection `generation`) and `attach`
        the session on the new connection; retried with backoff until `reconnect_timeout_s`."""
        async with self._lock:
            if generation != self._generation:
                return  # another call reconnected meanwhile
            loop = asyncio.get_running_loop()
            deadline, delay = loop.time() + self.reconnect_timeout_s, 0.1
            while True:
                old = self.client
                try:
                    if old is not None:
                        await old.close()
                    client = await self._connect()
                    await attach(client)
                    break
                except Exception as exc:
                    if not _retryable(exc, self.retry_codes) or loop.time() > deadline:
                        raise
                    log.info("session %s: reconnecting through %s (%s)", self.key, self.url, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            self._generation += 1
            self.reconnects += 1

    async def events(self) -> AsyncIterator[dict]:
        """Events no call waits for (flash.updated, reasoning.*, ...), across reconnects."""
        while True:
            yield await self._events.get()

    async def _close_connection(self) -> None:
        self._closed = True
        if self._pump is not None:
            self._pump.cancel()
        if self.client is not None:
            await self.client.close()


class ClusterSession(_Reconnecting):
    """A producer's session that reconnects and resumes on its own (see the module doc)."""

    session: Session

    @classmethod
    async def create(cls, url: str, session_id: str | None = None, api_key: str | None = None,
                     reconnect_timeout_s: float = 60.0, **create: Any) -> "ClusterSession":
        """Create a session with id `session_id` (default: a random one) through `url`; `create`:
        the arguments of StreamerClient.create_session."""
        self = cls(url, session_id or f"s-{secrets.token_hex(8)}", api_key, reconnect_timeout_s)
        client = await self._connect()
        self.session = await client.create_session(session_id=self.key, **create)
        return self

    @property
    def id(self) -> str:
        return self.session.id

    async def _resume(self, client: StreamerClient) -> None:
        self.session = await client.resume(self.session)

    async def _call(self, op: Callable[[Session], Awaitable[Any]], redo: bool = True) -> Any:
        while True:
            generation, session = self._generation, self.session
            try:
                return await op(session)
            except Exception as exc:
                if self._closed or not _retryable(exc):
                    raise
                await self._again(generation, self._resume)
                if not redo:  # an input: resuming resent it if the server had not logged it
                    return self.session.last_ack

    async def append(self, text: str) -> Ack | None:
        """Append text; after a failover, the ack of its resend (None: the old worker had logged
        it before it died, so nothing was resent)."""
        async def op(session: Session) -> Ack:
            return await session.append(text)

        return await self._call(op, redo=False)

    async def ask(self, question: str, **options: Any) -> Answer:
        return await self._call(lambda s: s.ask(question, **options))

    async def register_flash(self, question: str, **options: Any) -> dict:
        return await self._call(lambda s: s.register_flash(question, **options))

    async def state(self) -> dict:
        return await self._call(lambda s: s.state())

    async def close(self) -> dict | None:
        try:
            return await self._call(lambda s: s.close())
        finally:
            await self._close_connection()


class ClusterWatcher(_Reconnecting):
    """A read-only subscriber (its subscribe token) that re-subscribes after a failover; its
    events arrive on `events()`. `key`: the session's route key (the id its creator chose).
    `session_not_found` is retried too: until the dead owner's lease runs out and the session
    is adopted, the worker the proxy now picks does not have it yet."""

    retry_codes = RETRY_CODES | {"session_not_found"}

    @classmethod
    async def subscribe(cls, url: str, session_id: str, token: str, key: str | None = None,
                        api_key: str | None = None, reconnect_timeout_s: float = 60.0) -> "ClusterWatcher":
        self = cls(url, key or session_id, api_key, reconnect_timeout_s)
        self.session_id, self.token = session_id, token
        self._watch = asyncio.get_running_loop().create_task(self._keep())
        await self._again(0, self._subscribe)
        return self

    async def _subscribe(self, client: StreamerClient) -> None:
        await client.subscribe(self.session_id, self.token)
        self._events.put_nowait({"type": "watcher.subscribed", "session_id": self.session_id,
                                 "reconnects": self.reconnects})

    async def _keep(self) -> None:
        """Re-subscribe whenever the connection ends (its worker died)."""
        while not self._closed:
            client, generation = self.client, self._generation
            if client is None:
                await asyncio.sleep(0.05)
                continue
            await client.ws.wait_closed()
            if self._closed:
                return
            try:
                await self._again(generation, self._subscribe)
            except Exception as exc:
                log.warning("watcher of session %s gave up: %s", self.session_id, exc)
                return

    async def close(self) -> None:
        self._watch.cancel()
        await self._close_connection()
