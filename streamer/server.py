"""The asyncio websocket service: one port for websocket sessions and plain HTTP (`/healthz`).

Each connection is a receive loop and a writer task. The receive loop parses frames with the
sans-I/O protocol and hands commands to the engine in arrival order (the engine calls only
enqueue, so a busy model never blocks this loop); replies are awaited in small tasks and all
outbound events go through one bounded queue, so their order is the order they were made.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
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

from .media import MediaConfig, MediaHub
from .metrics import render as render_metrics
from .protocol import Command, ProtocolError, ProtocolLimits, ServerProtocol

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ServerConfig:
    """Every limit of the edge, with its default. Engine limits live in EngineLimits."""

    host: str = "127.0.0.1"
    port: int = 8765  # 0: pick a free port (tests)
    protocol: ProtocolLimits = field(default_factory=ProtocolLimits)
    max_frame_bytes: int = 16 << 20  # beyond this websockets closes the connection (1009)
    max_outbox: int = 10_000  # queued outbound events before a slow reader is dropped
    ping_interval: float | None = 20.0
    ping_timeout: float | None = 20.0
    mqtt_url: str | None = None  # e.g. mqtt://127.0.0.1:1883: publish session events there
    mqtt_prefix: str = "streamer"
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


class Connection:
    """One client connection: owns the sessions it created; closes them when it goes."""

    def __init__(self, server: "StreamerServer", ws: ServerConnection) -> None:
        self.server = server
        self.engine = server.engine
        self.ws = ws
        self.proto = ServerProtocol(server.config.protocol)
        self.closed = False
        self.sessions: set[str] = set()  # sessions this connection produces into
        self.subscriptions: dict[str, object] = {}  # session id -> engine listener, as a subscriber
        self.listeners: dict[str, object] = {}  # session id -> engine listener, as the producer
        self.queries: dict[tuple[str, str], object] = {}
        self.outbox: asyncio.Queue[str | None] = asyncio.Queue()
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()
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
        }
        media = server.config.media
        self.media = MediaHub(self.engine, media, self._media_event, self._media_error) if media else None

    # ---- plumbing -------------------------------------------------------------------------

    def send(self, text: str | None) -> None:
        if self.outbox.qsize() >= self.server.config.max_outbox:
            log.warning("dropping a connection whose outbox passed %d events", self.server.config.max_outbox)
            self.outbox.put_nowait(None)
            return
        self.outbox.put_nowait(text)

    async def writer(self) -> None:
        while (text := await self.outbox.get()) is not None:
            await self.ws.send(text)
        await self.ws.close(1008, "slow consumer: too many undelivered events")

    def reply(self, cmd: Command, fut: Future, on_result: Callable[[object], str]) -> None:
        """Await an engine future off the receive loop; send its event or its error."""

        async def wait() -> None:
            try:
                # shielded: a connection that goes away must not cancel the engine's future
                # (the engine finishes the work; orphaned sessions are closed, see orphan_check)
                result = await asyncio.shield(asyncio.wrap_future(fut))
            except EngineError as exc:
                self.send(self.proto.error(exc.code, exc.message, recoverable=exc.recoverable,
                                           reply_to=cmd.event_id, session_id=cmd.session_id))
            except Exception as exc:  # a bug, not the client's fault: report it, keep serving
                log.exception("%s failed", cmd.type)
                self.send(self.proto.error("internal_error", f"{cmd.type} failed: {exc}",
                                           reply_to=cmd.event_id, session_id=cmd.session_id))
            else:
                self.send(on_result(result))

        task = self.loop.create_task(wait())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    def refuse(self, cmd: Command, code: str, message: str) -> None:
        self.send(self.proto.error(code, message, reply_to=cmd.event_id, session_id=cmd.session_id))

    def owned(self, cmd: Command) -> bool:
        if cmd.session_id in self.sessions:
            return True
        self.refuse(cmd, "session_not_found",
                    f"no session {cmd.session_id!r} on this connection (never created, or closed)")
        return False

    # ---- receive loop ---------------------------------------------------------------------

    async def run(self) -> None:
        writer = self.loop.create_task(self.writer())
        try:
            while True:
                frame = await self.ws.recv()
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
                try:
                    self.handlers[cmd.type](cmd)
                except Exception as exc:  # a bug must cost one request, not the connection
                    log.exception("handling %s failed", cmd.type)
                    self.send(self.proto.error("internal_error", f"{cmd.type} failed: {exc}",
                                               reply_to=cmd.event_id, session_id=cmd.session_id))
                if cmd.type == "media" and self.media is not None:
                    await self.media.throttle(cmd)
        finally:
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
            if self.server.mqtt is not None:
                self.server.mqtt.detach(sid)
            self.engine.close_session(sid)
            self.server.subscribe_tokens.pop(sid, None)
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
        flash = [_flash_args(item) for item in cmd["flash"] or ()]
        fut = self.engine.create_session(cmd["system_prompt"], cmd["session_id"], flash, cmd["thinking"])
        if cmd["window"]:
            created_fut = fut
            fut = _and_then(fut, lambda st: self.engine.configure_window(st["session_id"], **cmd["window"]))

            def refused(f) -> None:  # a window the session cannot take: no half-made session stays
                if f.exception() is not None and created_fut.exception() is None:
                    self.engine.close_session(created_fut.result()["session_id"])

            fut.add_done_callback(refused)

        def orphan_check(f) -> None:  # engine thread: a session created after its client left
            if self.closed and not f.cancelled() and f.exception() is None:
                self.engine.close_session(f.result()["session_id"])

        fut.add_done_callback(orphan_check)

        def created(state: dict) -> str:
            sid = state["session_id"]
            self.sessions.add(sid)
            self.listeners[sid] = self.listener(sid)
            self.engine.add_listener(sid, self.listeners[sid])
            token = self.server.subscribe_tokens[sid] = secrets.token_urlsafe(24)
            if self.server.mqtt is not None:
                self.server.mqtt.attach(sid)
            return self.proto.event("session.created", reply_to=cmd.event_id, session_id=sid,
                                    model=self.engine.runner.name, subscribe_token=token, session=state)

        self.reply(cmd, fut, created)

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
                                                   session_id=cmd.session_id, session=st))

    def on_session_get(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.session_state(cmd.session_id),
                       lambda st: self.proto.event("state", reply_to=cmd.event_id, session_id=cmd.session_id,
                                                   session=self._with_media(cmd.session_id, st)))

    def on_session_close(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.sessions.discard(cmd.session_id)
            self.listeners.pop(cmd.session_id, None)
            if self.media is not None:
                self.media.close_session(cmd.session_id)
            self.server.subscribe_tokens.pop(cmd.session_id, None)
            if self.server.mqtt is not None:
                self.server.mqtt.detach(cmd.session_id)
            self.reply(cmd, self.engine.close_session(cmd.session_id),
                       lambda st: self.proto.event("session.closed", reply_to=cmd.event_id,
                                                   session_id=cmd.session_id, session=st))

    def _ack(self, cmd: Command, result) -> str:
        return self.proto.event(
            "input.ack", reply_to=cmd.event_id, session_id=result.session_id, seq=result.seq,
            tokens=result.tokens, total_tokens=result.total_tokens, data_version=result.data_version,
            lag_ms=round(result.lag_s * 1000, 2), kept_tokens=result.kept_tokens,
            replaced_seqs=result.replaced_seqs or None)

    def on_append(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.append(cmd.session_id, cmd["text"]), lambda r: self._ack(cmd, r))

    def on_revise(self, cmd: Command) -> None:
        if self.owned(cmd):
            fut = self.engine.revise(cmd.session_id, cmd["text"], cmd["from_seq"])
            self.reply(cmd, fut, lambda r: self._ack(cmd, r))

    def on_input_end(self, cmd: Command) -> None:
        if self.owned(cmd):
            self.reply(cmd, self.engine.end_input(cmd.session_id),
                       lambda st: self.proto.event("input.ack", reply_to=cmd.event_id, session_id=cmd.session_id,
                                                   seq=st["last_seq"], ended=True, total_tokens=st["tokens"],
                                                   data_version=st["data_version"]))

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
            text = self.proto.event("query.delta", session_id=sid, query_id=query_id, index=next(index), delta=delta)
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
            fut = self.engine.register_flash(cmd.session_id, **_flash_args(cmd.fields))
            self.reply(cmd, fut, lambda st: self.proto.event("flash.registered", reply_to=cmd.event_id,
                                                             session_id=cmd.session_id, flash=st))

    def on_flash_unregister(self, cmd: Command) -> None:
        if self.owned(cmd):
            fut = self.engine.unregister_flash(cmd.session_id, cmd["flash_id"])
            self.reply(cmd, fut, lambda st: self.proto.event("flash.unregistered", reply_to=cmd.event_id,
                                                             session_id=cmd.session_id, flash_id=st["flash_id"]))

    def on_subscribe(self, cmd: Command) -> None:
        """Read-only access to another connection's session with its subscribe token."""
        sid = cmd.session_id
        expected = self.server.subscribe_tokens.get(sid)
        if expected is None or not hmac.compare_digest(expected.encode(), cmd["token"].encode()):
            self.refuse(cmd, "session_not_found", f"no session {sid!r} with that subscribe token")
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


