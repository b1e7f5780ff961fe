"""The asyncio websocket service: one port for websocket sessions and plain HTTP (`/healthz`).

Each connection is a receive loop and a writer task. The receive loop parses frames with the
sans-I/O protocol and hands commands to the engine in arrival order (the engine calls only
enqueue, so a busy model never blocks this loop); replies are awaited in small tasks and all
outbound events go through one bounded queue, so their order is the order they were made.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from streamer.sessions.engine import Engine
from streamer.sessions.errors import EngineError
from streamer.sessions.sampling import SamplingParams

from .auth import ApiKeys, SessionTokens, key_from_request
from .dashboard import response as dashboard_response
from .durability import DEFAULT_DETACH_TTL_S, DEFAULT_SNAPSHOT_INTERVAL_S, Keeper, LoggedEngine
from .media import MediaConfig, MediaHub
from .metrics import render as render_metrics
from .protocol import Command, ProtocolError, ProtocolLimits, ServerProtocol
from .recovery import flash_record
from .resume import ResumeCommands, ServerHooks
from .store import open_store

log = logging.getLogger(__name__)
# websockets logs every frame at DEBUG; frames carry tokens and user data, so the server's
# websockets logger stops at INFO whatever the root level is (tokens are never logged).
wire_log = logging.getLogger("streamer.wire")
wire_log.setLevel(logging.INFO)


@dataclass(slots=True)
class ServerConfig:
    """Every limit of the edge, with its default (docs/limits.md lists these with the protocol
    and engine limits and the error code of each). Engine limits live in EngineLimits."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0: pick a free port (tests)
    protocol: ProtocolLimits = field(default_factory=ProtocolLimits)
    max_frame_bytes: int = 16 << 20  # beyond this websockets closes the connection (1009)
    # per connection, inbound: token buckets (sustained rate, burst); beyond: rate_limited / byte_rate_limited
    messages_per_s: float = 200.0
    messages_burst: int = 400
    bytes_per_s: float = float(8 << 20)
    bytes_burst: int = 32 << 20  # never below max_frame_bytes, so one allowed frame always fits
    max_inflight: int = 256  # commands waiting for the engine; reading pauses above this, resumes at half
    # per connection, outbound: queued event bytes. Above high, reading the client pauses until the
    # queue is below low; above high for slow_consumer_s, or above max at any time, the client is
    # dropped with a slow_consumer error (close 1008) instead of growing memory.
    outbox_high_bytes: int = 4 << 20
    outbox_low_bytes: int = 1 << 20
    outbox_max_bytes: int = 32 << 20
    slow_consumer_s: float = 10.0
    send_buffer_bytes: int | None = None  # kernel send buffer per socket (None: the OS default)
    idle_timeout_s: float = 300.0  # a connection with no session and no subscription that sends nothing
    ping_interval: float | None = 20.0  # keepalive: a peer that misses a pong for ping_timeout is closed
    ping_timeout: float | None = 20.0
    open_timeout_s: float = 10.0  # the websocket handshake
    shutdown_grace_s: float = 10.0  # graceful shutdown: time for in-flight work before closing (1001)
    mqtt_url: str | None = None  # e.g. mqtt://127.0.0.1:1883: publish session events there
    mqtt_prefix: str = "streamer"
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none: anyone may create sessions
    sessions_per_key: int = 32  # live sessions one API key may hold (with keys configured)
    # durability and workers (streamer.durability, streamer.store)
    store_url: str | None = None  # None: in-process; file:///dir: append-only logs; redis://host:port/db
    detach_ttl_s: float = DEFAULT_DETACH_TTL_S  # a session whose producer left closes after this; 0: at once
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S  # at most one snapshot per session per interval
    worker_id: str | None = None  # default: a random id per process
    public_url: str | None = None  # how clients reach this worker (sent in `moved`); default ws://host:port
    media: MediaConfig | None = field(default_factory=MediaConfig)  # None: binary frames are refused


class InvalidText:
    """What `recv` returns for a text frame that is not UTF-8 (the frame is consumed)."""

    def __init__(self, exc: UnicodeDecodeError) -> None:
        self.exc = exc


class LenientConnection(ServerConnection):
    """RFC 6455 says a text frame with invalid UTF-8 fails the connection (1007). A session
    holds accepted data and live state that a client bug should not cost, so we answer with an
    `invalid_utf8` error event instead and keep the connection; everything else is unchanged."""

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

    __slots__ = ("rate", "burst", "level", "stamp")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst, self.level, self.stamp = rate, burst, float(burst), time.monotonic()

    def take(self, amount: float = 1.0) -> bool:
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level < amount:
            return False
        self.level -= amount
        return True


