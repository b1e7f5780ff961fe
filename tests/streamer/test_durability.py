"""Event logs, replay, resume with client seqs, snapshots: in-process servers on real sockets,
with the in-process and file stores (Redis: test_durability_redis.py)."""

import asyncio
import json

import pytest
import torch

from streamer.recovery import replay
from streamer.sessions.sampling import SamplingParams
from streamer.store import FileStore, open_store

from helpers import until
from wsutil import raw, serve

SYSTEM = "You read a ship's log and answer briefly."
CHUNKS = ["Day one: the ketch Marlin left Port Ellis at dawn with four crew. ",
          "Wind from the north-west, force four. The cook burned the porridge. ",
          "Day two: fog. We anchored off Gull Island and waited. ",
          "Day three: the fog lifted; the mate sighted a red lighthouse to the east. "]
QUESTION = "Where did the Marlin anchor?"


def check_error(event, code):
    assert event["type"] == "error", event
    assert event["error"]["code"] == code, event
    return event["error"]


async def flash_at(peer, sid, version):
    """The session's flash answers once all of them have seen data_version `version` (an
    unchanged answer is not pushed, so this reads the state)."""
    async def reached():
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        if all(q.get("data_version", -1) >= version for q in state["flash"]):
            return {q["flash_id"]: q for q in state["flash"]}
        return None

    return await until(reached, 60, f"flash answers of data_version {version}")


def same_answers(a, b):
    assert a.keys() == b.keys()
    for fid in a:
        assert (a[fid]["answer"], a[fid]["data_version"]) == (b[fid]["answer"], b[fid]["data_version"]), fid
        for k in ("logit_gap", "mean_prob"):
            assert abs(a[fid]["confidence"][k] - b[fid]["confidence"][k]) < 1e-3, (fid, k)


async def stream(peer, sid, chunks, first_seq=1):
    acks = []
    for i, text in enumerate(chunks):
        ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": text,
                                  "client_seq": first_seq + i})
        assert ack["type"] == "input.ack", ack
        acks.append(ack)
    return acks


