"""Drain: SIGTERM on a worker hands its sessions over with their KV cache.

Two real worker processes share a Redis. A session lives on worker A; A gets SIGTERM; its
client is told (`server.draining`), A hands the session's cache over through the store and
exits within its grace period; the client resumes on worker B, which imports the cache instead
of replaying the log (`reprefill_tokens` 0), and answers as an uninterrupted session does.
In-process: while draining, `/healthz` answers 503 and new sessions are refused (`draining`).
"""

import asyncio
import json
import re
import signal
import urllib.request

import pytest
from procutil import ServerProcess
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)
from wsutil import raw
from test_durability_procs import CHUNKS, FLASH, SYSTEM, ask, flash_at
from websockets.exceptions import ConnectionClosed

from streamer.drain import drain, handoff_address
from streamer.server import ServerConfig, StreamerServer
from streamer.store import FileStore, open_store

pytestmark = pytest.mark.embedded

GRACE_S = 30


def http(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as reply:
        return reply.code, json.loads(reply.read())


async def fed(url, chunks):
    """A session on `url` that has read `chunks` (acknowledged, flash answers current)."""
    peer = await raw(url)
    created = await peer.request({"type": "session.create", "system_prompt": SYSTEM, "flash": FLASH})
    sid = created["session_id"]
    for i, text in enumerate(chunks, 1):
        ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": text, "client_seq": i})
        assert ack["type"] == "input.ack", ack
    await flash_at(peer, sid, len(chunks))
    return peer, created


async def closed_by(peer) -> int:
    """Read until the server closes the connection; its close code."""
    try:
        while True:
            event = await peer.recv(GRACE_S + 10)
            assert event["type"] != "error", event  # a drain shows the client no error
    except ConnectionClosed as exc:
        return exc.rcvd.code


def test_sigterm_hands_the_session_to_the_other_worker_with_its_kv(redis_url):
    half = len(CHUNKS) // 2

    async def run():
        with ServerProcess("--store", redis_url, "--worker-id", "wa", "--limit", f"shutdown_grace_s={GRACE_S}") as a, \
                ServerProcess("--store", redis_url, "--worker-id", "wb") as b:
            peer, created = await fed(a.url, CHUNKS[:half])
            sid = created["session_id"]
            a.proc.send_signal(signal.SIGTERM)
            notice = (await peer.until("server.draining"))[-1]
            assert 0 < notice["deadline_s"] <= GRACE_S and notice["sessions"] == [sid] and notice["worker"] == "wa"
            assert await closed_by(peer) == 1001
            assert a.proc.wait(GRACE_S + 10) == 0  # exited within its grace period
            assert any("1 sessions handed over" in line for line in a.output), a.output[-20:]
            # a serving process freezes its started heap (full collections walk only what came since)
            assert any(re.search(r"garbage collector: [1-9]\d{4,} objects of the started server frozen", line)
                       for line in a.output), a.output[:20]

            moved = await raw(b.url)
            resumed = await moved.request({"type": "session.resume", "session_id": sid,
                                           "token": created["tokens"]["producer"]})
            assert resumed["type"] == "session.resumed", resumed
            assert resumed["reprefill_tokens"] == 0 and resumed["worker"] == "wb"
            assert resumed["last_client_seq"] == half and resumed["session"]["inputs"] == half
            for i, text in enumerate(CHUNKS[half:], half + 1):
                ack = await moved.request({"type": "input.text.append", "session_id": sid, "text": text,
                                           "client_seq": i})
                assert ack["type"] == "input.ack" and ack["seq"] == i, ack
            got = (await flash_at(moved, sid, len(CHUNKS)), await ask(moved, sid))

            ref = await moved.create(system_prompt=SYSTEM, flash=FLASH)  # the control: never moved
            for text in CHUNKS:
                assert (await moved.request({"type": "input.text.append", "session_id": ref,
                                             "text": text}))["type"] == "input.ack"
            want = (await flash_at(moved, ref, len(CHUNKS)), await ask(moved, ref))
            metrics = urllib.request.urlopen(b.url.replace("ws://", "http://") + "/metrics", timeout=10).read().decode()
            store = await open_store(redis_url, worker_id="reader").start()
            owner = await store.owner(sid)
            blobs = [k async for k in store.redis.scan_iter(store.key("blob", "*"))]
            await store.redis.aclose()
            return got, want, metrics, owner, blobs

    got, want, metrics, owner, blobs = asyncio.run(run())
    assert blobs == []  # the handoff blob was deleted once imported
    assert got == want
    assert "streamer_handoffs_imported_total 1" in metrics and "streamer_handoff_fallbacks_total 0" in metrics
    assert owner["worker"] == "wb"


def test_draining_refuses_new_sessions_and_answers_503(tmp_path, tiny_engine):
    """In process, step by step: the gates while draining, then the drain itself (file store)."""
    async def run():
        server = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=f"file://{tmp_path}",
                                                           shutdown_grace_s=GRACE_S)).start()
        base = f"http://127.0.0.1:{server.port}"
        try:
            peer, created = await fed(f"ws://127.0.0.1:{server.port}", CHUNKS[:2])
            sid = created["session_id"]
            assert (await asyncio.to_thread(http, base + "/healthz"))[0] == 200
            server.draining = server.resumer.draining = "rolling upgrade"
            status, body = await asyncio.to_thread(http, base + "/healthz")
            assert status == 503 and body["status"] == "draining" and body["reason"] == "rolling upgrade"
            refused = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
            assert refused["type"] == "error" and refused["error"]["code"] == "draining", refused
            assert refused["error"]["recoverable"] is True
            elsewhere = await peer.request({"type": "session.resume", "session_id": "not-here", "token": "x"})
            assert elsewhere["error"]["code"] == "draining", elsewhere
            assert (await peer.request({"type": "input.text.append", "session_id": sid,
                                        "text": CHUNKS[2]}))["type"] == "input.ack"  # its own sessions still work

            done = await drain(server, reason="rolling upgrade")
            assert done["handed_off"] == 1 and done["not_handed_off"] == 0
            events = []
            with pytest.raises(ConnectionClosed):
                while True:
                    events.append(await peer.recv(5))
            kinds = [e["type"] for e in events]  # flash answers of the last input may come first
            assert kinds.count("server.draining") == 1 and "error" not in kinds, events
            assert server.handoffs["handoffs_exported"] == 1 and server.handoffs["handoff_bytes"] > 0
            store = await open_store(f"file://{tmp_path}").start()
            raw = await store.read_log(sid)
            assert len(raw) == 1 + 3 and await store.get_blob(handoff_address(sid, raw)) is not None
            assert await store.get_blob(handoff_address(sid, raw[:-1])) is None
            assert await store.owner(sid) is None  # released: the next worker may claim it
        finally:
            await server.stop()
        return created

    created = asyncio.run(run())
    resumed, handoffs = asyncio.run(resume_on(other_model(tiny_engine), tmp_path, created))
    # the blob is for the weights it was made with: this worker replays the log instead
    assert resumed["type"] == "session.resumed", resumed
    assert resumed["reprefill_tokens"] > 0 and resumed["session"]["inputs"] == 3
    assert handoffs["handoff_fallbacks"] == 1 and handoffs["handoffs_imported"] == 0
    raw_log = asyncio.run(FileStore(tmp_path).read_log(created["session_id"]))
    assert not list((tmp_path / "blobs").iterdir()) and raw_log[-1]["kind"] == "append"  # no blob left


def other_model(tiny_engine):
    """An engine on the same tiny architecture and model name with other weights (as after an
    upgrade that changed the weights under the same name): the blob's prefix check refuses it."""
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    tokenizer = tiny_engine.runner.tokenizer
    lm = build_tiny_model(tokenizer, seed=8)
    runner = ModelRunner(lm.model, tokenizer, tiny_engine.runner.name)
    return Engine(runner, EngineLimits(max_context_tokens=400)).start()


async def resume_on(engine, tmp_path, created):
    server = await StreamerServer(engine, ServerConfig(port=0, store_url=f"file://{tmp_path}")).start()
    try:
        peer = await raw(f"ws://127.0.0.1:{server.port}")
        resumed = await peer.request({"type": "session.resume", "session_id": created["session_id"],
                                      "token": created["tokens"]["producer"]})
        return resumed, dict(server.handoffs)
    finally:
        await server.stop()
        engine.stop()
