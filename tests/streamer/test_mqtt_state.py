"""The retained MQTT state with the real Mosquitto: live counters that follow the session (at
a bounded rate), flash answers as current as their last evaluation, `closed` when it closes
(cleared after the retention time), `offline` when its worker stops, `online` once per
connection, and the broker's last will marking a worker that was killed (a real `streamer
serve` process, SIGKILL) offline without a made-up time."""

import asyncio
import contextlib
import json
import uuid

from mqttutil import clear_retained, retained
from procutil import ServerProcess
from wsutil import raw

from streamer.mqtt import MqttBridge, parse_url
from streamer.server import ServerConfig, StreamerServer


class Listener:
    """An MQTT subscriber that keeps every message it sees: (topic, payload, retained)."""

    def __init__(self, broker_url: str, *topics: str) -> None:
        self.host, self.port = parse_url(broker_url)
        self.topics = topics
        self.messages: list[tuple[str, dict, bool]] = []
        self.cleared: list[str] = []  # topics an empty retained message cleared
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
            else:
                self.cleared.append(str(message.topic))
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

    async def wait_cleared(self, topic: str, timeout: float = 30.0) -> None:
        async with asyncio.timeout(timeout):
            while topic not in self.cleared:
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
                _, online, _ = await seen.wait_for(lambda t, m, r: m["status"] == "online", timeout=60)
                peer = await raw(server.url)
                await peer.create()  # its retained state stays 'live': the worker's status tells
                await peer.ws.close()
            finally:
                server.kill()  # SIGKILL: no shutdown, no goodbye to the broker
            await seen.wait_for(lambda t, m, r: m["status"] == "offline", timeout=60)
        # what a dashboard that connects now reads: the will, which claims no time it cannot know
        # (the broker sent it after the kill; it was written at connect time) and names the
        # connection it ends, the one the 'online' came from
        will = json.loads((await retained(broker, status_topic))[status_topic])
        assert will["status"] == "offline" and will["reason"] == "connection lost" and will["worker"] == "w-kill"
        assert will["ts"] is None and will["since"] == online["since"] <= online["ts"]
        assert will["url"] == online["url"] == server.url
        await clear_retained(broker, prefix)

    asyncio.run(main())


def test_online_is_published_once_per_connection(tiny_engine, broker):
    """A worker says `online` once when it connects, with its URL, and once again on each
    reconnect (with the new connection's `since`); the broker drops the first connection when
    another client takes over its client id, and sends that connection's will."""
    import aiomqtt

    prefix = f"t{uuid.uuid4().hex[:8]}"
    status_topic, marker = f"{prefix}/workers/w-once/status", f"{prefix}/marker"
    client_id = f"streamer-{prefix}"

    async def main():
        async with Listener(broker, status_topic, marker) as seen:
            bridge = await MqttBridge(tiny_engine, broker, prefix, client_id=client_id, worker_id="w-once").start()
            bridge.announce("ws://127.0.0.1:9")
            try:
                async def flushed(n: int) -> list[dict]:
                    """The status messages so far: a marker the bridge queues after them came back."""
                    bridge.enqueue(marker, {"n": n})
                    await seen.wait_for(lambda t, m, r: t == marker and m["n"] == n)
                    return [m for t, m, r in seen.messages if t == status_topic]

                _, first, _ = await seen.wait_for(lambda t, m, r: t == status_topic and m["status"] == "online")
                assert [m["status"] for m in await flushed(1)] == ["online"]
                assert first["url"] == "ws://127.0.0.1:9" and first["since"] <= first["ts"]
                host, port = parse_url(broker)
                with contextlib.suppress(aiomqtt.MqttError):  # the bridge may take its id back first
                    async with aiomqtt.Client(host, port, identifier=client_id):
                        pass
                _, second, _ = await seen.wait_for(lambda t, m, r: t == status_topic and m["status"] == "online"
                                                   and m["since"] > first["since"])
                statuses = await flushed(2)
                assert [m["status"] for m in statuses] == ["online", "offline", "online"], statuses
                assert statuses[1]["reason"] == "connection lost" and statuses[1]["since"] == first["since"]
                assert statuses[1]["ts"] is None and second["url"] == first["url"]
            finally:
                await bridge.stop()
        await clear_retained(broker, prefix)

    asyncio.run(main())


