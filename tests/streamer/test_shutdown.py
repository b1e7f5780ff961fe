"""Graceful shutdown of a real `streamer serve` process: SIGTERM mid-question lets the question
finish and its answer arrive, then every connection is closed with 1001 and the process exits 0."""

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from websockets.exceptions import ConnectionClosed

from wsutil import raw

pytestmark = pytest.mark.embedded


def start_server(*extra):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "streamer", "serve", "--port", "0", "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 180
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on ws://[\d.]+:(\d+)", line)
        if m:
            return proc, f"ws://127.0.0.1:{m.group(1)}", lines
    proc.kill()
    raise AssertionError("server did not start:\n" + "".join(lines))


def test_sigterm_finishes_in_flight_work_then_closes_1001(embedded):
    proc, url, lines = start_server("--limit", "shutdown_grace_s=60")
    try:
        async def scenario():
            peer = await raw(url)
            sid = await peer.create()
            ack = await peer.request({"type": "input.text.append", "session_id": sid,
                                      "text": "The keeper logged a storm at dawn and a calm sea by noon."})
            assert ack["type"] == "input.ack"
            await peer.send({"type": "query.create", "session_id": sid, "event_id": "q",
                             "question": "Write a long story about the keeper.", "max_tokens": 48})
            first = await peer.recv(timeout=60)  # the question is running
            assert first["type"] in ("query.delta", "query.done"), first
            proc.send_signal(signal.SIGTERM)
            events = [first]
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    events.append(await peer.recv(timeout=60))
            done = [e for e in events if e["type"] == "query.done"]
            assert len(done) == 1 and done[0]["finish_reason"] == "length" and done[0]["tokens"] == 48
            assert info.value.rcvd is not None and info.value.rcvd.code == 1001
            with pytest.raises(OSError):  # no longer accepting
                await raw(url)

        asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert "shut down: 1 connections closed" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_sigterm_closes_idle_connections_and_ends_every_queued_answer(embedded):
    """A short grace: an idle connection is closed with 1001 at once, and of 8 questions queued on
    one session each one gets its `query.done` before the close; those still running or queued
    when the grace ends say `finish_reason: "shutdown"` and carry the text streamed so far."""
    proc, url, lines = start_server("--limit", "shutdown_grace_s=1")
    try:
        async def scenario():
            idle = await raw(url)
            peer = await raw(url)
            sid = await peer.create()
            ack = await peer.request({"type": "input.text.append", "session_id": sid,
                                      "text": "The keeper logged a storm at dawn and a calm sea by noon."})
            assert ack["type"] == "input.ack"
            asked = [f"q{i}" for i in range(8)]
            for qid in asked:
                await peer.send({"type": "query.create", "session_id": sid, "event_id": qid, "query_id": qid,
                                 "question": "Write a long story about the keeper.", "max_tokens": 200})
            first = await peer.recv(timeout=60)  # the questions are running
            proc.send_signal(signal.SIGTERM)
            events, arrived = [first], [time.monotonic()]

            async def idle_close() -> float:
                with pytest.raises(ConnectionClosed) as idle_closed:
                    await idle.recv(timeout=30)
                assert idle_closed.value.rcvd is not None and idle_closed.value.rcvd.code == 1001
                return time.monotonic()

            async def read_all() -> None:
                with pytest.raises(ConnectionClosed) as info:
                    while True:
                        events.append(await peer.recv(timeout=60))
                        arrived.append(time.monotonic())
                assert info.value.rcvd is not None and info.value.rcvd.code == 1001

            idle_closed_at, _ = await asyncio.gather(idle_close(), read_all())
            final = {e["reply_to"]: e for e in events if e.get("reply_to") in asked
                     and e["type"] in ("query.done", "error")}
            assert sorted(final) == asked, events[-5:]
            assert all(e["type"] == "query.done" for e in final.values()), [e for e in final.values()
                                                                           if e["type"] != "query.done"]
            cut = [e for e in final.values() if e["finish_reason"] == "shutdown"]
            assert cut, [e["finish_reason"] for e in final.values()]  # 8 x 200 tokens outlast 1 s
            # the idle connection closed at once, before the grace period (1 s) ended the answers
            assert idle_closed_at < min(t for e, t in zip(events, arrived) if e in cut)
            for e in cut:  # what was streamed before the cut is the answer's text
                streamed = "".join(d["delta"] for d in events if d["type"] == "query.delta"
                                   and d["query_id"] == e["query_id"])
                assert e["text"] == streamed and e["tokens"] <= 200

        asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert "shut down: 2 connections closed" in out and "answers ended early" in out
    finally:
        if proc.poll() is None:
            proc.kill()
