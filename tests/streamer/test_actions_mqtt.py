"""Actions end to end with the real Mosquitto broker: chunks over MQTT, rules, robot state,
and a broker that is slow or gone never blocks a session."""

import asyncio
import json
import socket
import time
import uuid

from helpers import until
from mqttutil import clear_retained
from wsutil import check_error, next_of, raw

from streamer.server import ServerConfig, StreamerServer
from streamer.sessions.actions import fire_rules
from streamer.sessions.flash import FlashAnswer


def serve_mqtt(engine, broker_url, test, prefix=None):
    prefix = prefix or f"t{uuid.uuid4().hex[:8]}"

    async def main():
        server = await StreamerServer(engine, ServerConfig(port=0, mqtt_url=broker_url, mqtt_prefix=prefix)).start()
        try:
            await asyncio.wait_for(server.mqtt.connected.wait(), 10)
            return await test(f"ws://127.0.0.1:{server.port}", server, prefix)
        finally:
            await server.stop()
            await clear_retained(broker_url, prefix)

    return asyncio.run(main())


async def mqtt_messages(broker_url, topic, count, timeout=30, after=None):
    import aiomqtt

    from streamer.mqtt import parse_url

    host, port = parse_url(broker_url)
    out = []
    async with aiomqtt.Client(host, port) as client:
        await client.subscribe(topic, qos=1)
        if after is not None:
            await after()
        async with asyncio.timeout(timeout):
            async for message in client.messages:
                out.append((str(message.topic), json.loads(message.payload)))
                if len(out) >= count:
                    return out
    return out


def test_action_chunks_reach_an_mqtt_subscriber_in_order(tiny_engine, broker):
    async def test(url, server, prefix):
        peer = await raw(url)
        sid = await peer.create()
        await peer.request({"type": "input.text.append", "session_id": sid, "text": '{"target": [1.0, 0.5]}'})

        async def start():
            started = await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 20, "horizon": 5,
                                          "latency_ms": [10, 30], "mode": "async_rollforward"})
            assert started["type"] == "action.started" and started["actions"]["running"]

        messages = await mqtt_messages(broker, f"{prefix}/sessions/{sid}/actions", 6, after=start)
        chunks = [m for _, m in messages]
        assert [c["seq"] for c in chunks] == list(range(chunks[0]["seq"], chunks[0]["seq"] + 6))
        assert all(c["type"] == "action.chunk" and c["session_id"] == sid and c["dt"] == 0.02 for c in chunks)
        assert all(b["t0"] >= a["t0"] for a, b in zip(chunks, chunks[1:]))
        assert all(c["obs_ts"] <= c["t0"] + 0.05 and c["inference_ms"] >= 10 for c in chunks)
        assert all(len(c["actions"]) >= 1 and len(c["actions"][0]) == 2 for c in chunks)
        ws_chunk = await next_of(peer, "action.chunk")  # the producer's websocket gets them too
        assert ws_chunk["session_id"] == sid
        stopped = await next_of_reply(peer, {"type": "action.stop", "session_id": sid}, "action.stopped")
        assert stopped["last_seq"] >= chunks[-1]["seq"]

    serve_mqtt(tiny_engine, broker, test)


async def next_of_reply(peer, msg, kind):
    await peer.send(msg)
    return await next_of(peer, kind)


def test_rule_fires_exactly_once_per_answer_change(tiny_engine, broker):
    async def test(url, server, prefix):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "flash": [
            {"question": "Is a person in front of the robot?", "flash_id": "person"}]})
        sid = created["session_id"]
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "The hall is empty."})
        await next_of(peer, "flash.updated")  # first evaluated after the first input
        rule = await peer.request({"type": "action.rule", "session_id": sid, "flash_id": "person",
                                   "pattern": "^yes", "command": {"action": "stop"}, "rule_id": "halt"})
        assert rule["type"] == "action.rule.added"
        check_error(await peer.request({"type": "action.rule", "session_id": sid, "flash_id": "nope",
                                        "pattern": "x", "command": {}}), "flash_not_found")
        check_error(await peer.request({"type": "action.rule", "session_id": sid, "flash_id": "person",
                                        "pattern": "(", "command": {}}), "invalid_field")
        session = tiny_engine.sessions[sid]

        def answer(text, version):
            return FlashAnswer(text, [1], version, 1.0, 0.9, 0.01, time.time(), "stop")

        async def push_answers():
            for version, text in enumerate(["No.", "Yes, a person.", "Yes, still.", "No.", "Yes!"], start=10):
                tiny_engine.call(lambda t=text, v=version: fire_rules(session, "person", answer(t, v)))
            await asyncio.sleep(0)

        commands = await mqtt_messages(broker, f"{prefix}/sessions/{sid}/commands", 2, after=push_answers)
        assert [c["answer"] for _, c in commands] == ["Yes, a person.", "Yes!"]
        assert all(c["command"] == {"action": "stop"} and c["rule_id"] == "halt" for _, c in commands)
        assert session.actions.rules["halt"].fired == 2  # fired on the engine thread before the commands went out

    serve_mqtt(tiny_engine, broker, test)


