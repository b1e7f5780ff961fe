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
    """A short grace: an idle connection is closed with 1001, and of 8 questions queued on one
    session each one gets a final event before the close, its `query.done` or a `shutting_down`
    error naming it; none is cut silently."""
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
            events = [first]
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    events.append(await peer.recv(timeout=60))
            assert info.value.rcvd is not None and info.value.rcvd.code == 1001
            final = {e["reply_to"]: e for e in events if e.get("reply_to") in asked
                     and e["type"] in ("query.done", "error")}
            assert sorted(final) == asked, events[-5:]
            cut = [e for e in final.values() if e["type"] == "error"]
            assert cut and all(e["error"]["code"] == "shutting_down" for e in cut)  # 8 x 200 tokens outlast 1 s
            with pytest.raises(ConnectionClosed) as idle_closed:
                await idle.recv(timeout=30)
            assert idle_closed.value.rcvd is not None and idle_closed.value.rcvd.code == 1001

        asyncio.run(scenario())
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + out
        assert "shut down: 2 connections closed" in out
    finally:
        if proc.poll() is None:
            proc.kill()
