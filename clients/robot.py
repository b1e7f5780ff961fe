"""A robot-controller example: a simulated planar point mass follows a moving target.

It creates a session over the websocket, starts the session's action policy, streams what its
"camera" sees (the target position, as JSON observations; each revises the previous one, so
the session's context stays bounded) into the session, executes the
action chunks it receives over MQTT on the simulated robot, and publishes its state back on
MQTT. At the end it prints the tracking error.

    streamer client robot --url ws://127.0.0.1:8765 --mqtt mqtt://127.0.0.1:1883 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import numpy as np

from streamer.protocol import command
from streamer.sessions.actions import ChunkQueue

from .client import StreamerClient


def target_at(t: float) -> np.ndarray:
    """The target: a slow circle with a jump every 3 s (something to react to)."""
    jump = 0.5 * (int(t // 3) % 2)
    return np.array([math.cos(0.5 * t) + jump, math.sin(0.5 * t)])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="ws://127.0.0.1:8765")
    parser.add_argument("--mqtt", default="mqtt://127.0.0.1:1883", help="the broker the service publishes to")
    parser.add_argument("--prefix", default="streamer", help="MQTT topic prefix of the service")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--dt-ms", type=int, default=50)
    parser.add_argument("--mode", default="async_rollforward", choices=["sync", "async", "async_rollforward"])
    parser.add_argument("--latency-ms", type=int, nargs=2, default=[100, 300], metavar=("MIN", "MAX"),
                        help="simulated policy inference time (default: 100 300)")


async def run_robot(args: argparse.Namespace) -> dict:
    import aiomqtt

    from streamer.mqtt import parse_url

    dt = args.dt_ms / 1000
    host, port = parse_url(args.mqtt)
    async with await StreamerClient.connect(args.url) as client:
        session = await client.create_session()
        actions_topic = f"{args.prefix}/sessions/{session.id}/actions"
        state_topic = f"{args.prefix}/sessions/{session.id}/robot_state"
        async with aiomqtt.Client(host, port) as mqtt:
            await mqtt.subscribe(actions_topic, qos=1)
            await session.append(json.dumps({"target": target_at(0).tolist()}))
            await client.request(command("action.start", session_id=session.id, mode=args.mode, dt_ms=args.dt_ms,
                                         latency_ms=list(args.latency_ms)))
            queue = ChunkQueue(dt, blend=0)
            position = np.zeros(2)
            chunks, errors = [], []

            async def receive() -> None:
                async for message in mqtt.messages:
                    chunk = json.loads(message.payload)
                    chunks.append(chunk)
                    queue.integrate(np.asarray(chunk["actions"]), chunk["t0"])

            receiver = asyncio.get_running_loop().create_task(receive())
            started = time.time()
            next_obs = started
            try:
                while (now := time.time()) - started < args.seconds:
                    action = queue.action_at(now)
                    if action is not None:
                        position = position + action * dt
                    target = target_at(now - started)
                    errors.append(float(np.linalg.norm(target - position)))
                    await mqtt.publish(state_topic, json.dumps({"state": position.tolist(), "ts": now}), qos=1)
                    if now >= next_obs:  # the camera: 10 observations a second, each replacing the
                        # last one (revise), so the session holds the current view, not a growing log
                        await session.revise(json.dumps({"target": [round(v, 4) for v in target.tolist()]}))
                        next_obs += 0.1
                    await asyncio.sleep(max(0.0, dt - (time.time() - now)))
            finally:
                receiver.cancel()
            await client.request(command("action.stop", session_id=session.id))
            await session.close()
    return {"chunks": len(chunks), "mean_error": float(np.mean(errors)) if errors else float("nan"),
            "seqs": [c["seq"] for c in chunks]}


def run(args: argparse.Namespace) -> int:
    result = asyncio.run(run_robot(args))
    print(f"received {result['chunks']} action chunks; mean tracking error {result['mean_error']:.3f}")
    return 0