class Connection(ResumeCommands):
    """One client connection: owns the sessions it created; closes them when it goes.

    Backpressure: reading from the client pauses while its commands wait on the engine beyond
    `max_inflight` or its undelivered events pass `outbox_high_bytes`, so a fast producer is
    slowed by TCP instead of queueing without bound; a client that stays congested is dropped.
    """

    def __init__(self, server: "StreamerServer", ws: ServerConnection) -> None:
        self.server = server
        self.engine = server.engine
        self.ws = ws
        self.proto = ServerProtocol(server.config.protocol)
        self.closed = False
        self.key_name = server.api_key_name(ws)  # which API key the handshake presented, if any
        self.sessions: set[str] = set()  # sessions this connection produces into
        self.subscriptions: dict[str, object] = {}  # session id -> engine listener, as a subscriber
        self.listeners: dict[str, object] = {}  # session id -> engine listener, as the producer
        self.queries: dict[tuple[str, str], object] = {}
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.outbox_bytes = 0
        self.congested_since: float | None = None  # outbox above the high watermark since
        self.dropping: tuple[str, str, int] | None = None  # (code, message, close code) once dropped
        self.inflight = 0
        self.reading = asyncio.Event()  # cleared while backpressure pauses reading
        self.reading.set()
        cfg = server.config
        self.messages = TokenBucket(cfg.messages_per_s, cfg.messages_burst)
        self.bytes_in = TokenBucket(cfg.bytes_per_s, max(cfg.bytes_burst, cfg.max_frame_bytes))
        self.last_message = time.monotonic()
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()
        if cfg.send_buffer_bytes:
            sock = ws.transport.get_extra_info("socket") if ws.transport is not None else None
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)
        self.handlers: dict[str, Callable[[Command], None]] = {
            "session.create": self.on_session_create, "session.get": self.on_session_get,
            "session.close": self.on_session_close, "input.text.append": self.on_append,
            "input.text.revise": self.on_revise, "input.end": self.on_input_end,
            "query.create": self.on_query, "query.cancel": self.on_query_cancel,
            "flash.register": self.on_flash_register, "flash.unregister": self.on_flash_unregister,
            "subscribe": self.on_subscribe, "unsubscribe": self.on_unsubscribe,
            "session.update": self.on_session_update,
            "action.rule": self.on_action_rule, "action.rule.remove": self.on_action_rule_remove,
            "action.start": self.on_action_start, "action.stop": self.on_action_stop,
            "robot.state": self.on_robot_state, "media": self.on_media,
            "session.resume": self.on_session_resume, "sessions.list": self.on_sessions_list,
        }
        media = server.config.media
        self.media = (MediaHub(LoggedEngine(self.engine, server.keeper, self.loop), media, self._media_event,
                               self._media_error) if media else None)

    # ---- plumbing -------------------------------------------------------------------------

    def send(self, text: str) -> None:
        if self.dropping is not None:
            return
        cfg = self.server.config
        size = len(text)
        if self.outbox_bytes + size > cfg.outbox_max_bytes:
            self.drop("slow_consumer", f"more than {cfg.outbox_max_bytes} bytes of events undelivered")
            return
        self.outbox_bytes += size
        self.outbox.put_nowait(text)
        if self.outbox_bytes > cfg.outbox_high_bytes and self.congested_since is None:
            self.congested_since = time.monotonic()
            self.update_reading()

    def drop(self, code: str, message: str, close_code: int = 1008) -> None:
        """Stop serving this client: free its queue, tell it why, close."""
        if self.dropping is not None:
            return
        log.warning("dropping a connection: %s (%s)", code, message)
        self.server.edge["slow_consumers_dropped" if code == "slow_consumer" else "idle_closed"] += 1
        self.dropping = (code, message, close_code)
        while not self.outbox.empty():
            self.outbox.get_nowait()
        self.outbox_bytes = 0
        self.outbox.put_nowait(None)

    def update_reading(self) -> None:
        cfg = self.server.config
        if self.congested_since is not None and self.outbox_bytes <= cfg.outbox_low_bytes:
            self.congested_since = None
        if self.congested_since is not None or self.inflight > cfg.max_inflight:
            if self.reading.is_set():
                self.server.edge["backpressure_pauses"] += 1
            self.reading.clear()
        elif self.inflight <= cfg.max_inflight // 2:
            self.reading.set()

    async def writer(self) -> None:
        while (text := await self.outbox.get()) is not None:
            await self.ws.send(text)
            self.outbox_bytes = max(0, self.outbox_bytes - len(text))
            if self.congested_since is not None:
                self.update_reading()
        code, message, close_code = self.dropping
        error = self.proto.error(code, message, recoverable=False)
        try:  # the peer may not be reading: bounded waits, then cut the connection
            await asyncio.wait_for(self.ws.send(error), 1.0)
            await asyncio.wait_for(self.ws.close(close_code, message[:120]), 2.0)
        except (asyncio.TimeoutError, ConnectionClosed):
            pass
        if self.ws.transport is not None and not self.ws.transport.is_closing():
            self.ws.transport.abort()

    async def watchdog(self) -> None:
        """Slow consumers and idle connections, checked a few times a second."""
        cfg = self.server.config
        while self.dropping is None:
            await asyncio.sleep(min(0.25, cfg.slow_consumer_s / 4, cfg.idle_timeout_s / 4))
            now = time.monotonic()
            if self.congested_since is not None and now - self.congested_since > cfg.slow_consumer_s:
                self.drop("slow_consumer", f"events undelivered above {cfg.outbox_high_bytes} bytes for more "
                          f"than {cfg.slow_consumer_s:g} s")
            elif not self.sessions and not self.subscriptions and now - self.last_message > cfg.idle_timeout_s:
                self.drop("idle_timeout", f"no message for {cfg.idle_timeout_s:g} s and no session or "
                          "subscription", close_code=1000)

    def reply(self, cmd: Command, fut: Future, on_result: Callable[[object], str],
              log: Callable[[object], dict] | None = None) -> None:
        """Await an engine future off the receive loop; send its event or its error. With
        `log`, the change is appended to the session's event log (by the keeper, whether or
        not this connection survives) and acknowledged only once it is there."""
        logged = self.server.keeper.log_after(cmd.session_id, fut, log) if log is not None else None

        async def wait() -> None:
            self.inflight += 1
            if self.inflight > self.server.config.max_inflight:
                self.update_reading()
            try:
                # shielded: a connection that goes away must not cancel the engine's future
                # (the engine finishes the work; orphaned sessions are closed, see orphan_check)
                result = await asyncio.shield(asyncio.wrap_future(fut))
                if logged is not None:
                    await asyncio.shield(logged)
                out = on_result(result)
                if inspect.isawaitable(out):  # session.create: logged after its claim
                    out = await asyncio.shield(out)
            except EngineError as exc:
                self.send(self.proto.error(exc.code, exc.message, recoverable=exc.recoverable,
                                           reply_to=cmd.event_id, session_id=cmd.session_id, param=exc.param))
            except Exception as exc:  # a bug, not the client's fault: report it, keep serving
                log.exception("%s failed", cmd.type)
                self.send(self.proto.error("internal_error", f"{cmd.type} failed: {exc}",
                                           reply_to=cmd.event_id, session_id=cmd.session_id))
            else:
                self.send(out)
            finally:
                self.inflight -= 1
                if not self.reading.is_set():
                    self.update_reading()

        task = self.loop.create_task(wait())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def refuse(self, cmd: Command, code: str, message: str) -> None:
        self.send(self.proto.error(code, message, reply_to=cmd.event_id, session_id=cmd.session_id))

    def owned(self, cmd: Command) -> bool:
        if cmd.session_id in self.sessions:
            return True
        if cmd.session_id in self.subscriptions:
            self.refuse(cmd, "forbidden", f"{cmd.type} needs the producer of session {cmd.session_id!r}; "
                        "this connection holds a read-only token for it")
        else:
            self.refuse(cmd, "session_not_found",
                        f"no session {cmd.session_id!r} on this connection (never created, or closed)")
        return False

    def readable(self, cmd: Command) -> bool:
        """The producer or a subscriber of the session may read its state."""
        return cmd.session_id in self.subscriptions or self.owned(cmd)

    # ---- receive loop ---------------------------------------------------------------------

    async def run(self) -> None:
        writer = self.loop.create_task(self.writer())
        watchdog = self.loop.create_task(self.watchdog())
        cfg = self.server.config
        try:
            while True:
                if not self.reading.is_set():  # backpressure; a close still ends the wait
                    resumed = self.loop.create_task(self.reading.wait())
                    closed = self.loop.create_task(self.ws.wait_closed())
                    await asyncio.wait({resumed, closed}, return_when=asyncio.FIRST_COMPLETED)
                    resumed.cancel()
                    closed.cancel()
                frame = await self.ws.recv()
                self.last_message = time.monotonic()
                if self.dropping is not None:
                    continue
                if isinstance(frame, InvalidText):
                    self.send(self.proto.protocol_error(self.proto.invalid_utf8(frame.exc)))
                    continue
                try:
                    if isinstance(frame, str):
                        cmd = self.proto.receive_text(frame)
                    elif self.media is None:
                        cmd = self.proto.refuse_binary(frame)
                    else:
                        cmd = self.proto.receive_binary(frame)
                except ProtocolError as err:
                    self.send(self.proto.protocol_error(err))
                    continue
                if not self.messages.take():
                    self.server.edge["rate_limited"] += 1
                    self.refuse(cmd, "rate_limited", f"more than {cfg.messages_per_s:g} messages/s (burst "
                                f"{cfg.messages_burst}) on this connection; the message was not processed")
                    continue
                if not self.bytes_in.take(len(frame)):
                    self.server.edge["rate_limited"] += 1
                    self.refuse(cmd, "byte_rate_limited", f"more than {cfg.bytes_per_s:g} bytes/s on this "
                                "connection; the message was not processed")
                    continue
                if self.server.shutting_down:
                    self.send(self.proto.error("shutting_down", "the server is shutting down; reconnect later",
                                               recoverable=False, reply_to=cmd.event_id, session_id=cmd.session_id))
                    continue
                try:
                    self.handlers[cmd.type](cmd)
                except Exception as exc:  # a bug must cost one request, not the connection
                    log.exception("handling %s failed", cmd.type)
                    self.send(self.proto.error("internal_error", f"{cmd.type} failed: {exc}",
                                               reply_to=cmd.event_id, session_id=cmd.session_id))
                if cmd.type == "media" and self.media is not None:
                    await self.media.throttle(cmd)
        finally:
            watchdog.cancel()
            if self.dropping is None:
                writer.cancel()
            else:  # let the writer tell the client why, then close
                await asyncio.wait({writer}, timeout=5)
                writer.cancel()

    async def cleanup(self) -> None:
        self.closed = True
        if self.media is not None:
            self.media.close()
        for task in list(self.tasks):
            task.cancel()
        for handle in self.queries.values():
            handle.cancel()
        for sid, listener in self.subscriptions.items():
            self.engine.remove_listener(sid, listener)
        self.subscriptions.clear()
        for sid in self.sessions:
            listener = self.listeners.pop(sid, None)
            if listener is not None:
                self.engine.remove_listener(sid, listener)
            if self.server.config.detach_ttl_s > 0:  # kept for a resume; closed when the TTL runs out
                self.server.keeper.detach(sid, lambda sid=sid: self.server.close_detached(sid))
            else:
                self.server.close_detached(sid)
        self.sessions.clear()

    def listener(self, sid: str):
        """An engine listener that forwards session events to this connection (called on the
        engine thread; the event is built and queued on the loop)."""

        def forward(event: str, payload: dict) -> None:
            if event in PUBLIC_EVENTS:
                self.loop.call_soon_threadsafe(lambda: self.send(self.proto.event(event, session_id=sid, **payload)))

        return forward

    # ---- handlers -------------------------------------------------------------------------

    def on_session_create(self, cmd: Command) -> None:
        server = self.server
        if server.config.api_keys.enabled:
            if self.key_name is None:
                server.edge["auth_refused"] += 1
                self.refuse(cmd, "unauthorized", "session.create needs an API key: send 'Authorization: Bearer "
                            "<key>' (or ?api_key=) when opening the websocket")
                return
            held = server.sessions_by_key.get(self.key_name, 0)
            if held >= server.config.sessions_per_key:
                self.refuse(cmd, "too_many_sessions",
                            f"this API key already holds {held} sessions (limit {server.config.sessions_per_key})")
                return
            server.sessions_by_key[self.key_name] = held + 1  # reserved now, released if creation fails
        flash = [_flash_args(item) for item in cmd["flash"] or ()]
        fut = self.engine.create_session(cmd["system_prompt"], cmd.session_id, flash, cmd["thinking"])
        if cmd["window"]:
            created_fut = fut
            fut = _and_then(fut, lambda st: self.engine.configure_window(st["session_id"], **cmd["window"]))

            def refused(f) -> None:  # a window the session cannot take: no half-made session stays
                if f.exception() is not None and created_fut.exception() is None:
                    self.engine.close_session(created_fut.result()["session_id"])

            fut.add_done_callback(refused)

        key_name = self.key_name if server.config.api_keys.enabled else None

        def orphan_check(f) -> None:  # engine thread: a session created after its client left
            if self.closed and not f.cancelled() and f.exception() is None:
                self.engine.close_session(f.result()["session_id"])
                if key_name is not None:
                    self.loop.call_soon_threadsafe(server.release_key, key_name)

        fut.add_done_callback(orphan_check)
        if key_name is not None:  # give the reservation back if the engine refuses the session
            fut.add_done_callback(lambda f: f.exception() is None or self.loop.call_soon_threadsafe(
                server.release_key, key_name))

        def created(state: dict) -> str:
            sid = state["session_id"]
            self.sessions.add(sid)
            self.listeners[sid] = self.listener(sid)
            self.engine.add_listener(sid, self.listeners[sid])
            tokens = server.tokens.issue(sid)
            if key_name is not None:
                server.session_keys[sid] = key_name
            if server.mqtt is not None:
                server.mqtt.attach(sid)
            server.keeper.track(sid, key_name)
            record = {"kind": "create", "system_prompt": cmd["system_prompt"], "thinking": cmd["thinking"],
                      "window": cmd["window"],
                      "flash": [flash_record(a, q) for a, q in zip(flash, state["flash"])],
                      "tokens": server.tokens.export(sid), "key": key_name}
            return server.keeper.created(sid, record, self.proto.event(
                "session.created", reply_to=cmd.event_id, session_id=sid, model=self.engine.runner.name,
                tokens=tokens, subscribe_token=tokens["subscriber"], session=state), lambda: self._undo_create(sid))

        self.reply(cmd, fut, created)

    def _undo_create(self, sid: str) -> None:
        """The store refused a new session: it goes, as if it had never been created."""
        self.sessions.discard(sid)
        self.listeners.pop(sid, None)
        if self.server.mqtt is not None:
            self.server.mqtt.detach(sid)
        self.engine.close_session(sid)
        self.server.forget(sid)

    def on_session_update(self, cmd: Command) -> None:
        if self.owned(cmd):
            sid = cmd.session_id
            if cmd["thinking"] is None and cmd["window"] is None:
                self.refuse(cmd, "missing_field", "session.update needs 'thinking' or 'window'")
                return
            if cmd["thinking"] is not None:
                fut = self.engine.configure_thinking(sid, cmd["thinking"])
                if cmd["window"]:
                    fut = _and_then(fut, lambda _: self.engine.configure_window(sid, **cmd["window"]))
            else:
                fut = self.engine.configure_window(sid, **cmd["window"])
            self.reply(cmd, fut,
                       lambda st: self.proto.event("session.updated", reply_to=cmd.event_id,
                                                   session_id=cmd.session_id, session=st),
                       log=lambda _: {"kind": "update", "thinking": cmd["thinking"], "window": cmd["window"]})

    def on_session_get(self, cmd: Command) -> None:
        if self.readable(cmd):
            self.reply(cmd, self.engine.session_state(cmd.session_id),
                       lambda st: self.proto.event("state", reply_to=cmd.event_id, session_id=cmd.session_id,
                                                   session=self._with_media(cmd.session_id, st)))

    def on_session_close(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.sessions.discard(cmd.session_id)
            self.listeners.pop(cmd.session_id, None)
            if self.media is not None:
                self.media.close_session(cmd.session_id)
            self.server.forget(cmd.session_id)
            if self.server.mqtt is not None:
                self.server.mqtt.detach(cmd.session_id)
            self.server.keeper.spawn(self.server.keeper.forget(cmd.session_id, "closed"))
            self.reply(cmd, self.engine.close_session(cmd.session_id),
                       lambda st: self.proto.event("session.closed", reply_to=cmd.event_id,
                                                   session_id=cmd.session_id, session=st))

    def _ack(self, cmd: Command, result) -> str:
        self.server.keeper.note_lag(result.session_id, result.lag_s)
        return self.proto.event(
            "input.ack", reply_to=cmd.event_id, session_id=result.session_id, seq=result.seq,
            client_seq=cmd["client_seq"], tokens=result.tokens, total_tokens=result.total_tokens,
            data_version=result.data_version, lag_ms=round(result.lag_s * 1000, 2), kept_tokens=result.kept_tokens,
            replaced_seqs=result.replaced_seqs or None)

    def on_append(self, cmd: Command) -> None:
        if self.owned(cmd) and not self.duplicate(cmd):
            self.reply(cmd, self.engine.append(cmd.session_id, cmd["text"]), lambda r: self._ack(cmd, r),
                       log=lambda r: self._input_record(cmd, r))

    def on_revise(self, cmd: Command) -> None:
        if self.owned(cmd) and not self.duplicate(cmd):
            fut = self.engine.revise(cmd.session_id, cmd["text"], cmd["from_seq"])
            self.reply(cmd, fut, lambda r: self._ack(cmd, r), log=lambda r: self._input_record(cmd, r))

    def on_input_end(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.end_input(cmd.session_id),
                       lambda st: self.proto.event("input.ack", reply_to=cmd.event_id, session_id=cmd.session_id,
                                                   seq=st["last_seq"], ended=True, total_tokens=st["tokens"],
                                                   data_version=st["data_version"]),
                       log=lambda _: {"kind": "end"})

    def on_query(self, cmd: Command) -> None:
        if not self.owned(cmd):
            return
        sid, f = cmd.session_id, cmd.fields
        query_id = f.get("query_id") or f"q{next(self.server.query_ids)}"
        key = (sid, query_id)
        if key in self.queries:
            self.refuse(cmd, "invalid_field", f"query {query_id!r} is still running on session {sid}")
            return
        params = SamplingParams(
            max_tokens=f.get("max_tokens", 128), temperature=f.get("temperature", 0.0),
            top_p=f.get("top_p", 1.0) or 1.0, top_k=f.get("top_k", 0), seed=f.get("seed"),
            stop=f.get("stop", []))
        stream = f.get("stream", True)
        index = iter(range(1 << 62))

        def on_delta(delta: str) -> None:  # engine thread
            text = self.proto.event("query.delta", reply_to=cmd.event_id, session_id=sid, query_id=query_id,
                                    index=next(index), delta=delta)
            self.loop.call_soon_threadsafe(self.send, text)

        handle = self.engine.query(sid, cmd["question"], params, on_delta if stream else None, query_id)
        self.queries[key] = handle

        def done(result) -> str:
            return self.proto.event(
                "query.done", reply_to=cmd.event_id, session_id=sid, query_id=query_id, text=result.text,
                cached=result.cached or None,
                finish_reason=result.finish_reason, tokens=len(result.tokens), data_version=result.data_version,
                context_tokens=result.context_tokens, question_tokens=result.question_tokens,
                timing={"queue_ms": _ms(result.queue_s), "prefill_ms": _ms(result.prefill_s),
                        "first_token_ms": _ms(result.first_token_s), "total_ms": _ms(result.total_s),
                        "decode_tokens_per_s": round(result.decode_tokens_per_s, 2)})

        handle.future.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self.queries.pop, key, None))
        self.reply(cmd, handle.future, done)

    def on_query_cancel(self, cmd: Command) -> None:
        if not self.owned(cmd):
            return
        handle = self.queries.get((cmd.session_id, cmd["query_id"]))
        if handle is None:
            self.refuse(cmd, "query_not_found", f"no running query {cmd['query_id']!r} on session {cmd.session_id}")
            return
        handle.cancel()


    def on_flash_register(self, cmd: Command) -> None:
        if self.owned(cmd):
            args = _flash_args(cmd.fields)
            fut = self.engine.register_flash(cmd.session_id, **args)
            self.reply(cmd, fut, lambda st: self.proto.event("flash.registered", reply_to=cmd.event_id,
                                                             session_id=cmd.session_id, flash=st),
                       log=lambda st: {"kind": "flash.register", **flash_record(args, st)})

    def on_flash_unregister(self, cmd: Command) -> None:
        if self.owned(cmd):
            fut = self.engine.unregister_flash(cmd.session_id, cmd["flash_id"])
            self.reply(cmd, fut, lambda st: self.proto.event("flash.unregistered", reply_to=cmd.event_id,
                                                             session_id=cmd.session_id, flash_id=st["flash_id"]),
                       log=lambda st: {"kind": "flash.unregister", "flash_id": st["flash_id"]})

    def on_subscribe(self, cmd: Command) -> None:
        """Read-only access to a session with any of its tokens (subscriber, dashboard or
        producer); an unknown session and a wrong token get the same answer."""
        sid = cmd.session_id
        if cmd["token"] is None:  # an operator's view (the dashboard): needs a server credential
            if not self.server.operator(self):
                self.refuse(cmd, "unauthorized", "subscribe without a token needs an API key on the websocket "
                            "handshake; or give one of the session's tokens")
                return
            role = "operator" if sid in self.server.tokens else None
        else:
            role = self.server.tokens.role_of(sid, cmd["token"])
        if role is None:
            self.refuse(cmd, "session_not_found", f"no session {sid!r} with that token")
            return
        if sid in self.subscriptions:
            self.refuse(cmd, "invalid_field", f"already subscribed to session {sid}")
            return
        listener = self.subscriptions[sid] = self.listener(sid)
        fut = self.engine.add_listener(sid, listener)
        self.reply(cmd, _then(fut, self.engine.session_state(sid)),
                   lambda st: self.proto.event("subscribed", reply_to=cmd.event_id, session_id=sid, session=st))

    def on_unsubscribe(self, cmd: Command) -> None:
        listener = self.subscriptions.pop(cmd.session_id, None)
        if listener is None:
            self.refuse(cmd, "session_not_found", f"not subscribed to session {cmd.session_id!r}")
            return
        self.reply(cmd, self.engine.remove_listener(cmd.session_id, listener),
                   lambda _: self.proto.event("unsubscribed", reply_to=cmd.event_id, session_id=cmd.session_id))


    def on_action_rule(self, cmd: Command) -> None:
        if self.owned(cmd):
            f = cmd.fields
            fut = self.engine.add_rule(cmd.session_id, f["flash_id"], f["pattern"], f["command"],
                                       f.get("debounce_ms", 0) / 1000, f.get("rule_id"))
            self.reply(cmd, fut, lambda r: self.proto.event("action.rule.added", reply_to=cmd.event_id,
                                                            session_id=cmd.session_id, rule=r))

    def on_action_rule_remove(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.remove_rule(cmd.session_id, cmd["rule_id"]),
                       lambda r: self.proto.event("action.rule.removed", reply_to=cmd.event_id,
                                                  session_id=cmd.session_id, rule_id=r["rule_id"]))

    def on_action_start(self, cmd: Command) -> None:
        if not self.owned(cmd):
            return
        f = dict(cmd.fields)
        options = {k: f[k] for k in ("horizon", "gain", "max_speed") if k in f}
        if "latency_ms" in f:
            if len(f["latency_ms"]) != 2 or not 0 <= f["latency_ms"][0] <= f["latency_ms"][1] <= 60_000:
                self.refuse(cmd, "invalid_field", "latency_ms must be [min, max] with 0 <= min <= max <= 60000")
                return
            options["latency_s"] = (f["latency_ms"][0] / 1000, f["latency_ms"][1] / 1000)
        fut = self.engine.start_actions(cmd.session_id, f.get("policy", "tracker"), f.get("mode", "async_rollforward"),
                                        f.get("dt_ms", 50) / 1000, **options)
        self.reply(cmd, fut, lambda st: self.proto.event("action.started", reply_to=cmd.event_id,
                                                         session_id=cmd.session_id, actions=st))

    def on_action_stop(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.stop_actions(cmd.session_id),
                       lambda r: self.proto.event("action.stopped", reply_to=cmd.event_id,
                                                  session_id=cmd.session_id, **r))

    def on_media(self, cmd: Command) -> None:
        """A binary media frame: decoded on its stream's thread; `input.ack` when it is in."""
        if not self.owned(cmd):
            return
        f = cmd.fields

        def ack(counters: dict) -> None:
            self.send(self.proto.event("input.ack", session_id=cmd.session_id, kind=f["kind"], format=f["format"],
                                       media_seq=f["seq"], bytes=len(f["payload"]), ended=f.get("end") or None,
                                       media=counters))

        self.media.submit(cmd, self.loop, ack)

    def _media_event(self, event: str, sid: str, payload: dict) -> None:
        """Media events come from stream threads: build and queue them on the loop."""
        def send() -> None:
            if event == "error":
                err = payload["error"]
                self.send(self.proto.error(err["code"], err["message"], recoverable=err["recoverable"],
                                           session_id=sid))
            else:
                self.send(self.proto.event(event, session_id=sid, **payload))

        if not self.closed:
            try:
                self.loop.call_soon_threadsafe(send)
            except RuntimeError:  # the loop is gone (server shutting down): nobody to tell
                pass

    def _media_error(self, cmd: Command, exc: EngineError) -> None:
        self.send(self.proto.error(exc.code, exc.message, recoverable=exc.recoverable, session_id=cmd.session_id,
                                   param="payload" if exc.code in ("media_decode_error", "media_too_large") else None,
                                   media_seq=cmd["seq"]))

    def _with_media(self, sid: str, state: dict) -> dict:
        media = self.media.state(sid) if self.media is not None else None
        return {**state, "media": media} if media else state

    def on_robot_state(self, cmd: Command) -> None:
        """Robot state comes from the producer at control rate: no reply unless it is refused."""
        if not self.owned(cmd):
            return
        try:
            self.engine.robot_state(cmd.session_id, cmd["state"], cmd["ts"])
        except EngineError as exc:
            self.refuse(cmd, exc.code, exc.message)