class StreamerServer:
    """Websocket sessions plus `/healthz` on one port."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        self.connections: set[Connection] = set()
        self.query_ids = iter(range(1, 1 << 62))
        self.subscribe_tokens: dict[str, str] = {}  # session id -> token for read-only subscribers
        self.mqtt = None  # MqttBridge when config.mqtt_url is set
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

            self.mqtt = await MqttBridge(self.engine, cfg.mqtt_url, cfg.mqtt_prefix).start()
        self._server = await serve(
            self._handle, cfg.host, cfg.port, process_request=self._http, max_size=cfg.max_frame_bytes,
            create_connection=LenientConnection,
            ping_interval=cfg.ping_interval, ping_timeout=cfg.ping_timeout)
        log.info("listening on ws://%s:%d (model %s)", cfg.host, self.port, self.engine.runner.name)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()
        if self.mqtt is not None:
            await self.mqtt.stop()

    async def serve_forever(self) -> None:
        await self._server.serve_forever()

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

    def health(self) -> dict:
        stats = self.engine.snapshot_stats()
        return {"status": "ok", "model": self.engine.runner.name, "sessions": stats["sessions"],
                "connections": len(self.connections), "context_window": self.engine.context_window}

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            return _json_response(HTTPStatus.OK, self.health())
        if path == "/metrics":
            body = render_metrics(self.engine.metrics(), len(self.connections)).encode()
            headers = Headers([("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", str(len(body))),
                               ("Connection", "close")])
            return Response(HTTPStatus.OK.value, "OK", headers, body)
        if request.headers.get("Upgrade", "").lower() == "websocket":
            return None
        return _json_response(HTTPStatus.NOT_FOUND, {"error": f"no route {path}; try /healthz, /metrics or a websocket"})


def _json_response(status: HTTPStatus, body: dict) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, data)


async def run_server(engine: Engine, config: ServerConfig,
                     on_ready: Callable[[StreamerServer], Awaitable[None] | None] | None = None) -> None:
    server = await StreamerServer(engine, config).start()
    try:
        if on_ready is not None:
            result = on_ready(server)
            if asyncio.iscoroutine(result):
                await result
        await server.serve_forever()
    finally:
        await server.stop()
