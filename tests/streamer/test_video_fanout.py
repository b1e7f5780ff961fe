"""A video session on the VLM engine (tiny-vl, fp32) with everything a text session has, over a
real websocket, the real Mosquitto broker and headless Chromium: dual thinking while the frames
arrive, a flash question with an action rule on it, its commands over MQTT stamped with the
media time the answer saw, and the dashboard showing the answer, the frames and the notes."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import pytest

pytest.importorskip("av")

from browserutil import Browser  # noqa: E402
from helpers import tiny_vl_engine  # noqa: E402
from mqttutil import clear_retained  # noqa: E402
from videogen import encode_video  # noqa: E402
from wsutil import raw  # noqa: E402

from streamer.media import MediaConfig  # noqa: E402
from streamer.protocol import media_frame  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402

FRAME_TOKENS = 16
FRAMES = 12  # 6 s sampled at 2 fps


@pytest.fixture(scope="module")
def vl_engine():
    engine = tiny_vl_engine()
    yield engine
    engine.stop()


async def collect_mqtt(broker_url: str, topic: str, out: list, subscribed: asyncio.Event) -> None:
    import aiomqtt

    from streamer.mqtt import parse_url

    host, port = parse_url(broker_url)
    async with aiomqtt.Client(host, port) as client:
        await client.subscribe(topic, qos=1)
        subscribed.set()
        async for message in client.messages:
            out.append((str(message.topic).rsplit("/", 1)[-1], json.loads(message.payload)))


def test_a_video_session_thinks_fires_rules_over_mqtt_and_shows_on_the_dashboard(vl_engine, broker):
    prefix = f"t{uuid.uuid4().hex[:8]}"

    async def main():
        config = ServerConfig(port=0, mqtt_url=broker, mqtt_prefix=prefix, snapshot_interval_s=0.1,
                              media=MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=None))
        server = await StreamerServer(vl_engine, config).start()
        try:
            await asyncio.wait_for(server.mqtt.connected.wait(), 10)
            await run(f"ws://127.0.0.1:{server.port}")
        finally:
            await server.stop()
            await clear_retained(broker, prefix)

    async def run(url):
        peer = await raw(url)
        created = await peer.request({
            "type": "session.create",
            "thinking": {"mode": "dual", "unit_tokens": 6, "stop": "budget", "final_tokens": 0},
            "flash": [{"question": "What is on screen?", "flash_id": "seen", "max_tokens": 4}]})
        assert created["type"] == "session.created", created
        sid = created["session_id"]
        rule = await peer.request({"type": "action.rule", "session_id": sid, "flash_id": "seen", "pattern": ".",
                                   "command": {"action": "look"}, "rule_id": "look"})
        assert rule["type"] == "action.rule.added", rule
        messages, subscribed = [], asyncio.Event()
        listener = asyncio.create_task(collect_mqtt(broker, f"{prefix}/sessions/{sid}/+", messages, subscribed))
        await asyncio.wait_for(subscribed.wait(), 10)

        data, ts = encode_video("mp4"), time.time()
        pieces = [data[i:i + 2000] for i in range(0, len(data), 2000)]
        for k, piece in enumerate(pieces):
            header = {"session_id": sid, "kind": "video", "format": "mp4", "seq": k, "ts": ts, "live": False,
                      "end": k == len(pieces) - 1 or None}
            await peer.send(media_frame(header, piece))
        seen = {"media.observation": [], "flash.updated": [], "reasoning.done": [], "action.command": []}
        deadline = time.monotonic() + 180
        while len(seen["media.observation"]) < FRAMES or not seen["action.command"] or not seen["reasoning.done"]:
            assert time.monotonic() < deadline, {k: len(v) for k, v in seen.items()}
            event = await peer.recv(120)
            if event["type"] in seen:
                seen[event["type"]].append(event)
            else:
                # flash.stale: frames arrive faster than the flash question (taking turns with the
                # thinking) is re-evaluated, and it says so; it is current again by the end (below)
                assert event["type"] in ("input.ack", "reasoning.delta", "flash.stale"), event
        obs = seen["media.observation"]
        assert all(o["encoder"] == "engine-vl" for o in obs)
        media_at = {o["data_version"]: o["start_s"] for o in obs}

        # Dual thinking ran over the frames: each unit saw inputs that were frames.
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["frames"] == FRAMES and state["thinking"]["mode"] == "dual"
        assert state["thinking"]["units"] >= 1 and state["thinking"]["thinking_tokens"] > 0
        assert state["tokens"] == len(vl_engine.sessions[sid].context_ids())  # the reading cache holds no notes
        for unit in seen["reasoning.done"]:
            assert 1 <= unit["seq_range"][0] <= unit["seq_range"][1] <= FRAMES and unit["tokens"] > 0

        # The rule fired on the first answer, stamped with the media time that answer saw.
        answers = {(f["data_version"], f["answer"]): f["media_s"] for f in seen["flash.updated"]}
        command = seen["action.command"][0]
        assert command["rule_id"] == "look" and command["command"] == {"action": "look"}
        assert command["media_s"] == answers[(command["data_version"], command["answer"])]
        assert command["media_s"] == media_at[command["data_version"]]

        # The same commands, answers and notes reached the broker.
        async def on_mqtt():
            while not ({"commands", "flash", "reasoning"} <= {t for t, _ in messages}):
                await asyncio.sleep(0.1)

        await asyncio.wait_for(on_mqtt(), 60)
        listener.cancel()
        mqtt_command = next(m for t, m in messages if t == "commands")
        assert {k: mqtt_command[k] for k in ("rule_id", "data_version", "media_s", "answer")} == \
            {k: command[k] for k in ("rule_id", "data_version", "media_s", "answer")}
        assert all(m["media_s"] == media_at[m["data_version"]] for t, m in messages
                   if t == "flash" and m["type"] == "flash.updated")

        # The dashboard shows the video session: its frames, the answer with its media time, the
        # notes and the fired rule.
        async def evaluated_on_the_last_frame():
            while True:
                q = (await peer.request({"type": "session.get", "session_id": sid}))["session"]["flash"][0]
                if q.get("data_version") == obs[-1]["data_version"]:
                    return q
                await asyncio.sleep(0.2)

        last = await asyncio.wait_for(evaluated_on_the_last_frame(), 120)
        assert last["media_s"] == obs[-1]["start_s"]
        page_url = f"{url.replace('ws://', 'http://')}/dashboard?session={sid}&token={created['tokens']['dashboard']}"
        async with Browser() as page:
            await page.viewport(1280, 800)
            await page.navigate(page_url)
            await page.wait_for("document.getElementById('conn').textContent", want="live")
            await page.wait_for(f"document.getElementById('cache').textContent.endsWith('{FRAMES} frames')", 60)
            await page.wait_for("document.getElementById('lag').textContent.endsWith(' ms')", 30)  # capture to cache
            row = "document.querySelector('#flash tr[data-flash-id=\"seen\"]"
            version = f"v{last['data_version']} @ {last['media_s']:.1f} s"
            await page.wait_for(f"{row} .version')?.textContent", want=version)
            assert await page.eval(f"{row} .answer').textContent") == last["answer"]
            await page.wait_for("document.getElementById('reasoning').textContent.trim().length > 0", 60)
            await page.screenshot("dashboard-video.png")
        await peer.still_serving(sid)

    asyncio.run(main())