def test_malformed_robot_state_is_refused_and_ignored(tiny_engine, broker):
    async def test(url, server, prefix):
        import aiomqtt

        from streamer.mqtt import parse_url

        peer = await raw(url)
        sid = await peer.create()
        await peer.request({"type": "input.text.append", "session_id": sid, "text": '{"target": [0.0, 1.0]}'})
        await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 20, "horizon": 4})
        # over the websocket: wrong length, and a type error caught by the protocol
        check_error(await peer.request({"type": "robot.state", "session_id": sid, "state": [1.0, 2.0, 3.0]}),
                    "invalid_robot_state")
        check_error(await peer.request({"type": "robot.state", "session_id": sid, "state": ["x"]}), "invalid_field")
        await peer.send({"type": "robot.state", "session_id": sid, "state": [0.1, 0.2]})  # fine: no reply
        host, port = parse_url(broker)
        state_topic = f"{prefix}/sessions/{sid}/robot_state"

        async def send_bad():
            async with aiomqtt.Client(host, port) as client:
                await client.publish(state_topic, b"{not json", qos=1)
                await client.publish(state_topic, json.dumps({"state": [1, 2, 3, 4]}), qos=1)
                await client.publish(state_topic, json.dumps({"state": [0.5, 0.5], "ts": time.time()}), qos=1)

        errors = await mqtt_messages(broker, f"{prefix}/sessions/{sid}/errors", 2, after=send_bad)
        assert [e["error"]["code"] for _, e in errors] == ["invalid_robot_state", "invalid_robot_state"]
        assert "not JSON" in errors[0][1]["error"]["message"] and "2 finite numbers" in errors[1][1]["error"]["message"]
        loop = tiny_engine.sessions[sid].actions.loop
        await until(lambda: loop.state.tolist() == [0.5, 0.5], 5, "the good state")  # the bad ones changed nothing
        before = loop.controller.seq
        await until(lambda: loop.controller.seq > before, 5, "more chunks")  # and the policy keeps going
        await peer.still_serving(sid)

    serve_mqtt(tiny_engine, broker, test)


def test_a_missing_broker_never_blocks_sessions(tiny_engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens here once the socket closes

    async def main():
        server = await StreamerServer(tiny_engine, ServerConfig(port=0, mqtt_url=f"mqtt://127.0.0.1:{dead}")).start()
        server.mqtt.max_queue = 20
        try:
            peer = await raw(f"ws://127.0.0.1:{server.port}")
            sid = await peer.create()
            await peer.request({"type": "input.text.append", "session_id": sid, "text": '{"target": [1, 1]}'})
            await peer.request({"type": "action.start", "session_id": sid, "dt_ms": 5, "horizon": 2})
            for _ in range(3):
                await peer.still_serving(sid)
            await until(lambda: server.mqtt.dropped > 0, 10, "chunks dropped for the dead broker")
            assert not server.mqtt.connected.is_set()
            assert server.mqtt.dropped > 0 and server.mqtt._queue.qsize() <= 20  # bounded, oldest dropped
        finally:
            await server.stop()

    asyncio.run(main())


def test_robot_controller_example_tracks_the_target(tiny_engine, broker):
    """The example robot client end to end: websocket session, MQTT chunks, state back on MQTT."""
    import argparse

    from streamer.clients.robot import run_robot

    async def test(url, server, prefix):
        args = argparse.Namespace(url=url, mqtt=broker, prefix=prefix, seconds=3.0, dt_ms=50,
                                  mode="async_rollforward", latency_ms=[20, 60], report_every=1.0)
        return await run_robot(args)

    result = serve_mqtt(tiny_engine, broker, test)
    assert result["chunks"] >= 5
    assert result["seqs"] == sorted(result["seqs"]) and len(set(result["seqs"])) == len(result["seqs"])
    assert result["mean_error"] < 1.5  # it follows (the target circles at radius 1; the robot starts at 0)


def test_robot_command_reports_session_target_and_error_over_time(tiny_engine, broker):
    """`streamer client robot` as a user runs it: which session and target, what the error
    means, a line per report period, and a summary against a robot that never moved."""
    import re
    import subprocess
    import sys

    from servers import ThreadedServer

    prefix = f"t{uuid.uuid4().hex[:8]}"
    with ThreadedServer(tiny_engine, mqtt_url=broker, mqtt_prefix=prefix) as server:
        server.call(asyncio.wait_for(server.server.mqtt.connected.wait(), 10))
        done = subprocess.run([sys.executable, "-m", "streamer", "client", "robot", "--url", server.url, "--mqtt",
                               broker, "--prefix", prefix, "--seconds", "2.5", "--report-every", "0.5",
                               "--latency-ms", "20", "60"], capture_output=True, text=True, timeout=120, check=False)
    asyncio.run(clear_retained(broker, prefix))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    sid = re.match(r"^session ([0-9a-f]+): a simulated robot follows the target with the session's "
                   r"'async_rollforward' policy", lines[0])
    assert sid and f"{prefix}/sessions/{sid.group(1)}/actions" in lines[0], lines[0]
    assert lines[1].startswith("target: a circle of radius 1") and lines[2].startswith("tracking error = distance")
    rows = [line for line in lines if re.match(r"^\s+\d+\.\ds\s+\(.+\)\s+\(.+\)\s+\d+\.\d{3}\s+\d+$", line)]
    assert len(rows) >= 3, done.stdout  # the error over time
    summary = re.match(r"^(\d+) action chunks \(seq \d+\.\.\d+\); tracking error mean (\d\.\d+), 95th percentile "
                       r"\d\.\d+, last \d\.\d+; a robot standing still would average (\d\.\d+) here, so (\d\.\d+) of "
                       r"that: (tracking well|following, loosely|not following) \(good: under", lines[-1])
    assert summary, lines[-1]
    assert int(summary.group(1)) >= 5 and float(summary.group(3)) > 0.5