def test_file_log_replays_to_identical_cache_and_answers(tiny_engine, tmp_path):
    """Invariant 4 through the server: appends, a revise, flash registrations (at create and
    later), an unregister and a thinking update are logged in order; replaying the log on the
    engine rebuilds the same tokens, the same KV values and the same greedy answers."""

    async def run(url, server):
        peer = await raw(url)
        sid = (await peer.request({"type": "session.create", "system_prompt": SYSTEM,
                                   "flash": [{"question": QUESTION, "max_tokens": 6}]}))["session_id"]
        await stream(peer, sid, CHUNKS[:3])
        revised = await peer.request({"type": "input.text.revise", "session_id": sid, "text": CHUNKS[3],
                                      "from_seq": 3, "client_seq": 4})
        assert revised["type"] == "input.ack" and revised["replaced_seqs"] == [3], revised
        reg = await peer.request({"type": "flash.register", "session_id": sid, "question": "Who cooked?",
                                  "max_tokens": 4})
        await peer.request({"type": "flash.register", "session_id": sid, "question": "What colour?"})
        await peer.request({"type": "flash.unregister", "session_id": sid, "flash_id": reg["flash"]["flash_id"]})
        await peer.request({"type": "session.update", "session_id": sid, "thinking": {"mode": "off"}})
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "The end.", "client_seq": 5})
        await peer.send({"type": "query.create", "session_id": sid, "question": QUESTION, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        kv = await asyncio.wrap_future(tiny_engine.call(lambda: tiny_engine.sessions[sid].cache.snapshot()))
        return sid, answer, kv

    store_dir = tmp_path / "state"
    sid, answer, kv = serve(tiny_engine, run, store_url=str(store_dir))
    records = asyncio.run(FileStore(store_dir).read_log(sid))
    assert [r["kind"] for r in records] == ["create", "append", "append", "append", "revise", "flash.register",
                                            "flash.register", "flash.unregister", "update", "append"]
    assert [r["n"] for r in records] == list(range(1, 11))
    assert [r.get("client_seq") for r in records if r["kind"] in ("append", "revise")] == [1, 2, 3, 4, 5]
    assert "tokens" in records[0] and all(len(d) == 64 for d in records[0]["tokens"].values())  # digests only

    state = asyncio.run(replay(tiny_engine, "replayed", [{**r, "session_id": "replayed"} for r in records]))
    replayed = tiny_engine.sessions["replayed"]
    assert state["last_seq"] == 5 and state["data_version"] == 5
    assert [q["flash_id"] for q in state["flash"]] == ["f1", "f3"]
    expected_ids = replayed.prefix_ids + [t for text in CHUNKS[:2] + [CHUNKS[3], "The end."]
                                          for t in replayed.tokenize(text)]
    assert replayed.context_ids() == expected_ids
    replayed_kv = tiny_engine.call(lambda: replayed.cache.snapshot()).result(10)
    assert replayed_kv.shape == kv.shape
    assert torch.allclose(replayed_kv, kv, atol=1e-5, rtol=0), (replayed_kv - kv).abs().max()
    assert tiny_engine.query("replayed", QUESTION, SamplingParams(max_tokens=8)).future.result(60).text == answer
    tiny_engine.close_session("replayed").result(10)


def test_resume_after_disconnect_dedups_client_seqs(tiny_engine):
    """A detached session keeps its input; session.resume tells the last acknowledged client
    seq; resent inputs at or below it are acknowledged as duplicates and not applied."""

    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
        sid, tokens = created["session_id"], created["tokens"]
        await stream(peer, sid, CHUNKS[:2])
        await peer.ws.close()
        await until(lambda: server.directory.sessions[sid].detached_at is not None, 5, "the session to detach")
        assert sid in tiny_engine.sessions  # detached, not closed

        other = await raw(url)
        for token in (tokens["subscriber"], tokens["dashboard"], "x" * 32):
            check_error(await other.request({"type": "session.resume", "session_id": sid, "token": token}),
                        "session_not_found")
        check_error(await other.request({"type": "input.text.append", "session_id": sid, "text": "no"}),
                    "session_not_found")
        resumed = await other.request({"type": "session.resume", "session_id": sid, "token": tokens["producer"],
                                       "last_client_seq": 1})
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["last_client_seq"] == 2 and resumed["last_seq"] == 2
        assert resumed["replayed_records"] == 0  # it was live here: nothing replayed
        dup = await other.request({"type": "input.text.append", "session_id": sid, "text": CHUNKS[1],
                                   "client_seq": 2})
        assert dup["type"] == "input.ack" and dup["duplicate"] is True and dup["client_seq"] == 2
        acks = await stream(other, sid, CHUNKS[2:], first_seq=3)
        assert [a["seq"] for a in acks] == [3, 4] and [a["client_seq"] for a in acks] == [3, 4]
        state = (await other.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["inputs"] == 4 and state["data_version"] == 4
        records = await server.store.read_log(sid)
        assert [r.get("client_seq") for r in records if r["kind"] == "append"] == [1, 2, 3, 4]
        # a second resume takes the session over: the first connection no longer produces
        third = await raw(url)
        assert (await third.request({"type": "session.resume", "session_id": sid,
                                     "token": tokens["producer"]}))["type"] == "session.resumed"
        check_error(await other.request({"type": "input.text.append", "session_id": sid, "text": "x"}),
                    "session_not_found")
        await third.request({"type": "session.close", "session_id": sid})
        assert sid not in tiny_engine.sessions
        assert (await server.store.read_log(sid))[-1]["kind"] == "close"
        check_error(await other.request({"type": "session.resume", "session_id": sid,
                                         "token": tokens["producer"]}), "session_not_found")

    serve(tiny_engine, run)


def test_detached_session_expires(tiny_engine):
    async def run(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await peer.ws.close()
        await until(lambda: sid not in tiny_engine.sessions, 10, "the detached session to expire")
        assert server.resumer.counters["detached_expired"] == 1
        assert (await server.store.read_log(sid))[-1] == {**(await server.store.read_log(sid))[-1],
                                                          "kind": "close", "reason": "expired"}

    serve(tiny_engine, run, detach_ttl_s=0.2)


def test_restart_recovers_from_file_log(tiny_engine, tmp_path):
    """A second server on the same store directory (a restart) recovers a session on resume."""
    store = str(tmp_path / "state")

    async def first(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "system_prompt": SYSTEM,
                                      "flash": [{"question": QUESTION, "max_tokens": 6}]})
        await stream(peer, created["session_id"], CHUNKS[:3])
        return created, await flash_at(peer, created["session_id"], 3)

    created, flash = serve(tiny_engine, first, store_url=store)
    sid = created["session_id"]
    assert sid not in tiny_engine.sessions  # the server stopped: its engine copies went

    async def second(url, server):
        peer = await raw(url)
        resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                      "token": created["tokens"]["producer"]})
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["replayed_records"] == 4 and resumed["last_client_seq"] == 3
        same_answers(await flash_at(peer, sid, 3), flash)
        await stream(peer, sid, CHUNKS[3:], first_seq=4)
        await peer.request({"type": "session.close", "session_id": sid})

    serve(tiny_engine, second, store_url=store)


def test_open_store_urls(tmp_path):
    from streamer.store import Store, StoreError

    assert type(open_store(None)) is Store and open_store("memory:").kind == "memory"
    assert isinstance(open_store(str(tmp_path)), FileStore)
    assert isinstance(open_store(f"file://{tmp_path}"), FileStore)
    with pytest.raises(StoreError, match="unknown store URL"):
        open_store("ftp://x")


def test_file_store_ignores_a_torn_last_line(tmp_path):
    async def run():
        store = await FileStore(tmp_path).start()
        await store.append("s", {"kind": "create"})
        await store.append("s", {"kind": "append", "text": "a"})
        await store.close()
        with open(store._path("s"), "a") as f:
            f.write('{"kind": "append", "te')  # the process died mid-write
        return await FileStore(tmp_path).read_log("s")

    records = asyncio.run(run())
    assert [r["kind"] for r in records] == ["create", "append"]


def test_metrics_report_durability(tiny_engine):
    async def run(url, server):
        import urllib.request

        peer = await raw(url)
        sid = await peer.create()
        await stream(peer, sid, CHUNKS[:1])
        await peer.request({"type": "input.text.append", "session_id": sid, "text": "x", "client_seq": 1})
        port = url.rsplit(":", 1)[1]
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read())
        return body.decode()

    text = serve(tiny_engine, run)
    for line in ('streamer_store_info{kind="memory"} 1', "streamer_log_records_total 2",
                 "streamer_duplicates_total 1", "streamer_flash_staleness_seconds ", "streamer_sessions_detached 0",
                 "streamer_queue_depth{", "streamer_step_seconds_mean "):
        assert line in text, line


