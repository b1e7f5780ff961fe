"""The Redis store against a real Redis server: logs, directory, fencing, snapshots, replay."""

import asyncio
import json

import pytest

pytest.importorskip("redis")

from helpers import until, wait_until  # noqa: E402
from redisutil import answers, redis_server, redis_url  # noqa: E402,F401  (fixtures)
from wsutil import raw, serve  # noqa: E402

from streamer.redis_store import NotOwner, RedisStore  # noqa: E402
from streamer.store import WORKER_TTL_S, open_store  # noqa: E402

from test_durability import CHUNKS, QUESTION, SYSTEM, flash_at, same_answers, stream  # noqa: E402


def test_log_order_claims_and_fencing(redis_url):
    async def run():
        a = await open_store(redis_url, worker_id="wa").start()
        b = await open_store(redis_url, worker_id="wb").start()
        assert isinstance(a, RedisStore) and a.prefix.startswith("streamer-test-")
        assert await a.claim("s1") is None
        assert await b.claim("s1") == "wa"  # a is alive: b cannot take it
        # concurrent appends from many tasks keep call order and positions
        ns = await asyncio.gather(*(a.append("s1", {"kind": "append", "text": str(i)}) for i in range(50)))
        assert ns == list(range(1, 51))
        log = await b.read_log("s1")
        assert [r["text"] for r in log] == [str(i) for i in range(50)] and [r["n"] for r in log] == ns
        with pytest.raises(NotOwner):  # only the owner writes
            await b.append("s1", {"kind": "append", "text": "intruder"})
        owner = await b.owner("s1")
        assert owner == {"worker": "wa", "url": None, "alive": True}
        await a.redis.delete(a.key("worker", "wa"))  # a's heartbeat lapses: a is dead
        assert (await b.owner("s1"))["alive"] is False
        assert await b.claim("s1") is None  # adopted
        with pytest.raises(NotOwner):  # the old owner, back from the dead, is fenced off
            await a.append("s1", {"kind": "append", "text": "late"})
        assert await b.append("s1", {"kind": "append", "text": "b"}) == 51
        ttl = await a.redis.pttl(a.key("worker", "wb"))
        assert 0 < ttl <= WORKER_TTL_S * 1000
        # snapshots and the sessions list
        await b.put_snapshot("s1", {"session_id": "s1", "updated_at": 2.0})
        await b.put_snapshot("s2", {"session_id": "s2", "updated_at": 3.0})
        assert [s["session_id"] for s in await a.snapshots()] == ["s2", "s1"]
        await b.closed("s2")
        assert 0 < await b.redis.ttl(b.key("snap", "s2")) <= b.retention_s
        await b.redis.delete(b.key("snap", "s2"))  # as if the retention time had passed
        assert [s["session_id"] for s in await a.snapshots()] == ["s1"]
        await a.close()
        await b.close()

    asyncio.run(run())


