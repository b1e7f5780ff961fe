"""MQTT fan-out (aiomqtt): session events out to per-session topics, robot state back in.

Topics under `{prefix}/sessions/{session_id}/`:
  flash      flash.updated events                   (QoS 1)
  reasoning  reasoning.done events                  (QoS 1)
  actions    action.chunk events                    (QoS 1)
  commands   action.command events (rules)          (QoS 1)
  state      the last flash answers and action seq  (QoS 1, retained)
  errors     refusals of what came in on robot_state (QoS 1)
  robot_state  <- in: {"state": [numbers], "ts": seconds?}

Every message is a JSON envelope {"type", "session_id", "ts", ...}. Publishing never blocks a
session: events go through a bounded queue that drops its oldest entry when the broker is
slow or gone (counted in `dropped`), and the bridge reconnects with backoff.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from streamer.sessions.errors import EngineError

if TYPE_CHECKING:
    from streamer.sessions.engine import Engine

log = logging.getLogger(__name__)

TOPICS = {"flash.updated": "flash", "reasoning.done": "reasoning", "action.chunk": "actions",
          "action.command": "commands"}


def parse_url(url: str) -> tuple[str, int]:
    parsed = urlparse(url if "://" in url else f"mqtt://{url}")
    if parsed.scheme not in ("mqtt", "tcp") or not parsed.hostname:
        raise ValueError(f"MQTT broker URL must look like mqtt://host:port, got {url!r}")
    return parsed.hostname, parsed.port or 1883


class MqttBridge:
    def __init__(self, engine: Engine, url: str, prefix: str = "streamer", max_queue: int = 1000,
                 client_id: str | None = None) -> None:
        self.engine = engine
        self.host, self.port = parse_url(url)
        self.prefix = prefix.rstrip("/")
        self.max_queue = max_queue
        self.client_id = client_id
        self.dropped = 0
        self.published = 0
        self.connected = asyncio.Event()
        self._queue: asyncio.Queue[tuple[str, dict, bool]] = asyncio.Queue()
        self._listeners: dict[str, object] = {}
        self._state: dict[str, dict] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def topic(self, session_id: str, leaf: str) -> str:
        return f"{self.prefix}/sessions/{session_id}/{leaf}"

    # ---- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> "MqttBridge":
        self._loop = asyncio.get_running_loop()
        self._task = self._loop.create_task(self._run())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def attach(self, session_id: str) -> None:
        """Publish this session's events (call on the event loop)."""

        def listener(event: str, payload: dict) -> None:  # engine or action thread
            if event in TOPICS:
                self._loop.call_soon_threadsafe(self._on_event, session_id, event, payload)

        self._listeners[session_id] = listener
        self._state[session_id] = {"flash": {}, "last_action_seq": 0, "commands": 0}
        self.engine.add_listener(session_id, listener)

    def detach(self, session_id: str) -> None:
        listener = self._listeners.pop(session_id, None)
        self._state.pop(session_id, None)
        if listener is not None:
            self.engine.remove_listener(session_id, listener)
            self.enqueue(self.topic(session_id, "state"), {"type": "state", "session_id": session_id,
                                                           "closed": True}, retain=True)

    # ---- out -----------------------------------------------------------------------------------

    def enqueue(self, topic: str, message: dict, retain: bool = False) -> None:
        message.setdefault("ts", time.time())
        if self._queue.qsize() >= self.max_queue:
            self._queue.get_nowait()  # the oldest goes: live data matters more than stale data
            self.dropped += 1
        self._queue.put_nowait((topic, message, retain))

    def _on_event(self, session_id: str, event: str, payload: dict) -> None:
        self.enqueue(self.topic(session_id, TOPICS[event]), {"type": event, "session_id": session_id, **payload})
        state = self._state.get(session_id)
        if state is None:
            return
        if event == "flash.updated":
            state["flash"][payload["flash_id"]] = {"answer": payload["answer"], "data_version": payload["data_version"],
                                                   "confidence": payload["confidence"]}
        elif event == "action.chunk":
            state["last_action_seq"] = payload["seq"]
            return  # chunks come at control rate: the retained state follows the other events
        elif event == "action.command":
            state["commands"] += 1
        self.enqueue(self.topic(session_id, "state"), {"type": "state", "session_id": session_id, **state}, retain=True)

    # ---- connection ----------------------------------------------------------------------------

    async def _run(self) -> None:
        import aiomqtt

        backoff = 0.2
        while True:
            try:
                async with aiomqtt.Client(self.host, self.port, identifier=self.client_id) as client:
                    await client.subscribe(f"{self.prefix}/sessions/+/robot_state", qos=1)
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
        while True:
            topic, message, retain = await self._queue.get()
            await client.publish(topic, json.dumps(message), qos=1, retain=retain)
            self.published += 1

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