# Session events a connection forwards to its producer and subscribers.
PUBLIC_EVENTS = frozenset({"flash.updated", "reasoning.delta", "reasoning.done", "action.chunk", "action.command"})


def _flash_args(fields: dict) -> dict:
    """Protocol field names -> Engine.register_flash keyword arguments."""
    args = {k: v for k, v in fields.items() if k in ("question", "flash_id", "max_tokens", "priority", "confirm")}
    if fields.get("min_interval_ms") is not None:
        args["min_interval_s"] = fields["min_interval_ms"] / 1000
    return args


def _then(first: Future, second: Future) -> Future:
    """A future for `second` that fails with `first`'s error if `first` fails."""
    out: Future = Future()

    def done(_: Future) -> None:
        source = first if first.exception() is not None else second
        if source.exception() is not None:
            out.set_exception(source.exception())
        else:
            out.set_result(source.result())

    first.add_done_callback(lambda _: second.add_done_callback(done))
    return out


def _and_then(first: Future, make_second: Callable[[object], Future]) -> Future:
    """A future for `make_second(first's result)`, or first's error."""
    out: Future = Future()

    def relay(src: Future) -> None:
        if src.exception() is not None:
            out.set_exception(src.exception())
        else:
            out.set_result(src.result())

    def step(f: Future) -> None:
        if f.exception() is not None:
            out.set_exception(f.exception())
            return
        try:
            make_second(f.result()).add_done_callback(relay)
        except Exception as exc:
            out.set_exception(exc)

    first.add_done_callback(step)
    return out


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