def test_server_on_redis_logs_snapshots_and_recovers(tiny_engine, redis_url):
    """A server on Redis: the log and a bounded-rate snapshot land in Redis; a second server
    (a restart of the worker) recovers the session from the Redis log on resume."""

    async def first(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": SYSTEM,
                                      "flash": [{"question": QUESTION, "max_tokens": 6}]})
        sid = created["session_id"]
        await stream(peer, sid, CHUNKS[:3])
        flash = await flash_at(peer, sid, 3)
        store = server.store
        records = await store.read_log(sid)
        assert [r["kind"] for r in records] == ["create", "append", "append", "append"]
        assert (await store.owner(sid))["worker"] == store.worker_id
        async def caught_up():  # the snapshot loop catches up within a few intervals
            snap = await store.snapshot(sid)
            return snap if snap and snap["data_version"] == 3 and snap["flash"][0].get("data_version") == 3 else None

        snap = await until(caught_up, 10, "the snapshot of data_version 3")
        assert snap["owner"] == store.worker_id and snap["owner_url"] == url
        assert snap["tokens"] > 0 and snap["cache_bytes"] > 0 and snap["last_client_seq"] == 3
        assert snap["ingest_lag_ms"] is not None and snap["last_action_seq"] == 0
        assert snap["flash"][0]["answer"] == flash["f1"]["answer"] and "mean_prob" in snap["flash"][0]["confidence"]
        listed = await peer.request({"type": "sessions.list"})
        assert [s["session_id"] for s in listed["sessions"]] == [sid]
        raw_keys = await store.redis.keys(f"{store.prefix}:*")
        assert {k.split(":")[1] for k in raw_keys} >= {"log", "owner", "worker", "snap", "sessions"}
        entry = (await store.redis.xrange(store.key("log", sid)))[1][1]
        assert json.loads(entry["r"])["text"] == CHUNKS[0]  # schema'd JSON, never pickle
        return created, flash

    created, flash = serve(tiny_engine, first, store_url=redis_url, snapshot_interval_s=0.05)
    sid = created["session_id"]

    async def second(url, server):
        peer = await raw(url)
        resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                      "token": created["tokens"]["producer"]})
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["replayed_records"] == 4 and resumed["last_client_seq"] == 3
        same_answers(await flash_at(peer, sid, 3), flash)
        await peer.request({"type": "session.close", "session_id": sid})
        assert (await server.store.read_log(sid))[-1]["kind"] == "close"
        assert 0 < await server.store.redis.ttl(server.store.key("log", sid)) <= server.store.retention_s

    serve(tiny_engine, second, store_url=redis_url)


def test_redis_going_away_costs_acks_not_the_server(tiny_engine, tmp_path):
    """A private Redis that dies mid-session: inputs get `store_unavailable` (not applied, not
    acknowledged: the client resends them), reads keep working, and the server stops cleanly."""
    import shutil
    import socket
    import subprocess

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("needs redis-server (Debian package redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def run(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await stream(peer, sid, CHUNKS[:1])
        proc.kill()
        proc.wait(10)
        failed = await peer.request({"type": "input.text.append", "session_id": sid, "text": CHUNKS[1],
                                     "client_seq": 2})
        assert failed["type"] == "error" and failed["error"]["code"] == "store_unavailable", failed
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["inputs"] == 1  # not applied: nothing the log lacks is in the session
        assert server.events.counters["log_errors"] == 1

    try:
        wait_until(lambda: answers(port), 5, "the private redis-server")
        serve(tiny_engine, run, store_url=f"redis://127.0.0.1:{port}/0")
    finally:
        proc.kill()
        proc.wait(10)


def test_a_cut_off_rewrite_of_a_lost_log_is_finished(tiny_engine, redis_url):
    """Redis came back empty and the worker's re-write of the log was cut off by the next fault
    (simulated: the stream loses its last records while the owner entry stays): the next write
    finds the gap, writes the missing records from memory and then its own; nothing is lost and a
    second worker replays the whole log."""

    async def first(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
        sid = created["session_id"]
        await stream(peer, sid, CHUNKS[:3])
        store = server.store
        key = store.key("log", sid)
        entries = await store.redis.xrange(key)
        await store.redis.delete(key)  # a re-write that stopped after two records
        for entry_id, fields in entries[:2]:
            await store.redis.xadd(key, fields, id=entry_id)
        assert len(await store.read_log(sid)) == 2
        ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": CHUNKS[3], "client_seq": 4})
        assert ack["type"] == "input.ack" and ack["seq"] == 4, ack
        records = await store.read_log(sid)
        assert [r["kind"] for r in records] == ["create"] + ["append"] * 4
        assert [r["text"] for r in records[1:]] == CHUNKS[:4]
        return created

    created = serve(tiny_engine, first, store_url=redis_url)

    async def second(url, server):
        peer = await raw(url)
        resumed = await peer.request({"type": "session.resume", "session_id": created["session_id"],
                                      "token": created["tokens"]["producer"]})
        assert resumed["type"] == "session.resumed" and resumed["last_client_seq"] == 4, resumed
        assert resumed["replayed_records"] == 5

    serve(tiny_engine, second, store_url=redis_url)
