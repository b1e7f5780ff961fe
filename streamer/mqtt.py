"""MQTT fan-out (aiomqtt): session events out to per-session topics, robot state back in.

Topics under `{prefix}/sessions/{session_id}/`:
  flash      flash.updated and flash.stale events   (QoS 1)
  reasoning  reasoning.done events                  (QoS 1)
  actions    action.chunk events                    (QoS 1)
  commands   action.command events (rules)          (QoS 1)
  state      the session's live counters and status (QoS 1, retained; at most every
             `state_interval_s`, and at once when it closes or the worker stops; a closed
             session's state is cleared, an empty retained message, after `closed_retention_s`
             and expires at the broker then even if the worker is gone)
  errors     refusals of what came in on robot_state (QoS 1)
  robot_state  <- in: {"state": [numbers], "ts": seconds?}
and `{prefix}/workers/{worker_id}/status` (QoS 1, retained): online (once per connection) while
the worker is connected; offline when it stops, or, through the broker's last will, when it
dies. Each says `since`: when the connection it belongs to was opened. The will is written at
connect time and the broker sends it later, so it carries `"ts": null` (no time the worker could
know) and the `since` of the `online` it replaces.

Every message is a JSON envelope {"type", "session_id", "ts", ...}. Publishing never blocks a
session: events go through a bounded queue that drops its oldest entry when the broker is
slow or gone (counted in `dropped`), and the bridge reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from streamer.sessions.errors import EngineError
from streamer.store_base import DEFAULT_RETENTION_S

if TYPE_CHECKING:
    from streamer.sessions.engine import Engine

log = logging.getLogger(__name__)

TOPICS = {"flash.updated": "flash", "flash.stale": "flash", "reasoning.done": "reasoning", "action.chunk": "actions",
          "action.command": "commands"}
# Events that only change the retained state: an evaluation that kept its question's answer.
STATE_ONLY = frozenset({"flash.evaluated"})
# Snapshot fields (streamer.durability.Keeper.snapshot) the retained state carries.
SNAPSHOT_COUNTERS = ("data_version", "last_seq", "last_client_seq", "tokens", "context_window", "ended",
                     "ingest_lag_ms", "last_action_seq")
STATE_INTERVAL_S = 0.5
DRAIN_TIMEOUT_S = 2.0


@dataclass(slots=True)
class SessionState:
    """What the retained `state` topic of one session says, and when it last said it."""

    status: str = "live"  # live | detached | closed | offline (its worker stopped)
    counters: dict = field(default_factory=dict)
    flash: dict = field(default_factory=dict)
    last_action_seq: int = 0
    commands: int = 0
    published_at: float = float("-inf")  # loop time
    last_body: str | None = None
    timer: asyncio.TimerHandle | None = None

    def public(self) -> dict:
        return {"status": self.status, **self.counters, "last_action_seq": self.last_action_seq,
                "flash": self.flash, "commands": self.commands, "closed": self.status == "closed"}


def parse_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise ValueError(f"MQTT broker URL must look like mqtt://host:port, got {url!r}")
    return parsed.hostname, parsed.port or 1883


class MqttBridge:
    def __init__(self, engine: Engine, url: str, prefix: str = "streamer", max_queue: int = 1000,
                 client_id: str | None = None, worker_id: str = "worker",
                 state_interval_s: float = STATE_INTERVAL_S,
                 closed_retention_s: float = DEFAULT_RETENTION_S) -> None:
        self.engine = engine
        self.host, self.port = parse_url(url)
        self.prefix = prefix.rstrip("/")
        self.max_queue = max_queue
        self.client_id = client_id
        self.worker_id = worker_id
        self.worker_url: str | None = None
        self.state_interval_s = state_interval_s
        self.closed_retention_s = closed_retention_s  # then a closed session's retained state is cleared
        self.since: float | None = None  # when the present connection was opened (wall time)
        self.dropped = 0
        self.published = 0
        self.connected = asyncio.Event()
        # (topic, message or None for an empty payload, retain, message expiry in seconds or None)
        self._queue: asyncio.Queue[tuple[str, dict | None, bool, int | None]] = asyncio.Queue()
        self._listeners: dict[str, object] = {}
        self._state: dict[str, SessionState] = {}
        self._clears: dict[str, asyncio.TimerHandle] = {}  # closed sessions whose retained state goes
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def topic(self, session_id: str, leaf: str) -> str:
        return f"{self.prefix}/sessions/{session_id}/{leaf}"

    @property
    def worker_topic(self) -> str:
        return f"{self.prefix}/workers/{self.worker_id}/status"

    def _worker_status(self, status: str, reason: str | None = None) -> dict:
        return {"type": "worker", "worker": self.worker_id, "status": status, "url": self.worker_url,
                "reason": reason, "since": self.since, "ts": time.time()}

    def _will(self) -> dict:
        """The last will of the connection opened at `since`: the broker publishes it when it
        notices the connection is gone, a time the worker cannot write into it (`ts` is null)."""
        return {**self._worker_status("offline", "connection lost"), "ts": None}

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> "MqttBridge":
        """Ready to take sessions (their messages queue); it connects on `announce`."""
        self._loop = asyncio.get_running_loop()
        return self

    def announce(self, url: str) -> None:
        """The worker's URL is known (the server listens): connect; each connection says
        `online`, with this URL, once."""
        self.worker_url = url
        if self._task is None:
            self._task = self._loop.create_task(self._run())

    async def stop(self) -> None:
        """A clean stop: every session's state and the worker's status say offline (the
        sessions stay in the store, resumable), the queue drains for a moment, then the
        connection closes normally (so the broker does not send the last will)."""
        if self._task is None:
            return
        for session_id, listener in self._listeners.items():
            self.engine.remove_listener(session_id, listener)
        self._listeners.clear()
        for handle in self._clears.values():  # the broker expires those states (closed_retention_s)
            handle.cancel()
        self._clears.clear()
        for session_id, state in self._state.items():
            state.status = "offline"
            self._publish_state(session_id, state, force=True)
        self.enqueue(self.worker_topic, self._worker_status("offline", "shutdown"), retain=True)
        if self.connected.is_set():
            try:
                await asyncio.wait_for(self._queue.join(), DRAIN_TIMEOUT_S)
            except TimeoutError:
                log.warning("MQTT: %d messages not delivered at shutdown", self._queue.qsize())
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    def attach(self, session_id: str) -> None:
        """Publish this session's events (call on the event loop); once per session."""
        if session_id in self._listeners:  # adopted in the background, then resumed
            return

        def listener(event: str, payload: dict) -> None:  # engine or action thread
            if event in TOPICS or event in STATE_ONLY:
                try:
                    self._loop.call_soon_threadsafe(self._on_event, session_id, event, payload)
                except RuntimeError:  # the loop is gone (the server stopped): nobody to publish for
                    pass

        self._listeners[session_id] = listener
        self._state[session_id] = SessionState()
        if (handle := self._clears.pop(session_id, None)) is not None:  # the id is in use again
            handle.cancel()
        self.engine.add_listener(session_id, listener)
        self._touch(session_id)

    def detach(self, session_id: str) -> None:
        """The session closed: its retained state says so at once, with its last counters, for
        `closed_retention_s` (as long as the store keeps its log); then it is cleared (an empty
        retained message). The broker expires it then too, should this worker be gone."""
        listener = self._listeners.pop(session_id, None)
        state = self._state.pop(session_id, None)
        if listener is not None:
            self.engine.remove_listener(session_id, listener)
        if state is not None:
            state.status = "closed"
            self._publish_state(session_id, state, force=True, expiry_s=max(1, math.ceil(self.closed_retention_s)))
            self._clears[session_id] = self._loop.call_later(max(0.0, self.closed_retention_s), self._clear,
                                                             session_id)

    def _clear(self, session_id: str) -> None:
        self._clears.pop(session_id, None)
        self.enqueue(self.topic(session_id, "state"), None, retain=True)

    def snapshot(self, session_id: str, snapshot: dict) -> None:
        """The keeper wrote a new snapshot of the session (at most every snapshot interval)."""
        state = self._state.get(session_id)
        if state is None:
            return
        state.counters = {k: snapshot.get(k) for k in SNAPSHOT_COUNTERS if k in snapshot}
        state.last_action_seq = max(state.last_action_seq, snapshot.get("last_action_seq") or 0)
        state.status = "detached" if snapshot.get("detached") else "live"
        self._touch(session_id)

    # ---- out -----------------------------------------------------------------------------------

    def enqueue(self, topic: str, message: dict | None, retain: bool = False, expiry_s: int | None = None) -> None:
        """Queue one message (None: an empty payload, which clears a retained topic)."""
        if message is not None:
            message.setdefault("ts", time.time())
        if self._queue.qsize() >= self.max_queue:
            self._queue.get_nowait()  # the oldest goes: live data matters more than stale data
            self._queue.task_done()
            self.dropped += 1
        self._queue.put_nowait((topic, message, retain, expiry_s))

    def _on_event(self, session_id: str, event: str, payload: dict) -> None:
        if event in TOPICS:
            self.enqueue(self.topic(session_id, TOPICS[event]), {"type": event, "session_id": session_id, **payload})
        state = self._state.get(session_id)
        if state is None:
            return
        if event == "flash.updated":
            state.flash[payload["flash_id"]] = {"answer": payload["answer"], "data_version": payload["data_version"],
                                                "confidence": payload["confidence"], "stale": None}
        elif event == "flash.evaluated":  # the same answer (or a change not yet confirmed) on newer data
            entry = state.flash.get(payload["flash_id"])
            if entry is not None:
                entry["data_version"] = max(entry["data_version"] or 0, payload["data_version"])
                entry["stale"] = None
        elif event == "flash.stale":  # the retained state shows it stale until the next update
            entry = state.flash.setdefault(payload["flash_id"], {"answer": payload["answer"],
                                                                 "data_version": payload["answer_version"]})
            entry["stale"] = {"reason": payload["reason"], "versions_behind": payload["versions_behind"],
                              "seconds_behind": payload["seconds_behind"]}
        elif event == "action.chunk":
            state.last_action_seq = max(state.last_action_seq, payload["seq"])
        elif event == "action.command":
            state.commands += 1
        self._touch(session_id)

    def _touch(self, session_id: str) -> None:
        """The session's state changed: publish it now, or at the end of the interval."""
        state = self._state.get(session_id)
        if state is None or state.timer is not None:
            return  # gone, or a publish is already due
        wait = state.published_at + self.state_interval_s - self._loop.time()
        if wait <= 0:
            self._publish_state(session_id, state)
        else:
            state.timer = self._loop.call_later(wait, self._due, session_id)

    def _due(self, session_id: str) -> None:
        state = self._state.get(session_id)
        if state is not None:
            state.timer = None
            self._publish_state(session_id, state)

    def _publish_state(self, session_id: str, state: SessionState, force: bool = False,
                       expiry_s: int | None = None) -> None:
        if state.timer is not None and force:
            state.timer.cancel()
            state.timer = None
        body = state.public()
        text = json.dumps(body, sort_keys=True, default=str)
        if text == state.last_body and not force:
            return
        state.last_body, state.published_at = text, self._loop.time()
        self.enqueue(self.topic(session_id, "state"), {"type": "state", "session_id": session_id,
                                                       "worker": self.worker_id, **body}, retain=True,
                     expiry_s=expiry_s)

    # ---- connection ----------------------------------------------------------------------------

    async def _run(self) -> None:
        import aiomqtt

        backoff = 0.2
        while True:
            self.since = time.time()  # this connection's: its will and its online say so
            will = aiomqtt.Will(self.worker_topic, json.dumps(self._will()), qos=1, retain=True)
            try:
                async with aiomqtt.Client(self.host, self.port, identifier=self.client_id, will=will,
                                          keepalive=15, protocol=aiomqtt.ProtocolVersion.V5) as client:
                    await client.subscribe(f"{self.prefix}/sessions/+/robot_state", qos=1)
                    await client.publish(self.worker_topic, json.dumps(self._worker_status("online")), qos=1,
                                         retain=True)
                    self.connected.set()
                    backoff = 0.2
                    log.info("MQTT connected to %s:%d", self.host, self.port)
                    tasks = [asyncio.ensure_future(self._send(client)), asyncio.ensure_future(self._receive(client))]
                    try:
                        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                    finally:
                        for task in tasks:  # no sender left behind on a dead client
                            task.cancel()
                    for task in done:
                        task.result()  # re-raise the MqttError that ended the connection
            except aiomqtt.MqttError as exc:
                self.connected.clear()
                log.warning("MQTT %s:%d unavailable (%s); retrying in %.1f s", self.host, self.port, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def _send(self, client) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        while True:
            topic, message, retain, expiry_s = await self._queue.get()
            properties = None
            if expiry_s is not None:  # MQTT 5: the broker drops the (retained) message after this
                properties = Properties(PacketTypes.PUBLISH)
                properties.MessageExpiryInterval = expiry_s
            try:
                await client.publish(topic, b"" if message is None else json.dumps(message), qos=1, retain=retain,
                                     properties=properties)
                self.published += 1
            finally:
                self._queue.task_done()

    async def _receive(self, client) -> None:
        async for message in client.messages:
            parts = str(message.topic).split("/")
            session_id = parts[-2] if len(parts) >= 2 else ""
            try:
                state, ts = _parse_robot_state(message.payload)
                self.engine.robot_state(session_id, state, ts)
            except Exception as exc:  # anyone may publish here: nothing they send may stop the bridge
                code = exc.code if isinstance(exc, EngineError) else "invalid_robot_state"
                self.enqueue(self.topic(session_id, "errors"), {
                    "type": "error", "session_id": session_id,
                    "error": {"code": code, "message": str(exc)[:300], "recoverable": True}})


def _parse_robot_state(payload: bytes | bytearray | str) -> tuple[list[float], float | None]:
    """{"state": [numbers], "ts": seconds?} -> (state, ts); ValueError names what is wrong."""
    try:
        data = json.loads(payload)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"robot state is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("state"), list):
        raise ValueError('robot state must be an object {"state": [numbers], "ts": seconds}')
    state = data["state"]
    if len(state) > 64 or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < 1e300
                                  for v in state):
        raise ValueError("robot state 'state' must be at most 64 finite numbers")
    ts = data.get("ts")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float))):
        raise ValueError("robot state 'ts' must be a number")
    return [float(v) for v in state], ts
