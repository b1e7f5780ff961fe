"""One websocket connection: the receive loop, and running what the command handlers answer.

Frames are parsed by the sans-I/O protocol and handed to the command table (streamer.handlers)
in arrival order; engine calls only enqueue, so a busy model never blocks this loop. Replies
that wait on the engine or the store run in small tasks, and every outbound event goes through
the connection's one ordered `Outbox`.

Limits: every byte read from the socket (any frame, valid or not, and the handshake) takes from
the byte rate bucket as it arrives; a connection in deficit is not read until the deficit is
paid (TCP pushes back on the client), and one held back longer than `byte_throttle_s` a minute
is closed (byte_rate_limited, 1008). Every frame, before it is parsed, takes from the message
rate bucket (a frame over it is dropped unparsed) and from the server-wide `MessageBudget`
(a fair share per sending connection: while the budget is spent, a connection over its share
is slowed to it, not read meanwhile). Refused and invalid frames take
from a third bucket; a connection that empties it is closed (rate_limited, 1008). Then the
shutdown check. Sockets are counted per client address, per API key and in all by the
`ConnectionGate` (the caps are checked at the handshake).
Backpressure: reading pauses while the client's commands wait on the engine beyond
`max_inflight`, or its undelivered events pass the outbox's high watermark.
Idle connections and slow consumers are found by one timer each per connection (`check_idle`,
`Outbox.check_slow`), never by polling, so thousands of idle connections cost no CPU.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus

from websockets.asyncio.server import ServerConnection
from websockets.frames import Frame
from websockets.protocol import State

from streamer.sessions.errors import EngineError

from .handlers import HANDLERS, Await, Peer, Services
from .loopbridge import bridge
from .outbox import Outbox
from .protocol import Command, ProtocolError, ServerProtocol
from .directory import Moved
from .store_base import StoreError

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

    def __init__(self, *args, gate: ConnectionGate | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.protocol.logger = self.logger = _QuietHttpLog(self.protocol.logger)
        self.gate = gate
        self.address: str | None = None  # the client's IP address, once connected
        self.key_slot: str | None = None  # the API key name this connection counts against
        self.cluster_member: tuple[str, str] | None = None  # (key name, member) counted in the cluster
        self.bytes_read = 0  # as the byte rate counts them (see data_received)
        self.meter: Callable[[int], None] | None = None  # told the size of every read (the byte rate)
        self.unframed = 0  # bytes read since the last complete frame
        self.payload = 0  # decoded bytes of the frames completed by the current read
        self.holds: set[str] = set()  # why reading is paused: "queue" (websockets' own), "bytes"

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        # websockets pauses reading while its frame queue is full; the byte rate pauses it too:
        # the socket is read only when neither holds it
        self.recv_messages.pause = lambda: self.hold("queue")
        self.recv_messages.resume = lambda: self.release("queue")
        peer = transport.get_extra_info("peername")
        self.address = peer[0] if peer else None
        if self.gate is not None and not self.gate.opened(self):
            transport.abort()  # past the descriptor guard: closed unanswered

    def connection_lost(self, exc) -> None:
        if self.gate is not None:
            self.gate.closed(self)
            self.gate = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Count what was read: its bytes, and for the frames it completes their decoded size
        beyond the bytes they came in (a compressed frame counts as what it inflates to)."""
        self.unframed += len(data)
        self.payload = 0
        super().data_received(data)
        size = len(data)
        if self.payload:
            size += max(0, self.payload - self.unframed)
            self.unframed = 0
        self.bytes_read += size
        if self.gate is not None:
            self.gate.edge["bytes_read"] += size
        if self.meter is not None:
            self.meter(size)

    def process_event(self, event) -> None:
        if isinstance(event, Frame):
            self.payload += len(event.data)
        super().process_event(event)

    def hold(self, reason: str) -> None:
        """Stop reading the socket for `reason` (until `release`)."""
        if not self.holds and not self.transport.is_closing():
            self.transport.pause_reading()
        self.holds.add(reason)

    def release(self, reason: str) -> None:
        if reason not in self.holds:
            return
        self.holds.discard(reason)
        if not self.holds and not self.transport.is_closing():
            self.transport.resume_reading()

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

    def refill(self) -> None:
        """Add what the rate gave since the last look, up to the burst."""
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def take(self, amount: float = 1.0) -> bool:
        self.refill()
        if self.level < amount and self.extra >= amount:
            self.extra -= amount
            return True
        if self.level < amount:
            return False
        self.level -= amount
        return True

    def debit(self, amount: float, floor: float | None = None) -> float:
        """Take `amount` whatever the level (what was read was read): returns the deficit, the
        amount below zero (0 when in credit). `floor` bounds the debt."""
        now = time.monotonic()
        self.level = min(self.burst, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.level < amount and self.extra > 0:
            used = min(self.extra, amount - max(self.level, 0.0))
            self.extra -= used
            amount -= used
        self.level -= amount
        if floor is not None:
            self.level = max(self.level, floor)
        return max(0.0, -self.level)


class MessageBudget:
    """The server-wide message rate, shared fairly by the connections that are sending.

    Each connection that sent a message in the last `window_s` is active; its share is the
    budget divided by the active connections. A message within its connection's share always
    passes (and is charged to the budget); one beyond it passes only while the budget has room
    (a quiet server lends its spare rate), so when the server is busy every sender gets its
    share and no group of connections, each under its own limit, can take a bystander's."""

    def __init__(self, rate: float, burst: float, window_s: float = 2.0) -> None:
        self.rate, self.burst, self.window_s = rate, burst, window_s
        self.bucket = TokenBucket(rate, burst)
        self.active: dict[int, float] = {}  # id(connection) -> when it last sent
        self.pruned = time.monotonic()

    def share(self) -> float:
        return self.rate / max(1, len(self.active))

    def take(self, conn_id: int, own: TokenBucket) -> bool:
        now = time.monotonic()
        self.active[conn_id] = now
        if now - self.pruned > self.window_s / 4:
            self.active = {k: t for k, t in self.active.items() if now - t <= self.window_s}
            self.pruned = now
        n = len(self.active)
        own.rate, own.burst = self.rate / n, max(2.0, self.burst / n)
        if own.take():
            self.bucket.debit(1.0, floor=-self.burst)
            return True
        return self.bucket.take()

    def forget(self, conn_id: int) -> None:
        self.active.pop(conn_id, None)


class ConnectionGate:
    """Open sockets per client address and in all, and websocket connections per API key: the
    caps are checked at the handshake (`admit`: an HTTP refusal with a JSON body naming its
    code); a socket past the descriptor guard (`reset_at` open sockets in all, or twice the
    address's cap) is closed at once, unanswered, so `accept()` never runs out of descriptors."""

    def __init__(self, per_address: int, per_key: int, total: int, reset_at: int, edge: dict,
                 handshakes_per_s: float = 0.0, handshakes_burst: int = 1, handshake_wait_s: float = 0.0) -> None:
        self.per_address, self.per_key, self.total, self.reset_at = per_address, per_key, total, reset_at
        self.edge = edge
        # the server's handshake rate (0: none): a handshake beyond it waits its turn, or is refused
        # when its turn is more than handshake_wait_s away
        self.handshakes = TokenBucket(handshakes_per_s, max(handshakes_burst, 1)) if handshakes_per_s > 0 else None
        self.handshake_wait_s = handshake_wait_s
        self.sockets = 0
        self.by_address: Counter[str] = Counter()
        self.by_key: Counter[str] = Counter()
        # connections counted in the cluster's per-key sets (streamer.quotas): key -> members
        self.cluster_members: dict[str, set[str]] = {}
        self.forget_member: Callable[[str, str], None] | None = None  # ClusterQuota.forget_connection

    def opened(self, conn: LenientConnection) -> bool:
        """A socket was accepted: count it; False if it must be closed at once."""
        self.sockets += 1
        self.by_address[conn.address] += 1
        if self.sockets > self.reset_at or self.by_address[conn.address] > 2 * self.per_address:
            self.edge["connections_reset"] += 1
            return False
        return True

    def closed(self, conn: LenientConnection) -> None:
        self.sockets -= 1
        self.by_address[conn.address] -= 1
        if self.by_address[conn.address] <= 0:
            del self.by_address[conn.address]
        if conn.key_slot is not None:
            self.by_key[conn.key_slot] -= 1
            if self.by_key[conn.key_slot] <= 0:
                del self.by_key[conn.key_slot]
        if conn.cluster_member is not None:
            key_name, member = conn.cluster_member
            members = self.cluster_members.get(key_name, set())
            members.discard(member)
            if not members:
                self.cluster_members.pop(key_name, None)
            if self.forget_member is not None:
                self.forget_member(key_name, member)

    def admit(self, conn: LenientConnection, key_name: str | None) -> tuple[HTTPStatus, str, str] | None:
        """A websocket handshake: None to go on, else (HTTP status, code, message). A connection
        admitted with an API key counts against that key until it closes."""
        if self.by_address[conn.address] > self.per_address:
            self.edge["connections_refused_address"] += 1
            return (HTTPStatus.TOO_MANY_REQUESTS, "too_many_connections_address",
                    f"more than {self.per_address} connections from this address; close some first")
        if key_name is not None and self.by_key[key_name] >= self.per_key:
            self.edge["connections_refused_key"] += 1
            return (HTTPStatus.TOO_MANY_REQUESTS, "too_many_connections_key",
                    f"more than {self.per_key} connections with this API key; close some first")
        if self.sockets > self.total:
            self.edge["connections_refused_server"] += 1
            return (HTTPStatus.SERVICE_UNAVAILABLE, "server_full",
                    f"the server holds its maximum of {self.total} connections; retry later")
        if key_name is not None:
            conn.key_slot = key_name
            self.by_key[key_name] += 1
        return None

    def pace(self) -> float | None:
        """An admitted handshake's turn at the server's handshake rate: the seconds it waits
        before it is answered (0: at once), or None when its turn is more than
        `handshake_wait_s` away (refuse it: `server_busy`). Connections opened in a storm (10,000
        clients at once, or a flood from a few) are answered at the rate the event loop can take
        beside the sessions it serves, instead of taking it from them."""
        bucket = self.handshakes
        if bucket is None:
            return 0.0
        bucket.refill()
        wait = max(0.0, (1.0 - bucket.level) / bucket.rate)
        if wait > self.handshake_wait_s:
            self.edge["handshakes_refused"] += 1
            return None
        bucket.level -= 1.0  # below zero: the turns already given out
        if wait > 0:
            self.edge["handshakes_paced"] += 1
        return wait


class Connection:
    """One client connection: a `Peer` for the handlers, its outbox, its receive loop."""

    def __init__(self, ws: ServerConnection, svc: Services, key_name: str | None, media=None,
                 shutting_down=lambda: False, budget: MessageBudget | None = None) -> None:
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
        # time held back for the byte rate: byte_throttle_s in any minute, then the connection closes
        self.throttled = TokenBucket(cfg.byte_throttle_s / 60, cfg.byte_throttle_s)
        self.budget = budget
        self.share = TokenBucket(cfg.messages_per_s, cfg.messages_burst)  # rate and burst set by the budget
        if isinstance(ws, LenientConnection):
            ws.meter = self.meter
        self.last_message = time.monotonic()
        self.idle_timer: asyncio.TimerHandle | None = None  # see check_idle
        self.tasks: set[asyncio.Task] = set()
        if cfg.send_buffer_bytes and ws.transport is not None:
            sock = ws.transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.send_buffer_bytes)

    def send(self, text: str) -> None:
        self.outbox.send(text)

    def _dropped(self, code: str) -> None:
        counter = {"slow_consumer": "slow_consumers_dropped", "idle_timeout": "idle_closed",
                   "byte_rate_limited": "byte_rate_closed"}.get(code)
        if counter is not None:
            self.svc.edge[counter] += 1

    def meter(self, size: int) -> None:
        """`size` bytes were read from the socket (any frame, valid or not). In deficit, stop
        reading until the deficit is paid at the byte rate; a connection held back more than
        `byte_throttle_s` a minute is closed (byte_rate_limited, 1008)."""
        deficit = self.bytes_in.debit(size)
        ws = self.ws
        if not deficit or "bytes" in ws.holds or self.outbox.dropping is not None:
            return
        wait = deficit / self.bytes_in.rate
        cfg = self.config
        if not self.throttled.take(wait):
            ws.hold("bytes")  # read nothing more: the writer says why and closes
            self.outbox.drop("byte_rate_limited", f"more than {cfg.bytes_per_s:g} bytes/s (burst "
                             f"{self.bytes_in.burst:g}) on this connection for over {cfg.byte_throttle_s:g} s "
                             "in a minute; closing it", close_code=1008)
            return
        self.svc.edge["byte_throttled"] += 1
        ws.hold("bytes")
        self.loop.call_later(wait, self._read_again)

    def _read_again(self) -> None:
        if self.outbox.dropping is None:
            self.ws.release("bytes")

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

    def check_idle(self) -> None:
        """The idle timer: close a connection with no session or subscription that sent nothing
        for `idle_timeout_s`; otherwise check again when that could next be true. One timer per
        connection, firing at most once per `idle_timeout_s` (a poll a few times a second per
        connection cost the event loop CPU at thousands of idle connections)."""
        self.idle_timer = None
        if self.outbox.dropping is not None:
            return
        cfg, peer = self.config, self.peer
        left = self.last_message + cfg.idle_timeout_s - time.monotonic()
        if left <= 0 and not peer.sessions and not peer.subscriptions:
            self.outbox.drop("idle_timeout", f"no message for {cfg.idle_timeout_s:g} s and no session or "
                             "subscription", close_code=1000)
            return
        self.idle_timer = self.loop.call_later(left if left > 0 else cfg.idle_timeout_s, self.check_idle)

    # ---- the receive loop ------------------------------------------------------------------

    async def run(self) -> None:
        writer = self.loop.create_task(self.outbox.writer())
        self.idle_timer = self.loop.call_later(self.config.idle_timeout_s, self.check_idle)
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
            if self.idle_timer is not None:
                self.idle_timer.cancel()
                self.idle_timer = None
            self.outbox.stop_timer()
            if self.outbox.dropping is None:
                writer.cancel()
            else:  # let the writer tell the client why, then close
                await asyncio.wait({writer}, timeout=5)
                writer.cancel()

    async def receive(self, frame) -> None:
        """One frame: count it against the message rates (valid or not, before any parsing; its
        bytes were counted as they were read), parse it, hand it to its handler. A connection that
        keeps sending frames that are refused or invalid is closed (rate_limited, 1008)."""
        if (refusal := self.over_rate()) is not None:
            self.strike(refusal)
            return
        await self.fair_share()
        if self.outbox.dropping is not None:
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
        if (moved := await self.svc.resumer.fence(cmd, self.proto)) is not None:
            self.send(moved)  # another worker adopted the session while this one had lost its lease
            return
        if cmd.type not in LOGGED and (barrier := self.svc.events.barrier(cmd.session_id)) is not None:
            await barrier  # the session's earlier changes are handed to the engine first
        self.dispatch(cmd)
        if cmd.type == "media" and self.peer.media is not None:
            await self.peer.media.throttle(cmd)

    def over_rate(self) -> str | None:
        """The error for a frame over the connection's own message rate (the frame is then not
        even parsed, so the error has no `reply_to`)."""
        cfg = self.config
        if not self.messages.take():
            self.svc.edge["rate_limited"] += 1
            return self.proto.error("rate_limited", f"more than {cfg.messages_per_s:g} messages/s (burst "
                                    f"{cfg.messages_burst}) on this connection; the message was not processed")
        return None

    async def fair_share(self) -> None:
        """While the server's message budget is spent, a connection over its fair share of it is
        slowed to that share: its frame waits, and nothing more is read from it meanwhile (TCP
        pushes back on the client), so a group of connections each under its own rate costs
        the server its budget at most, and no refusals to write either."""
        budget = self.budget
        if budget is None or budget.take(id(self), self.share):
            return
        self.svc.edge["server_busy"] += 1
        share = self.share
        while self.outbox.dropping is None and not budget.take(id(self), share):
            await asyncio.sleep(max(0.001, (1.0 - share.level) / max(share.rate, 1e-3)))

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
        if isinstance(exc, Moved):  # with `owner`: where to go
            return exc.event(self.proto, cmd.event_id, cmd.session_id)
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
            result = await asyncio.shield(bridge(self.loop).wrap(future))  # the loop's own futures as they are
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
        if self.budget is not None:
            self.budget.forget(id(self))
        if isinstance(self.ws, LenientConnection):
            self.ws.meter = None
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


CLOSE_WAIT_S = 1.0  # at shutdown: how long a peer has to answer the close (1001) before its socket is cut


async def going_away(connections, wait_s: float) -> None:
    """Close each with 1001 (going away), all at once. A peer that has not finished the close
    handshake within `wait_s` (it stopped reading, or never answers a close) has its TCP
    connection aborted: shutdown never waits out websockets' own close timeouts (10 s for the
    handshake, then 10 s more for the TCP close; an idle peer that never answered held a 10 s
    grace period's SIGTERM for 21 s)."""
    if not connections:
        return
    closing = [asyncio.ensure_future(c.ws.close(1001, "server shutting down")) for c in connections]
    await asyncio.wait(closing, timeout=wait_s)
    for c in connections:
        if c.ws.state is not State.CLOSED and c.ws.transport is not None:
            c.ws.transport.abort()
    await asyncio.wait(closing, timeout=wait_s)  # an aborted socket's close returns at once
    for task in closing:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()  # retrieved: a close that failed is a closed connection all the same
