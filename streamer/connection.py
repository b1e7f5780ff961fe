"""One websocket connection: the receive loop, and running what the command handlers answer.

Frames are parsed by the sans-I/O protocol and handed to the command table (streamer.handlers)
in arrival order; engine calls only enqueue, so a busy model never blocks this loop. Replies
that wait on the engine or the store run in small tasks, and every outbound event goes through
the connection's one ordered `Outbox`.

Limits: every frame, before it is parsed, takes from the message and byte rate buckets; a
frame over them is dropped unparsed. Refused and invalid frames take from a third bucket; a
connection that empties it is closed (rate_limited, 1008). Then the shutdown check.
Backpressure: reading pauses while the client's commands wait on the engine beyond
`max_inflight`, or its undelivered events pass the outbox's high watermark.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import time
from concurrent.futures import Future

from websockets.asyncio.server import ServerConnection

from streamer.sessions.errors import EngineError

from .handlers import HANDLERS, Await, Peer, Services
from .outbox import Outbox
from .protocol import Command, ProtocolError, ServerProtocol
from .store import StoreError

log = logging.getLogger(__name__)

# Commands that go through the session's event log pipeline (streamer.eventlog), in its order;
# any other command about a session waits until the changes sent before it are in the engine.
LOGGED = frozenset({"input.text.append", "input.text.revise", "input.end", "session.update", "flash.register",
                    "flash.unregister"})


class InvalidText:
    """What `recv` returns for a text frame that is not UTF-8 (the frame is consumed)."""

    def __init__(self, exc: UnicodeDecodeError) -> None:
        self.exc = exc


class _QuietHttpLog(logging.LoggerAdapter):
    """A connection's log in which a plain HTTP request answered below 400 (a health check,
    /metrics, a page) logs its "HTTP response sent" and "connection closed" lines at debug: a
    proxy probing /healthz every few seconds would otherwise fill the service log. Refusals
    (401, 404, ...) and websocket connections keep their INFO lines."""

    def __init__(self, inner: logging.Logger | logging.LoggerAdapter) -> None:
        super().__init__(inner, {})
        self.quiet = False

    def process(self, msg, kwargs):
        return msg, kwargs

    def log(self, level: int, msg, *args, **kwargs) -> None:
        if level == logging.INFO and msg.startswith("HTTP response sent") and args and args[0] < 400:
            self.quiet = True
        if self.quiet and level == logging.INFO:
            level = logging.DEBUG
        self.logger.log(level, msg, *args, **kwargs)


class LenientConnection(ServerConnection):
    """RFC 6455 says a text frame with invalid UTF-8 fails the connection (1007). A session
    holds accepted data and live state that a client bug should not cost, so we answer with an
    `invalid_utf8` error event instead and keep the connection; everything else is unchanged.
    Plain HTTP requests that succeed log at debug (`_QuietHttpLog`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.protocol.logger = self.logger = _QuietHttpLog(self.protocol.logger)

    async def recv(self, decode: bool | None = None):
        try:
            return await self.recv_messages.get(decode)
        except UnicodeDecodeError as exc:
            return InvalidText(exc)
        except EOFError:  # closed: surface it exactly like the base class does
            await asyncio.shield(self.connection_lost_waiter)
            raise self.close_exc from None


class TokenBucket:
    """A sustained rate with a burst allowance."""

    __slots__ = ("rate", "burst", "level", "stamp", "extra")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.stamp = rate, burst, float(burst), time.monotonic()
        self.extra = 0.0  # credit beyond the burst: what arrived at the allowed rate while we did not read

    def credit(self, seconds: float) -> None:
        """The server paused reading for `seconds` (backpressure): frames that arrived meanwhile
        at up to the allowed rate are not a burst when they are read back to back."""
        self.extra = min(self.extra + seconds * self.rate, 60 * self.rate)

    def take(self, amount: float = 1.0) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level < amount and self.extra >= amount:
            self.extra -= amount
            return True
        if self.level < amount:
            return False
        self.level -= amount
        return True


class Connection:
    """One client connection: a `Peer` for the handlers, its outbox, its receive loop."""

    def __init__(self, ws: ServerConnection, svc: Services, key_name: str | None, media=None,
                 shutting_down=lambda: False) -> None:
        cfg = svc.config
        self.ws, self.svc, self.config = ws, svc, cfg
        self.proto = ServerProtocol(cfg.protocol)
        self.loop = asyncio.get_running_loop()
        self.outbox = Outbox(ws, self.proto, cfg, self.update_reading, self._dropped)
        remote = ws.remote_address[0] if ws.remote_address else None
        self.peer = Peer(self.proto, self.outbox.send, self.loop, key_name, client=key_name or remote)
        self.unfinished: dict[int, Command] = {}  # commands whose reply is still to come
        self.peer.media = media(self.peer) if media is not None else None
        self.shutting_down = shutting_down
        self.inflight = 0
        self.reading = asyncio.Event()  # cleared while backpressure pauses reading
        self.paused_at: float | None = None
        self.reading.set()
        self.messages = TokenBucket(cfg.messages_per_s, cfg.messages_burst)
        self.bytes_in = TokenBucket(cfg.bytes_per_s, max(cfg.bytes_burst, cfg.max_frame_bytes))
        self.strikes = TokenBucket(cfg.refused_per_s, cfg.refused_burst)
        self.last_message = time.monotonic()
        self.tasks: set[asyncio.Task] = set()
        if cfg.send_buffer_bytes and ws.transport is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)

    def send(self, text: str) -> None:
        self.outbox.send(text)

    def _dropped(self, code: str) -> None:
        self.svc.edge["slow_consumers_dropped" if code == "slow_consumer" else "idle_closed"] += 1

    def update_reading(self) -> None:
        cfg = self.config
        if self.outbox.congested or self.inflight > cfg.max_inflight:
            if self.reading.is_set():
                self.svc.edge["backpressure_pauses"] += 1
                self.paused_at = time.monotonic()
            self.reading.clear()
        elif self.inflight <= cfg.max_inflight // 2:
            if not self.reading.is_set() and self.paused_at is not None:
                paused = time.monotonic() - self.paused_at  # what queued in the socket meanwhile is no flood
                self.messages.credit(paused)
                self.bytes_in.credit(paused)
                self.paused_at = None
            self.reading.set()

    async def watchdog(self) -> None:
        """Slow consumers and idle connections, checked a few times a second."""
        cfg, peer = self.config, self.peer
        while self.outbox.dropping is None:
            await asyncio.sleep(min(0.25, cfg.slow_consumer_s / 4, cfg.idle_timeout_s / 4))
            now = time.monotonic()
            self.outbox.check_slow(now)
            if (self.outbox.dropping is None and not peer.sessions and not peer.subscriptions
                    and now - self.last_message > cfg.idle_timeout_s):
                self.outbox.drop("idle_timeout", f"no message for {cfg.idle_timeout_s:g} s and no session or "
                                 "subscription", close_code=1000)

    # ---- the receive loop ------------------------------------------------------------------

    async def run(self) -> None:
        writer = self.loop.create_task(self.outbox.writer())
        watchdog = self.loop.create_task(self.watchdog())
        try:
            while True:
                if not self.reading.is_set():  # backpressure; a close still ends the wait
                    resumed = self.loop.create_task(self.reading.wait())
                    closed = self.loop.create_task(self.ws.wait_closed())
                    await asyncio.wait({resumed, closed}, return_when=asyncio.FIRST_COMPLETED)
                    resumed.cancel()
                    closed.cancel()
                if self.outbox.dropping is not None:
                    break  # being dropped: read nothing more (the writer says why and closes)
                frame = await self.ws.recv()
                self.last_message = time.monotonic()
                if self.outbox.dropping is None:
                    await self.receive(frame)
        finally:
            watchdog.cancel()
            if self.outbox.dropping is None:
                writer.cancel()
            else:  # let the writer tell the client why, then close
                await asyncio.wait({writer}, timeout=5)
                writer.cancel()

    async def receive(self, frame) -> None:
        """One frame: count it against the rate limits (valid or not, before any parsing), parse
        it, hand it to its handler. A connection that keeps sending frames that are refused or
        invalid is closed (rate_limited, 1008)."""
        size = len(frame.exc.object) if isinstance(frame, InvalidText) else len(frame)
        if (refusal := self.over_rate(size)) is not None:
            self.strike(refusal)
            return
        if isinstance(frame, InvalidText):
            self.strike(self.proto.protocol_error(self.proto.invalid_utf8(frame.exc)))
            return
        try:
            if isinstance(frame, str):
                cmd = self.proto.receive_text(frame)
            elif self.peer.media is None:
                cmd = self.proto.refuse_binary(frame)
            else:
                cmd = self.proto.receive_binary(frame)
        except ProtocolError as err:
            self.strike(self.proto.protocol_error(err))
            return
        if self.shutting_down():
            self.send(self.proto.error("shutting_down", "the server is shutting down; reconnect later",
                                       recoverable=False, reply_to=cmd.event_id, session_id=cmd.session_id))
            return
        if cmd.type not in LOGGED and (barrier := self.svc.events.barrier(cmd.session_id)) is not None:
            await barrier  # the session's earlier changes are handed to the engine first
        self.dispatch(cmd)
        if cmd.type == "media" and self.peer.media is not None:
            await self.peer.media.throttle(cmd)

    def over_rate(self, size: int) -> str | None:
        """The error for a frame over the message or byte rate (it is then not even parsed, so
        the error has no `reply_to`)."""
        cfg = self.config
        if not self.messages.take():
            self.svc.edge["rate_limited"] += 1
            return self.proto.error("rate_limited", f"more than {cfg.messages_per_s:g} messages/s (burst "
                                    f"{cfg.messages_burst}) on this connection; the message was not processed")
        if not self.bytes_in.take(size):
            self.svc.edge["rate_limited"] += 1
            return self.proto.error("byte_rate_limited", f"more than {cfg.bytes_per_s:g} bytes/s on this "
                                    "connection; the message was not processed")
        return None

    def strike(self, error: str) -> None:
        """Send the error for a refused or invalid frame, while the connection's allowance of
        them lasts; past it the connection is closed: a flood of junk costs the server little
        and the other clients nothing."""
        if self.strikes.take():
            self.send(error)
            return
        self.svc.edge["junk_closed"] = self.svc.edge.get("junk_closed", 0) + 1
        cfg = self.config
        self.outbox.drop("rate_limited", f"more than {cfg.refused_per_s:g} refused or invalid frames/s (burst "
                         f"{cfg.refused_burst}) on this connection; closing it", close_code=1008)

    def dispatch(self, cmd: Command) -> None:
        """Run the command's handler and what it answers."""
        try:
            outcome = HANDLERS[cmd.type](cmd, self.peer, self.svc)
        except Exception as exc:
            self.send(self.error_for(cmd, exc))
            return
        if isinstance(outcome, str):
            self.send(outcome)
        elif isinstance(outcome, Await):
            self.spawn(self.finish(cmd, outcome))
        elif inspect.iscoroutine(outcome):
            self.spawn(self.later(cmd, outcome))

    def error_for(self, cmd: Command, exc: BaseException) -> str:
        """An `error` event answering `cmd`: the engine's or a refusal's code, or internal_error
        for a bug (logged; the connection keeps serving)."""
        if isinstance(exc, EngineError):
            return self.proto.error(exc.code, exc.message, recoverable=exc.recoverable, reply_to=cmd.event_id,
                                    session_id=cmd.session_id, param=exc.param)
        if isinstance(exc, StoreError):  # a store call no handler wrapped: still the store's fault
            return self.proto.error("store_unavailable", f"{cmd.type}: the store is unavailable ({exc}); retry",
                                    reply_to=cmd.event_id, session_id=cmd.session_id)
        log.error("%s failed", cmd.type, exc_info=exc)
        return self.proto.error("internal_error", f"{cmd.type} failed: {exc}", reply_to=cmd.event_id,
                                session_id=cmd.session_id)

    def spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def shutdown_replies(self) -> int:
        """The server stops before these commands finish: each gets a final `shutting_down`
        error naming it, so no answer is cut silently. Returns how many."""
        for cmd in list(self.unfinished.values()):
            self.send(self.proto.error("shutting_down", f"the server shut down before this {cmd.type} finished; "
                                       "reconnect (resume your session) and send it again",
                                       reply_to=cmd.event_id, session_id=cmd.session_id))
        count = len(self.unfinished)
        self.unfinished.clear()
        return count

    async def finish(self, cmd: Command, outcome: Await) -> None:
        """Wait for the engine's future (and the log write of the change), then reply."""
        self.unfinished[id(cmd)] = cmd
        self.inflight += 1
        if self.inflight > self.config.max_inflight:
            self.update_reading()
        try:
            # shielded: a connection that goes away must not cancel the engine's future (the
            # engine finishes the work; sessions made after their client left are closed)
            future = outcome.future
            result = await asyncio.shield(asyncio.wrap_future(future) if isinstance(future, Future) else future)
            if outcome.durable is not None:
                await asyncio.shield(outcome.durable)
            reply = outcome.reply(result)
            if inspect.isawaitable(reply):
                reply = await asyncio.shield(reply)
        except Exception as exc:
            if self.unfinished.pop(id(cmd), None) is not None:
                self.send(self.error_for(cmd, exc))
        else:
            if self.unfinished.pop(id(cmd), None) is not None:  # not already answered by a shutdown
                self.send(reply)
        finally:
            self.unfinished.pop(id(cmd), None)
            self.inflight -= 1
            if not self.reading.is_set():
                self.update_reading()

    async def later(self, cmd: Command, coro) -> None:
        try:
            reply = await coro
        except Exception as exc:
            self.send(self.error_for(cmd, exc))
        else:
            if reply is not None:
                self.send(reply)

    async def cleanup(self, detach) -> None:
        """The client is gone: stop its work and listeners; its sessions are detached."""
        peer, engine = self.peer, self.svc.engine
        peer.closed = True
        if peer.media is not None:
            peer.media.close()
        for task in list(self.tasks):
            task.cancel()
        for handle in peer.queries.values():
            handle.cancel()
        for sid, listener in peer.subscriptions.items():
            engine.remove_listener(sid, listener)
        peer.subscriptions.clear()
        for sid in list(peer.sessions):
            peer.stop_producing(engine, sid)
            detach(sid, peer.client)