def test_client_sdk_resume_resends_only_what_is_missing(tiny_engine):
    """The SDK numbers inputs; after the connection drops with inputs unacknowledged, `resume`
    resends exactly those the server did not log: here input 3 reached the log but its ack was
    lost, and input 4 never left the client, so input 4 alone is sent again."""
    from websockets.exceptions import ConnectionClosed

    from streamer.clients.client import StreamerClient

    async def run(url, server):
        client = await StreamerClient.connect(url)
        session = await client.create_session(SYSTEM)
        for text in CHUNKS[:2]:
            await session.append(text)
        client._dispatch = lambda event: None  # from here on every reply is lost on the way back
        lost_ack = asyncio.create_task(session.append(CHUNKS[2]))

        async def logged(n):
            return len([r for r in await server.store.read_log(session.id) if r["kind"] == "append"]) == n

        await until(lambda: logged(3), 60, "input 3 in the log")
        await client.ws.close()
        with pytest.raises(ConnectionError):
            await lost_ack
        with pytest.raises(ConnectionClosed):  # the connection is gone: input 4 never reaches the server
            await session.append(CHUNKS[3])
        assert sorted(session.unacked) == [3, 4]
        assert await logged(3)
        fresh = await StreamerClient.connect(url)
        sent = []
        send = fresh.ws.send

        async def spy(frame):
            sent.append(json.loads(frame))
            await send(frame)

        fresh.ws.send = spy
        resumed = await fresh.resume(session)
        resent = [m["client_seq"] for m in sent if m["type"] == "input.text.append"]
        await resumed.append("The end.")
        state = await resumed.state()
        records = await server.store.read_log(session.id)
        await fresh.close()
        return resumed.resumed["last_client_seq"], resent, state, records

    last_client_seq, resent, state, records = serve(tiny_engine, run)
    assert last_client_seq == 3  # the server had input 3, unacknowledged as it was
    assert resent == [4]
    appends = [r for r in records if r["kind"] == "append"]
    assert [r["text"] for r in appends] == CHUNKS + ["The end."]
    assert [r["client_seq"] for r in appends] == [1, 2, 3, 4, 5]
    assert state["inputs"] == 5 and state["data_version"] == 5


def test_a_session_id_with_a_log_is_not_reused(tiny_engine):
    async def run(url, server):
        peer = await raw(url)
        sid = await peer.create(session_id="fixed-id")
        assert sid == "fixed-id"  # the client's id is used
        await stream(peer, sid, CHUNKS[:1])
        await peer.request({"type": "session.close", "session_id": sid})
        again = await peer.request({"type": "session.create", "session_id": "fixed-id"})
        assert again["type"] == "error" and again["error"]["code"] == "invalid_field", again
        await until(lambda: "fixed-id" not in tiny_engine.sessions, 5, "the engine's copy to close")  # undone
        assert "fixed-id" not in server.directory.tokens
        assert [r["kind"] for r in await server.store.read_log(sid)] == ["create", "append", "close"]
        await peer.still_serving(await peer.create())

    serve(tiny_engine, run)


def test_retention_removes_closed_logs_only(tmp_path):
    async def run():
        files = await FileStore(tmp_path, retention_s=0).start()
        memory = open_store(None, retention_s=0)
        for store in (files, memory):
            for sid in ("open", "done"):
                await store.append(sid, {"kind": "create"})
            await store.append("done", {"kind": "close"})
            await store.closed("done")
            assert await store.log_length("done") == 0  # past its retention: gone
            assert [r["kind"] for r in await store.read_log("open")] == ["create"]  # live: never trimmed
        await files.close()
        kept = await FileStore(tmp_path, retention_s=3600).start()  # a restart keeps what is recent
        await kept.append("recent", {"kind": "create"})
        await kept.append("recent", {"kind": "close"})
        await kept.closed("recent")
        assert await kept.log_length("recent") == 2

    asyncio.run(run())
