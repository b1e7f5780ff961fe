"""The asyncio websocket service: one port for websocket sessions and plain HTTP (`/healthz`,
`/metrics`, the dashboard).

The parts, each in its own module: a `Connection` per socket (streamer.connection: the receive
loop and its `Outbox`), the command table (streamer.handlers), and the server-wide state every
connection shares: the `Directory` of live sessions (tokens, API key quotas, client_seq marks),
the `EventLog` (changes logged before they are acknowledged), `Snapshots` for dashboards, and
the `Resumer` (detach, resume, recover, close). `StreamerServer` wires them together, serves
HTTP and shuts down gracefully.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from streamer.sessions.engine import Engine

from .auth import ALL_SESSIONS, NO_SESSIONS, ApiKeys, key_from_request
from .connection import CLOSE_WAIT_S, Connection, ConnectionGate, LenientConnection, MessageBudget, going_away
from .directory import Directory
from .drain import drain, drains
from .eventlog import (DEFAULT_CHECKPOINT_MIN_RECORDS, DEFAULT_CHECKPOINT_RECORDS, DEFAULT_RELOG_MAX_BYTES,
                       EventLog)
from .handlers import Peer, Services
from .media import MediaConfig, MediaHub
from .heap import HeapKeeper
from .metrics import EDGE_COUNTERS
from .metrics import render as render_metrics
from .loopbridge import bridge
from .mqtt import MqttBridge
from .protocol import ProtocolLimits
from .realtime import RealtimeConnection, is_realtime
from .quotas import ClusterQuota
from .resume import DEFAULT_DETACH_TTL_S, Resumer
from .snapshots import DEFAULT_SNAPSHOT_INTERVAL_S, Snapshots
from .store import open_store
from .store_base import heartbeat_loop
from .web import route as web_route

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
    # per connection, inbound: token buckets (sustained rate, burst); beyond: rate_limited. Bytes are
    # counted as they are read: over the byte rate, reading pauses until the deficit is paid; a
    # connection held back more than byte_throttle_s in a minute is closed (byte_rate_limited, 1008)
    messages_per_s: float = 200.0
    messages_burst: int = 400
    bytes_per_s: float = float(8 << 20)
    bytes_burst: int = 32 << 20  # never below max_frame_bytes, so one allowed frame always fits
    byte_throttle_s: float = 10.0
    # the server's message budget, shared fairly by the connections sending (MessageBudget):
    # beyond its share of a busy server a connection is slowed to that share (not read meanwhile)
    server_messages_per_s: float = 1000.0
    server_messages_burst: int = 2000
    # connections: per client address, per API key and in all (the last also kept below the
    # open-file limit, whose soft value is raised to the hard one at start); refused at the
    # handshake with HTTP 429 / 429 / 503 and a JSON body naming the code
    max_connections_per_address: int = 256
    max_connections_per_key: int = 1024
    max_connections: int = 10_000
    # per connection: frames refused (rates) or invalid (protocol errors) get an error while this
    # bucket lasts; past it the connection is closed with rate_limited (1008)
    refused_per_s: float = 20.0
    refused_burst: int = 100
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
    # the server's handshake rate: handshakes beyond it wait their turn (up to handshake_wait_s,
    # below open_timeout_s), then get HTTP 503 server_busy; 0: no rate
    handshakes_per_s: float = 200.0
    handshakes_burst: int = 400
    handshake_wait_s: float = 5.0
    shutdown_grace_s: float = 10.0  # graceful shutdown: time for in-flight work before closing (1001)
    # `streamer serve`'s garbage collector (streamer.heap): the first sweep of the frozen heap
    # after this; the interval then adapts between a minute and an hour to what sweeps reclaim.
    # 0: no tenure and no sweeps (only the started heap is frozen; CPython's own full collections)
    gc_sweep_s: float = 600.0
    mqtt_url: str | None = None  # e.g. mqtt://127.0.0.1:1883: publish session events there
    mqtt_prefix: str = "streamer"
    api_keys: ApiKeys = field(default_factory=ApiKeys)  # none: anyone may create sessions
    sessions_per_key: int = 32  # live sessions one API key may hold (with keys configured)
    # durability and workers (streamer.eventlog, streamer.resume, streamer.store)
    store_url: str | None = None  # None: in-process; file:///dir: append-only logs; redis://host:port/db
    detach_ttl_s: float = DEFAULT_DETACH_TTL_S  # a session whose producer left closes after this; 0: at once
    # detached sessions hold engine slots and memory: at most this many per client (API key name,
    # or remote address without keys) and on the server; beyond, the oldest detached one closes
    max_detached_per_client: int = 8
    max_detached: int = 128
    relog_max_bytes: int = DEFAULT_RELOG_MAX_BYTES  # per session: the log copy kept to re-write a lost store
    # checkpoints (streamer.eventlog.Checkpointer): at least every N records, and after a window
    # slide once checkpoint_min_records passed; the log before one is compacted. 0: none
    checkpoint_records: int = DEFAULT_CHECKPOINT_RECORDS
    checkpoint_min_records: int = DEFAULT_CHECKPOINT_MIN_RECORDS
    snapshot_interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S  # at most one snapshot per session per interval
    worker_id: str | None = None  # default: a random id per process
    public_url: str | None = None  # how clients reach this worker (sent in `moved`); default ws://host:port
    # behind a proxy (docs/cluster.md): the proxy's address as workers reach it; adoption requests for a
    # dead worker's sessions go through it, so the worker its hash picks adopts them (streamer.adoption)
    proxy_url: str | None = None
    adopt_interval_s: float = 1.0  # how often a worker on a Redis store looks for dead workers' sessions
    worker_ttl_s: float | None = None  # a worker silent this long is dead (None: WORKER_TTL_S, 6 s); beats at a third
    media: MediaConfig | None = field(default_factory=MediaConfig)  # None: binary frames are refused


class StreamerServer:
    """Websocket sessions plus `/healthz`, `/metrics` and the dashboard on one port."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = cfg = config or ServerConfig()
        self.connections: set[Connection] = set()
        self.shutting_down = False
        self.draining: str | None = None  # why, while streamer.drain hands the sessions over
        self.edge = dict.fromkeys(EDGE_COUNTERS, 0)  # edge counters for /metrics
        self.budget = MessageBudget(cfg.server_messages_per_s, cfg.server_messages_burst)
        self.gate: ConnectionGate | None = None  # made at start, when the descriptor limit is known
        self._stopped = False
        self.store = open_store(cfg.store_url, cfg.worker_id)
        if cfg.worker_ttl_s is not None:  # failover time is mostly this (docs/cluster.md)
            self.store.worker_ttl_s, self.store.heartbeat_s = cfg.worker_ttl_s, cfg.worker_ttl_s / 3
        self.directory = Directory(cfg.api_keys.enabled, cfg.sessions_per_key)
        self.events = EventLog(self.store, self.directory, cfg.relog_max_bytes, engine, cfg.checkpoint_records,
                               cfg.checkpoint_min_records)
        self.snapshots = Snapshots(engine, self.store, self.directory, self.push_snapshot, cfg.snapshot_interval_s)
        self.resumer = Resumer(engine, self.store, self.directory, self.events, self.snapshots, cfg.detach_ttl_s,
                               on_close=self._closed, max_detached=cfg.max_detached,
                               max_detached_per_client=cfg.max_detached_per_client)
        self.handoffs = self.resumer.handoffs
        self.services = Services(engine, cfg, self.directory, self.events, self.resumer, self.snapshots, self.store,
                                 self.take_over, edge=self.edge)
        self.quotas = self.services.quotas = ClusterQuota(self.store, cfg.sessions_per_key,
                                                          connections_per_key=cfg.max_connections_per_key)
        self.mqtt = None  # MqttBridge when config.mqtt_url is set
        self.adopter = None  # streamer.adoption.Adopter (Redis store, behind a proxy): takes over dead workers' sessions
        self._server: Server | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("server not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> "StreamerServer":
        cfg = self.config
        if cfg.mqtt_url:
            self.mqtt = self.services.mqtt = await MqttBridge(self.engine, cfg.mqtt_url, cfg.mqtt_prefix,
                                                              worker_id=self.store.worker_id,
                                                              closed_retention_s=self.store.retention_s).start()
        self.gate = connection_gate(cfg, self.edge)
        self.gate.forget_member = self.quotas.forget_connection
        self._server = await serve(
            self._handle, cfg.host, cfg.port, process_request=self._http, max_size=cfg.max_frame_bytes,
            create_connection=functools.partial(LenientConnection, gate=self.gate), logger=wire_log,
            open_timeout=cfg.open_timeout_s,
            ping_interval=cfg.ping_interval, ping_timeout=cfg.ping_timeout)
        self.store.worker_url = cfg.public_url or f"ws://{cfg.host}:{self.port}"
        await self.store.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(heartbeat_loop(self.store, on_forgotten=self.events.store_restarted)),
                       loop.create_task(self.snapshots.run()), loop.create_task(self.quotas.run(self.directory, self.gate))]
        if self.mqtt is not None:
            self.mqtt.announce(self.store.worker_url)
        if self.store.kind == "redis" and cfg.proxy_url:
            self._start_adopter()
        log.info("listening on ws://%s:%d (model %s, %s store, worker %s)", cfg.host, self.port,
                 self.engine.runner.name, self.store.kind, self.store.worker_id)
        return self

    def _start_adopter(self) -> None:
        from .adoption import Adopter

        async def adopt(sid: str):
            if self.directory.get(sid) is not None:
                return None
            return await self.resumer.recover(sid, None, adopt=True)

        def adopted(sid: str) -> None:
            if self.mqtt is not None:
                self.mqtt.attach(sid)

        self.resumer.on_adopt = adopted
        self.adopter = Adopter(self.store, adopt, self.config.proxy_url, self.config.adopt_interval_s)
        self._tasks.append(asyncio.get_running_loop().create_task(self.adopter.run()))

    async def stop(self) -> None:
        """Stop serving: the log writes still on their way finish, final snapshots are written,
        the engine's copies of the sessions go (their logs stay, resumable) and the store closes."""
        if self._stopped:
            return
        self._stopped = True
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()
        for task in self._tasks:
            task.cancel()
        if self.adopter is not None:
            self.adopter.stop()
        await self.events.drain()
        for tracked in self.directory.sessions.values():
            if tracked.expiry is not None:
                tracked.expiry.cancel()
        try:
            await self.snapshots.write_all()
        except Exception:
            log.warning("final snapshots failed", exc_info=True)
        await self.resumer.stop()
        try:
            await self.store.close()
        except Exception as exc:
            log.warning("closing the store: %s", exc)
        if self.mqtt is not None:
            await self.mqtt.stop()

    async def serve_forever(self) -> None:
        await self._server.serve_forever()

    async def shutdown(self, grace_s: float | None = None) -> dict:
        """Graceful stop: accept no new connection or command, give in-flight work up to
        `grace_s` to finish (its replies are delivered), close every connection with 1001
        (going away), then `stop`. Returns what it did, for the log."""
        grace_s = self.config.shutdown_grace_s if grace_s is None else grace_s
        self.shutting_down = True
        if self._server is not None:
            self._server.close(close_connections=False)  # stop listening; keep the open ones
        deadline = time.monotonic() + grace_s
        pending = sum(c.inflight for c in self.connections)
        # Connections with nothing in flight and nothing left to send close at once, not at the
        # end of the grace period (nothing of theirs can finish: new commands are refused).
        idle = [c for c in self.connections if not c.inflight and not c.outbox.bytes]
        await going_away(idle, min(CLOSE_WAIT_S, grace_s))
        while any(c.inflight for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        answers = await self._end_answers()
        unfinished = sum(c.shutdown_replies() for c in self.connections)  # a final event for each
        flushed = max(deadline, time.monotonic() + 1.0)
        while any(c.outbox.bytes for c in self.connections) and time.monotonic() < flushed:
            await asyncio.sleep(0.02)  # let the writers deliver the last replies
        rest = [c for c in self.connections if c not in idle]
        await going_away(rest, CLOSE_WAIT_S)
        await self.stop()
        return {"connections": len(idle) + len(rest), "in_flight": pending, "answers_ended": answers,
                "unfinished": unfinished}

    async def _end_answers(self) -> int:
        """The grace period is over: every answer still running or queued ends now with
        `finish_reason: "shutdown"` and the text it has; wait (briefly) for those `query.done`
        events to be queued to their clients. Returns how many answers were ended."""
        def asking() -> bool:
            return any(cmd.type == "query.create" for c in self.connections for cmd in c.unfinished.values())

        if not asking():
            return 0
        try:
            ended = await asyncio.wait_for(asyncio.wrap_future(self.engine.end_queries("shutdown")), 5.0)
        except Exception as exc:  # a stopped or stuck engine: the answers get `shutting_down` instead
            log.warning("ending the running answers at shutdown: %r", exc)
            return 0
        settled = time.monotonic() + 2.0
        while asking() and time.monotonic() < settled:
            await asyncio.sleep(0.02)
        return ended

    async def _handle(self, ws: ServerConnection) -> None:
        # /v1/realtime speaks the OpenAI Realtime events (streamer.realtime); any other path ours
        kind = RealtimeConnection if is_realtime(ws.request.path if ws.request else None) else Connection
        conn = kind(ws, self.services, self.api_key_name(ws), self._media_for, lambda: self.shutting_down,
                    self.budget)
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
            await conn.cleanup(self.resumer.detach)

    def _media_for(self, peer: Peer) -> MediaHub | None:
        media = self.config.media
        return MediaHub.for_peer(self.engine, self.events, media, peer, self.directory.note_lag) if media else None

    def api_key_name(self, ws: ServerConnection) -> str | None:
        request = ws.request
        if request is None or not self.config.api_keys.enabled:
            return None
        return self.config.api_keys.check(key_from_request(request.headers, request.path))

    def take_over(self, session_id: str, new: Peer) -> None:
        """A producer resumed on a new connection: the old one stops producing into it."""
        for conn in self.connections:
            if conn.peer is not new and session_id in conn.peer.sessions:
                conn.peer.stop_producing(self.engine, session_id)

    def push_snapshot(self, session_id: str, snapshot: dict) -> None:
        """Send a session's new snapshot to the connections watching it (and its counters to the
        retained MQTT state)."""
        if self.mqtt is not None:
            self.mqtt.snapshot(session_id, snapshot)
        for conn in list(self.connections):
            if session_id in conn.peer.subscriptions:
                conn.send(conn.proto.event("session.snapshot", session_id=session_id, snapshot=snapshot))

    def _closed(self, session_id: str, reason: str) -> None:
        """A session closed here: its subscribers get `session.closed` with the reason (`closed`,
        `detached`, `expired`, `evicted`) and stop watching it; MQTT stops publishing it."""
        self.quotas.forget(self.directory.key_of(session_id), session_id)
        if self.mqtt is not None:
            self.mqtt.detach(session_id)
        for conn in list(self.connections):
            if conn.peer.subscriptions.pop(session_id, None) is not None:
                conn.send(conn.proto.event("session.closed", session_id=session_id, reason=reason))

    def health(self) -> dict:
        stats = self.engine.snapshot_stats()
        status = {"status": "draining", "reason": self.draining} if self.draining else {"status": "ok"}
        return {**status, "model": self.engine.runner.name, "weights": self.engine.runner.weights.public(),
                "sessions": stats["sessions"],
                "connections": len(self.connections), "context_window": self.engine.context_window}

    def durability_metrics(self) -> dict:
        return {**self.events.counters, **self.resumer.counters, "duplicates": self.directory.duplicates,
                "snapshots": self.snapshots.written, "detached": self.directory.detached(), "store": self.store.kind,
                **self.handoffs}

    def _shows(self, viewer) -> Callable[[str], bool]:
        """Which sessions get series of their own on /metrics: all for an operator key (or a
        server without keys), a tenant key's own sessions, none without a key (aggregates only),
        so a tenant learns nothing of the others' sessions there either."""
        if viewer is ALL_SESSIONS:
            return lambda _sid: True
        if viewer is NO_SESSIONS:
            return lambda _sid: False
        return lambda sid: self.directory.key_of(sid) == viewer

    def _http(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == "/healthz":
            # draining: 503, so that a proxy's health check stops sending new connections here
            return _json_response(HTTPStatus.SERVICE_UNAVAILABLE if self.draining else HTTPStatus.OK, self.health())
        if path == "/metrics":
            viewer = self.config.api_keys.viewer(key_from_request(request.headers, request.path))
            if viewer is None:
                self.edge["auth_refused"] += 1
                return _json_response(HTTPStatus.UNAUTHORIZED, {"error": "unknown API key"})
            handed = bridge(asyncio.get_running_loop())
            edge = {**self.edge, "loop_handovers": handed.posted, "loop_wakeups": handed.wakeups}
            body = render_metrics(self.engine.metrics(), len(self.connections), edge,
                                  self.durability_metrics(), self._shows(viewer)).encode()
            headers = Headers([("Content-Type", "text/plain; version=0.0.4"), ("Content-Length", str(len(body))),
                               ("Connection", "close")])
            return Response(HTTPStatus.OK.value, "OK", headers, body)
        if path == "/cluster/adopt" and self.adopter is not None:  # streamer.adoption
            return self.adopter.handle(request)
        if (page := web_route(self, request)) is not None:  # /app, /sdk/, /dashboard (streamer.web)
            return page
        if request.headers.get("Upgrade", "").lower() == "websocket":
            key = key_from_request(request.headers, request.path)
            name = self.config.api_keys.check(key) if key is not None and self.config.api_keys.enabled else None
            if key is not None and self.config.api_keys.enabled and name is None:
                self.edge["auth_refused"] += 1
                return _json_response(HTTPStatus.UNAUTHORIZED, {"error": "unknown API key"})
            if self.gate is not None and (refusal := self.gate.admit(connection, name)) is not None:
                status, code, message = refusal
                log.warning("connection from %s refused: %s", connection.address, code)
                return _json_response(status, {"error": message, "code": code}, retry_after=5)
            wait = self.gate.pace() if self.gate is not None else 0.0
            if wait is None:
                log.warning("connection from %s refused: server_busy", connection.address)
                return _json_response(HTTPStatus.SERVICE_UNAVAILABLE, {
                    "error": f"more than {self.config.handshakes_per_s:g} connections a second are opening; retry later",
                    "code": "server_busy"}, retry_after=max(1, round(self.config.handshake_wait_s)))
            if name is not None and self.quotas.enabled and self.gate is not None:
                return self._admit_in_cluster(connection, name, wait)  # websockets awaits it
            if wait:
                return _answer_later(wait)  # its turn at the handshake rate (websockets awaits it)
            return None
        return _json_response(HTTPStatus.NOT_FOUND, {"error": f"no route {path}; try /healthz, /metrics, /dashboard, /app or a websocket"})

    async def _admit_in_cluster(self, connection: LenientConnection, name: str, wait: float) -> Response | None:
        """A keyed handshake on a Redis store: count it in the key's cluster-wide set (refused at
        `max_connections_per_key` over every worker), then wait its turn at the handshake rate."""
        member = self.quotas.member(connection.id.hex)
        held = await self.quotas.admit_connection(name, member)
        if held is not None:
            self.edge["connections_refused_key"] += 1
            log.warning("connection from %s refused: too_many_connections_key (cluster)", connection.address)
            return _json_response(HTTPStatus.TOO_MANY_REQUESTS, {
                "error": f"this API key holds {held} connections across the cluster (limit "
                         f"{self.config.max_connections_per_key}); close some first",
                "code": "too_many_connections_key"}, retry_after=5)
        if connection.gate is None:  # it closed while the store answered
            self.quotas.forget_connection(name, member)
            return None
        connection.cluster_member = (name, member)
        self.gate.cluster_members.setdefault(name, set()).add(member)
        if wait:
            await asyncio.sleep(wait)
        return None


async def _answer_later(wait: float) -> None:
    await asyncio.sleep(wait)


def _json_response(status: HTTPStatus, body: dict, retry_after: int | None = None) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return Response(status.value, status.phrase, headers, data)


FD_RESERVE = 64  # descriptors kept for files, the store, the broker and the model when sockets are many


def raise_fd_limit() -> int:
    """Raise the soft open-file limit to the hard one where allowed (logged); returns the soft
    limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
            return soft
        log.info("raised the open-file limit from %d to %d", soft, target)
        return target
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_gate(cfg: ServerConfig, edge: dict) -> ConnectionGate:
    """The connection caps, with the server-wide one kept below the open-file limit: sockets
    past `limit - FD_RESERVE` are closed unanswered, and `max_connections` is lowered (logged)
    to leave room for that margin and for handshakes being refused."""
    limit = raise_fd_limit()
    reset_at = max(limit - FD_RESERVE, 16)
    total = cfg.max_connections
    if total > reset_at - FD_RESERVE:
        total = max(reset_at - FD_RESERVE, 1)
        log.warning("max_connections %d is above what the open-file limit %d allows; using %d",
                    cfg.max_connections, limit, total)
    return ConnectionGate(cfg.max_connections_per_address, cfg.max_connections_per_key, total, reset_at, edge,
                          cfg.handshakes_per_s, cfg.handshakes_burst,
                          min(cfg.handshake_wait_s, max(cfg.open_timeout_s - 1.0, 0.0)))  # answered before it times out


async def run_server(engine: Engine, config: ServerConfig,
                     on_ready: Callable[[StreamerServer], Awaitable[None] | None] | None = None) -> None:
    """Serve until SIGTERM or SIGINT, then shut down gracefully (see StreamerServer.shutdown); with
    a store that outlives this process (file or Redis), drain first: hand each session over with
    its KV cache to whichever worker resumes it next (streamer.drain)."""
    server = await StreamerServer(engine, config).start()
    heap = HeapKeeper.serving(config.gc_sweep_s, counters=server.edge)
    frozen = heap.start()
    if config.gc_sweep_s:
        log.info("garbage collector: %d objects of the started server frozen; the survivors of each full "
                 "collection are frozen too, and the frozen heap is swept every %g s at first",
                 frozen, config.gc_sweep_s)
    else:
        log.info("garbage collector: %d objects of the started server frozen", frozen)
    sweeper = asyncio.create_task(heap.run())
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
        if drains(server):
            done = await drain(server)
            log.info("drained: %(handed_off)d sessions handed over with their KV, %(not_handed_off)d left to "
                     "replay, in %(drain_s)g s", done)
        else:
            done = await server.shutdown()
        log.info("shut down: %(connections)d connections closed, %(in_flight)d requests in flight, "
                 "%(answers_ended)d answers ended early, %(unfinished)d unfinished", done)
    finally:
        sweeper.cancel()
        heap.stop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.remove_signal_handler(sig)
            except (NotImplementedError, RuntimeError):
                pass
        await server.stop()