class StreamerServer(ServerHooks):
    """Websocket sessions plus `/healthz` on one port."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.connections: set[Connection] = set()
        self.query_ids = iter(range(1, 1 << 62))
        self.tokens = SessionTokens()  # capability tokens of live sessions (digests only)
        self.sessions_by_key: dict[str, int] = {}  # API key name -> live sessions it created
        self.session_keys: dict[str, str] = {}  # session id -> the API key name that created it
        self.mqtt = None  # MqttBridge when config.mqtt_url is set
        self.shutting_down = False
        self.edge = dict.fromkeys(("backpressure_pauses", "rate_limited", "slow_consumers_dropped", "idle_closed",
                                   "auth_refused"), 0)  # edge counters for /metrics
        self._stopped = False
        self.store = open_store(self.config.store_url, self.config.worker_id)
        self.keeper = Keeper(self, self.store, self.config.detach_ttl_s, self.config.snapshot_interval_s)
        self._server: Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> "StreamerServer":
        cfg = self.config
        if cfg.mqtt_url:
            from .mqtt import MqttBridge

            self.mqtt = await MqttBridge(self.engine, cfg.mqtt_url, cfg.mqtt_prefix,
                                         worker_id=self.store.worker_id).start()
        self._server = await serve(
            self._handle, cfg.host, cfg.port, process_request=self._http, max_size=cfg.max_frame_bytes,
            create_connection=LenientConnection, logger=wire_log, open_timeout=cfg.open_timeout_s,
            ping_interval=cfg.ping_interval, ping_timeout=cfg.ping_timeout)
        await self.keeper.start(cfg.public_url or f"ws://{cfg.host}:{self.port}")
        if self.mqtt is not None:
            self.mqtt.announce(self.store.worker_url)
        log.info("listening on ws://%s:%d (model %s, %s store, worker %s)", cfg.host, self.port,
                 self.engine.runner.name, self.store.kind, self.store.worker_id)
        return self

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()
        await self.keeper.stop()
        if self.mqtt is not None:
            await self.mqtt.stop()

    async def serve_forever(self) -> None:
        await self._server.serve_forever()

    async def shutdown(self, grace_s: float | None = None) -> dict:
        """Graceful stop: accept no new connection or command, give in-flight work up to
        `grace_s` to finish (its replies are delivered), close every connection with 1001
        (going away), then stop: the keeper finishes the log writes still on their way, writes
        final snapshots and closes the store (sessions stay in their logs, resumable).
        Returns what it did, for the log."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.shutting_down = True
        if self._server is not None:
            self._server.close(close_connections=False)  # stop listening; keep the open ones
        deadline = time.monotonic() + grace_s
        pending = sum(c.inflight for c in self.connections)
        while any(c.inflight for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        unfinished = sum(c.inflight for c in self.connections)
        while any(c.outbox_bytes for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # let the writers deliver the last replies
        closing = [asyncio.wait_for(c.ws.close(1001, "server shutting down"), 2.0) for c in list(self.connections)]
        await asyncio.gather(*closing, return_exceptions=True)
        await self.stop()
        return {"connections": len(closing), "in_flight": pending, "unfinished": unfinished}

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(self, ws)
        self.connections.add(conn)
        try:
            await conn.run()
        except ConnectionClosed:
            pass
        except Exception:
            log.exception("connection handler failed")
            await ws.close(1011, "internal error")
        finally:
            self.connections.discard(conn)
            await conn.cleanup()

    def api_key_name(self, ws: ServerConnection) -> str | None:
        request = ws.request
        if request is None or not self.config.api_keys.enabled:
            return None
        return self.config.api_keys.check(key_from_request(request.headers, request.path))

    def release_key(self, key_name: str) -> None:
        held = self.sessions_by_key.get(key_name, 0) - 1
        if held > 0:
            self.sessions_by_key[key_name] = held
        else:
            self.sessions_by_key.pop(key_name, None)

    def forget(self, session_id: str) -> None:
        """A session closed: its tokens stop working and its key's count drops."""
        self.tokens.revoke(session_id)
        key_name = self.session_keys.pop(session_id, None)
        if key_name is not None:
            self.release_key(key_name)

    def health(self) -> dict:
        stats = self.engine.snapshot_stats()
        return {"status": "ok", "model": self.engine.runner.name, "sessions": stats["sessions"],
                "connections": len(self.connections), "context_window": self.engine.context_window}

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return _json_response(HTTPStatus.OK, self.health())
        if path == "/metrics":
            body = render_metrics(self.engine.metrics(), len(self.connections), self.edge,
                                  self.keeper.metrics()).encode()
            headers = Headers([("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", str(len(body))),
                               ("Connection", "close")])
            return Response(HTTPStatus.OK.value, "OK", headers, body)
        if path == "/dashboard" or path.startswith("/dashboard/"):
            return dashboard_response(path)
        if request.headers.get("Upgrade", "").lower() == "websocket":
            key = key_from_request(request.headers, request.path)
            if key is not None and self.config.api_keys.enabled and self.config.api_keys.check(key) is None:
                self.edge["auth_refused"] += 1
                return _json_response(HTTPStatus.UNAUTHORIZED, {"error": "unknown API key"})
            return None
        return _json_response(HTTPStatus.NOT_FOUND, {"error": f"no route {path}; try /healthz, /metrics, /dashboard or a websocket"})


def _json_response(status: HTTPStatus, body: dict) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, data)


async def run_server(engine: Engine, config: ServerConfig,
                     on_ready: Callable[[StreamerServer], Awaitable[None] | None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (see StreamerServer.shutdown)."""
    server = await StreamerServer(engine, config).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
            pass
    try:
        if on_ready is not None:
            result = on_ready(server)
            if asyncio.iscoroutine(result):
                await result
        await stop.wait()
        log.info("shutting down: %d connections, up to %g s for in-flight work",
                 len(server.connections), config.shutdown_grace_s)
        done = await server.shutdown()
        log.info("shut down: %(connections)d connections closed, %(in_flight)d requests in flight, "
                 "%(unfinished)d unfinished", done)
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
        await server.stop()