def test_a_closed_sessions_retained_state_is_cleared_after_the_retention(tiny_engine, broker):
    """A closed session's retained state stays for the store's retention time (as its log
    does), then an empty retained message clears it; one closed just before its worker stopped
    expires at the broker all the same."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    retention = 1.0

    async def main():
        server = StreamerServer(tiny_engine, ServerConfig(port=0, mqtt_url=broker, mqtt_prefix=prefix,
                                                          snapshot_interval_s=0.05, worker_id="w-ret"))
        server.store.retention_s = retention  # the store keeps a closed session's log this long
        await server.start()
        stopped = False
        try:
            async with Listener(broker, f"{prefix}/sessions/+/state") as seen:
                await asyncio.wait_for(server.mqtt.connected.wait(), 10)
                peer = await raw(f"ws://127.0.0.1:{server.port}")
                sid = await peer.create()
                state_topic = f"{prefix}/sessions/{sid}/state"
                await peer.request({"type": "input.text.append", "session_id": sid, "text": "The lamp is lit. "})
                await peer.request({"type": "session.close", "session_id": sid})
                _, closed, _ = await seen.wait_for(lambda t, m, r: t == state_topic and m["status"] == "closed")
                await seen.wait_cleared(state_topic)
                assert state_topic not in await retained(broker, f"{prefix}/sessions/+/state")

                other = await peer.create()
                other_topic = f"{prefix}/sessions/{other}/state"
                await peer.request({"type": "session.close", "session_id": other})
                await seen.wait_for(lambda t, m, r: t == other_topic and m["status"] == "closed")
                await peer.ws.close()
            await server.stop()  # before the retention ran out: the broker expires the state itself
            stopped = True
            async with asyncio.timeout(30):
                while other_topic in await retained(broker, f"{prefix}/sessions/+/state"):
                    await asyncio.sleep(0.1)
        finally:
            if not stopped:
                await server.stop()
            await clear_retained(broker, prefix)

    asyncio.run(main())


def test_retained_flash_data_version_follows_every_evaluation(tiny_engine, broker):
    """The retained state's flash entry names the data version of the question's latest
    evaluation, also when the evaluation kept the answer (no `flash.updated` then); it is never
    behind the latest `flash.updated` on the flash topic."""
    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def main():
        server = await StreamerServer(tiny_engine, ServerConfig(port=0, mqtt_url=broker, mqtt_prefix=prefix,
                                                                snapshot_interval_s=0.05)).start()
        server.mqtt.state_interval_s = 0.05
        loop = asyncio.get_running_loop()
        evaluations: list[tuple[str, int]] = []
        evaluated = asyncio.Event()

        def on_event(event: str, payload: dict) -> None:  # engine thread
            if event in ("flash.updated", "flash.evaluated") and payload.get("flash_id") == "lamp":
                loop.call_soon_threadsafe(lambda: (evaluations.append((event, payload["data_version"])),
                                                   evaluated.set()))

        try:
            async with Listener(broker, f"{prefix}/sessions/+/state", f"{prefix}/sessions/+/flash") as seen:
                await asyncio.wait_for(server.mqtt.connected.wait(), 10)
                peer = await raw(f"ws://127.0.0.1:{server.port}")
                sid = await peer.create()
                state_topic, flash_topic = f"{prefix}/sessions/{sid}/state", f"{prefix}/sessions/{sid}/flash"
                await asyncio.wrap_future(tiny_engine.add_listener(sid, on_event))
                registered = await peer.request({"type": "flash.register", "session_id": sid, "flash_id": "lamp",
                                                 "question": "Is the lamp lit?", "max_tokens": 1})
                assert registered["type"] == "flash.registered", registered
                for version, text in enumerate(["The lamp is lit. ", "The lamp is lit. ", "The lamp is lit. ",
                                                "The lamp is lit. "], start=1):
                    await peer.request({"type": "input.text.append", "session_id": sid, "text": text})
                    async with asyncio.timeout(60):  # the question is evaluated on this version
                        while not any(v == version for _, v in evaluations):
                            evaluated.clear()
                            await evaluated.wait()
                    await seen.wait_for(lambda t, m, r, v=version: t == state_topic
                                        and m["flash"].get("lamp", {}).get("data_version") == v, timeout=10)
                assert any(event == "flash.evaluated" for event, _ in evaluations), evaluations  # kept answers
                updates = [m["data_version"] for t, m, r in seen.messages
                           if t == flash_topic and m["type"] == "flash.updated"]
                later = json.loads((await retained(broker, state_topic))[state_topic])
                assert later["flash"]["lamp"]["data_version"] == 4 >= max(updates)
                await peer.ws.close()
        finally:
            await server.stop()
            await clear_retained(broker, prefix)

    asyncio.run(main())
