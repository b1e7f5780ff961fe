"""The retained MQTT state with the real Mosquitto: live counters that follow the session (at
a bounded rate), `closed` when it closes, `offline` when its worker stops, and the broker's
last will marking a worker that was killed (a real `streamer serve` process, SIGKILL) offline."""

import asyncio
import contextlib
import json
import uuid

from mqttutil import clear_retained
from procutil import ServerProcess
from wsutil import raw

from streamer.mqtt import parse_url
from streamer.server import ServerConfig, StreamerServer


class Listener:
    """An MQTT subscriber that keeps every message it sees: (topic, payload, retained)."""

    def __init__(self, broker_url: str, *topics: str) -> None:
        self.host, self.port = parse_url(broker_url)
        self.topics = topics
        self.messages: list[tuple[str, dict, bool]] = []
        self.arrived = asyncio.Event()

    async def __aenter__(self) -> "Listener":
        import aiomqtt

        self.client = aiomqtt.Client(self.host, self.port)
        await self.client.__aenter__()
        for topic in self.topics:
            await self.client.subscribe(topic, qos=1)
        self.task = asyncio.get_running_loop().create_task(self._read())
        return self

    async def _read(self) -> None:
        async for message in self.client.messages:
            if message.payload:
                self.messages.append((str(message.topic), json.loads(message.payload), bool(message.retain)))
                self.arrived.set()

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        await self.client.__aexit__(None, None, None)

    async def wait_for(self, pred, timeout: float = 30.0) -> tuple[str, dict, bool]:
        async with asyncio.timeout(timeout):
            while True:
                for item in self.messages:
                    if pred(*item):
                        return item
                self.arrived.clear()
                await self.arrived.wait()


def test_retained_state_follows_the_session_and_its_worker(tiny_engine, broker):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    interval = 0.2

    async def main():
        server = await StreamerServer(tiny_engine, ServerConfig(port=0, mqtt_url=broker, mqtt_prefix=prefix,
                                                                snapshot_interval_s=0.05, worker_id="w-state")).start()
        server.mqtt.state_interval_s = interval
        status_topic = f"{prefix}/workers/w-state/status"
        async with Listener(broker, f"{prefix}/sessions/+/state", status_topic) as seen:
            await asyncio.wait_for(server.mqtt.connected.wait(), 10)
            await seen.wait_for(lambda t, m, r: t == status_topic and m["status"] == "online"
                                and m["url"] == f"ws://127.0.0.1:{server.port}")
            peer = await raw(f"ws://127.0.0.1:{server.port}")
            sid = await peer.create()
            kept = await peer.create()  # left open: it goes offline with its worker
            state_topic = f"{prefix}/sessions/{sid}/state"
            for text in ("The keeper is Ada. ", "The lamp is lit. ", '{"target": [1.0, 0.5]}'):
                await peer.request({"type": "input.text.append", "session_id": sid, "text": text})
            await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 20, "horizon": 4,
                                "latency_ms": [5, 10]})
            _, live, _ = await seen.wait_for(lambda t, m, r: t == state_topic and m.get("data_version") == 3
                                             and m["last_action_seq"] >= 10)
            assert live["status"] == "live" and live["worker"] == "w-state" and live["closed"] is False
            assert live["tokens"] > 0 and live["last_seq"] == 3 and live["ended"] is False
            await peer.request({"type": "action.stop", "session_id": sid})
            await peer.request({"type": "session.close", "session_id": sid})
            _, closed, _ = await seen.wait_for(lambda t, m, r: t == state_topic and m["status"] == "closed")
            assert closed["closed"] is True and closed.get("data_version") == 3
            states = [m for t, m, r in seen.messages if t == state_topic and not r]
            gaps = [b["ts"] - a["ts"] for a, b in zip(states, states[1:-1])]  # the close goes at once
            assert len(states) >= 3 and min(gaps) >= interval * 0.9, gaps  # at most one per interval
            assert sum(m["last_action_seq"] > 0 for m in states) >= 2  # it moved while actions ran
            await server.stop()  # a clean stop: everything it held says offline
            await seen.wait_for(lambda t, m, r: t == status_topic and m["status"] == "offline"
                                and m["reason"] == "shutdown")
            await seen.wait_for(lambda t, m, r: t == f"{prefix}/sessions/{kept}/state" and m["status"] == "offline")
        async with Listener(broker, f"{prefix}/#") as later:  # what a dashboard that connects now sees
            await later.wait_for(lambda t, m, r: t == status_topic and r and m["status"] == "offline")
            await later.wait_for(lambda t, m, r: t == state_topic and r and m["status"] == "closed")
            await later.wait_for(lambda t, m, r: t.endswith(f"{kept}/state") and r and m["status"] == "offline")
        assert await clear_retained(broker, prefix) == 3  # the worker, the closed and the offline session

    asyncio.run(main())


def test_a_killed_worker_is_marked_offline_by_its_last_will(broker):
    prefix = f"t{uuid.uuid4().hex[:8]}"
    status_topic = f"{prefix}/workers/w-kill/status"

    async def main():
        async with Listener(broker, status_topic) as seen:
            server = ServerProcess("--mqtt", broker, "--mqtt-prefix", prefix, "--model", "tiny", "--store",
                                   "memory:", "--worker-id", "w-kill")
            try:
                await seen.wait_for(lambda t, m, r: m["status"] == "online", timeout=60)
                peer = await raw(server.url)
                await peer.create()  # its retained state stays 'live': the worker's status tells
                await peer.ws.close()
            finally:
                server.kill()  # SIGKILL: no shutdown, no goodbye to the broker
            _, will, _ = await seen.wait_for(lambda t, m, r: m["status"] == "offline", timeout=60)
            assert will["reason"] == "connection lost" and will["worker"] == "w-kill"
        await clear_retained(broker, prefix)

    asyncio.run(main())
