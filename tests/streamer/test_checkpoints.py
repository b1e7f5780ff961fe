"""Checkpoints in the event log: replay from the last checkpoint equals the live session (same
K/V, same answers) for a text and a dual-thinking session; the log and blobs of a live session
stay bounded; a blob a log names never expires, one no log names does (memory, file, Redis)."""

import asyncio
import hashlib

import pytest
import torch

from streamer.recovery import replay, restore
from streamer.sessions.checkpoint import CheckpointError, pack, unpack
from streamer.sessions.sampling import SamplingParams
from streamer.store import FileStore, Store

from helpers import until
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)
from wsutil import raw, serve

ROWS = [f"{i:05d},station-{i % 4},{(i * 7) % 31 - 5}.5,{i % 50}\n" for i in range(160)]
QUESTION = "Which station is the coldest?"
WINDOW = {"max_tokens": 300, "keep_tokens": 200}


async def settled_flash(peer, sid):
    """The session's flash answers once every one has seen the current data_version."""
    async def reached():
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        stuck = [q for q in state["flash"] if q.get("stale") in ("no_room", "failed")]
        assert not stuck, f"flash questions that will not be answered: {stuck}"
        if all(q.get("data_version", -1) >= state["data_version"] for q in state["flash"]):
            return {q["flash_id"]: q.get("answer") for q in state["flash"]}
        return None

    return await until(reached, 240, "flash answers of the current data_version")


def snapshot(engine, sid):
    return engine.call(lambda: engine.sessions[sid].cache.snapshot()).result(10)


def test_text_session_replays_from_its_last_checkpoint(tiny_engine, tmp_path):
    """160 rows through a 300-token window with checkpoints every 20 records (and after slides
    past 4): the log keeps its creation, the last checkpoint and the records after it, the blob
    directory the last checkpoint's K/V only; replay (creation, checkpoint, tail) rebuilds the
    same K/V, seqs, window counters, flash answer and greedy answer."""
    sizes = []

    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "window": WINDOW,
                                      "flash": [{"question": QUESTION, "max_tokens": 6}]})
        sid = created["session_id"]
        for i, row in enumerate(ROWS):
            ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": row,
                                      "client_seq": i + 1})
            assert ack["type"] == "input.ack", ack
            if (i + 1) % 40 == 0:
                await until(lambda: _idle(server, sid), 60, "the checkpoint task")
                log = await server.store.read_log(sid)
                blobs = list((tmp_path / "state" / "blobs").iterdir())
                sizes.append((len(log), (tmp_path / "state" / "logs").stat().st_size, len(blobs)))
        flash = await settled_flash(peer, sid)
        await peer.send({"type": "query.create", "session_id": sid, "question": QUESTION, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        return sid, answer, flash, state, snapshot(tiny_engine, sid), server.events.counters["checkpoints"]

    store_dir = tmp_path / "state"
    sid, answer, flash, live, kv, checkpoints = serve(tiny_engine, run, store_url=str(store_dir),
                                                     checkpoint_records=20, checkpoint_min_records=4)
    assert checkpoints >= 160 // 20
    # bounded: at most the creation + 20 records + a checkpoint, and one K/V blob, at every point
    assert all(n <= 22 and blobs == 1 for n, _, blobs in sizes), sizes
    records = asyncio.run(FileStore(store_dir).read_log(sid))
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "create" and "checkpoint" in kinds and kinds.count("checkpoint") == 1, kinds
    assert records[1]["kind"] == "checkpoint" and records[1]["n"] > 2  # the records before it are gone

    store = asyncio.run(FileStore(store_dir).start())
    state = asyncio.run(replay(tiny_engine, "replayed", [{**r, "session_id": "replayed"} for r in records], store))
    for key in ("last_seq", "data_version", "tokens", "next_position", "inputs"):
        assert state[key] == live[key], key
    assert state["window"]["dropped_inputs"] == live["window"]["dropped_inputs"]
    replayed_kv = snapshot(tiny_engine, "replayed")
    assert replayed_kv.shape == kv.shape
    assert torch.allclose(replayed_kv, kv, atol=1e-5, rtol=0), (replayed_kv - kv).abs().max()
    assert tiny_engine.query("replayed", QUESTION, SamplingParams(max_tokens=8)).future.result(60).text == answer
    replayed_flash = _flash_answers(tiny_engine, "replayed")
    assert replayed_flash == flash and all(flash.values())
    tiny_engine.close_session("replayed").result(10)


def _idle(server, sid):
    pipe = server.events.pipes.get(sid)
    return pipe is not None and (pipe.checkpointing is None or pipe.checkpointing.done())


def _flash_answers(engine, sid):
    """The flash answers once every question has seen the session's data (run on demand)."""
    def read():
        s = engine.sessions[sid]
        if any(q.evaluated_version < s.data_version for q in s.flash.questions.values()):
            return None
        return {fid: q.answer.text if q.answer else None for fid, q in s.flash.questions.items()}

    async def poll():
        return await until(lambda: engine.call(read).result(10), 60, "flash answers on the replayed session")

    return asyncio.run(poll())


def test_dual_thinking_session_restores_its_notes(tiny_engine, tmp_path):
    """A dual session: once its notes are written, a checkpoint holds the reading and thinking
    caches, the notes and the flash answers; restoring it gives the same bits and the same
    answer to a question (which reads the notes)."""

    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "window": WINDOW,
                                      "thinking": {"mode": "dual", "unit_tokens": 6, "stop": "budget"},
                                      "flash": [{"question": QUESTION, "max_tokens": 4}]})
        sid = created["session_id"]
        for i, row in enumerate(ROWS[:24]):
            ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": row,
                                      "client_seq": i + 1})
            assert ack["type"] == "input.ack", ack
        await settled_flash(peer, sid)
        units = await until(lambda: _notes_done(tiny_engine, sid), 240, "the notes")
        assert units >= 1
        pipe = server.events.pipes[sid]
        if pipe.checkpointing is not None:  # one the window's slides started: let it finish
            await pipe.checkpointing
        pipe.since_checkpoint = max(pipe.since_checkpoint, 1)  # and take one now, with the notes
        assert await server.events.checkpointer.run(sid, pipe)
        live = tiny_engine.call(lambda: _dual(tiny_engine.sessions[sid])).result(10)
        await peer.send({"type": "query.create", "session_id": sid, "question": QUESTION, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        return sid, live, answer

    store_dir = tmp_path / "state"
    sid, live, answer = serve(tiny_engine, run, store_url=str(store_dir), checkpoint_records=1000,
                              checkpoint_min_records=16)
    store = asyncio.run(FileStore(store_dir).start())
    records = asyncio.run(store.read_log(sid))
    assert records[-1]["kind"] == "checkpoint" and records[-1]["state"]["thinking"]["units"]

    async def again():
        return await restore(tiny_engine, _Renamed(store, sid), "replayed")

    out = asyncio.run(again())
    assert out["records"] == 2  # the creation and the checkpoint: nothing else re-read
    replayed = tiny_engine.call(lambda: _dual(tiny_engine.sessions["replayed"])).result(10)
    assert replayed["notes"] == live["notes"] and replayed["units"] == live["units"]
    assert torch.equal(replayed["reading"], live["reading"]) and torch.equal(replayed["thinking"], live["thinking"])
    assert replayed["flash"] == live["flash"]
    assert tiny_engine.query("replayed", QUESTION, SamplingParams(max_tokens=8)).future.result(60).text == answer
    tiny_engine.close_session("replayed").result(10)


def _notes_done(engine, sid):
    def read():
        s = engine.sessions[sid]
        busy = engine.core.lanes.side.get(sid, {}).get("think") or engine.core.lanes.fifo.get(sid)
        return None if busy or not s.thinking.units else len(s.thinking.units)

    return engine.call(read).result(10)


def _dual(session):
    t = session.thinking
    return {"reading": session.cache.snapshot(), "thinking": t.cache.snapshot(),
            "notes": [u.text for u in t.units], "units": [(u.start, u.end, u.positions) for u in t.units],
            "flash": {fid: (q.answer.text if q.answer else None, q.evaluated_version) for fid, q in session.flash.questions.items()}}


class _Renamed:
    """A store's view of session `sid` under another id (to replay next to the live copy)."""

    def __init__(self, store, sid):
        self.store, self.sid = store, sid

    async def read_log(self, _):
        return [{**r, "session_id": "replayed"} for r in await self.store.read_log(self.sid)]

    async def get_blob(self, digest):
        return await self.store.get_blob(digest)


# ---- blobs: references and expiry -------------------------------------------------------------


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def _blob_expiry(store):
    named, loose, old = b"frame named by the log", b"frame nobody names", b"an earlier checkpoint"
    await store.claim("s")
    await store.append("s", {"kind": "create"}, n=1, rid="r1")
    await store.append("s", {"kind": "checkpoint", "state": {}, "blob": _digest(old)}, n=2, rid="r2")
    await store.append("s", {"kind": "frame", "text": "", "blob": _digest(named), "frame_tokens": 4}, n=3, rid="r3")
    await store.append("s", {"kind": "append", "text": "x"}, n=4, rid="r4")
    for data in (named, loose, old):  # (with retention 0 a blob must be named before it is put)
        await store.put_blob(_digest(data), data)
    store.expire()  # retention 0: whatever no log names is past it
    assert await store.get_blob(_digest(loose)) is None
    assert await store.get_blob(_digest(named)) == named and await store.get_blob(_digest(old)) == old
    # a checkpoint at 4 supersedes the old one; the frame at 3 is compacted away: no log names it
    new = b"the new checkpoint"
    await store.append("s", {"kind": "checkpoint", "state": {}, "blob": _digest(new)}, n=5, rid="r5")
    await store.put_blob(_digest(new), new)
    dropped = await store.compact("s", 5, (_digest(old),))
    assert dropped == 3
    log = await store.read_log("s")
    assert [r["n"] for r in log] == [1, 5] and await store.log_length("s") == 5
    assert await store.append("s", {"kind": "append", "text": "y"}) == 6  # positions go on after the gap
    store.expire()
    assert await store.get_blob(_digest(old)) is None and await store.get_blob(_digest(named)) is None
    assert await store.get_blob(_digest(new)) == new
    await _taken_once(store)


async def _taken_once(store):
    """A blob read with `take` (a drain's handoff blob) is gone once read: one of two readers
    gets it, the other None."""
    handoff = b"a handoff blob"
    await store.claim("h")  # named by a log (with retention 0 a loose blob expires as it is put)
    await store.append("h", {"kind": "create"}, n=1, rid="h1")
    await store.append("h", {"kind": "frame", "text": "", "blob": _digest(handoff), "frame_tokens": 4}, n=2, rid="h2")
    await store.put_blob(_digest(handoff), handoff)
    got = await asyncio.gather(store.get_blob(_digest(handoff), take=True), store.get_blob(_digest(handoff), take=True))
    assert sorted(got, key=lambda b: b is None) == [handoff, None]
    assert await store.get_blob(_digest(handoff)) is None


def test_memory_store_keeps_named_blobs_and_expires_the_rest():
    asyncio.run(_blob_expiry(Store(retention_s=0)))


def test_file_store_keeps_named_blobs_and_expires_the_rest(tmp_path):
    async def run():
        await _blob_expiry(await FileStore(tmp_path, retention_s=0).start())
        # a restart reads the compacted log back with its positions
        again = await FileStore(tmp_path, retention_s=0).start()
        assert [r["n"] for r in await again.read_log("s")] == [1, 5, 6]
        assert await again.append("s", {"kind": "append", "text": "z"}) == 7

    asyncio.run(run())


def test_a_checkpoint_blob_round_trips_and_refuses_damage():
    tensors = {"kv": torch.randn(2, 2, 3, 5, 4), "think": torch.zeros(2, 2, 3, 0, 4),
               "logits": torch.randn(1, 9).to(torch.bfloat16)}
    digest, data = pack(tensors)
    back = unpack(data, digest)
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], tensors[k]) and back[k].dtype == tensors[k].dtype for k in tensors)
    with pytest.raises(CheckpointError, match="does not read back"):
        unpack(data[:-1] + b"\0", digest)
    with pytest.raises(CheckpointError, match="malformed"):
        unpack(b"\xff\xff\x00\x00{", None)


# ---- a real process killed with SIGKILL ----------------------------------------------------------


def test_kill9_then_resume_replays_from_the_checkpoint(tmp_path):
    """A `streamer serve` process (tiny model, file store, a checkpoint every 10 records) is
    killed with SIGKILL mid-stream; a new process on the same store resumes the session from
    its last checkpoint (it replays far fewer records than the session holds), nothing acked
    is lost, and its answers equal those of an uninterrupted session fed the same rows."""
    from procutil import ServerProcess

    rows = ROWS[:90]
    store = str(tmp_path / "state")
    args = ("--model", "tiny", "--store", store, "--limit", "checkpoint_records=10", "--limit",
            "checkpoint_min_records=4")

    async def feed(peer, sid, seqs):
        for i in seqs:
            ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": rows[i - 1],
                                      "client_seq": i})
            assert ack["type"] == "input.ack", ack

    async def answers(peer, sid):
        flash = await settled_flash(peer, sid)
        done = await peer.request({"type": "query.create", "session_id": sid, "question": QUESTION,
                                   "max_tokens": 8, "stream": False})
        assert done["type"] == "query.done", done
        return flash, done["text"]

    async def run():
        create = {"type": "session.create", "window": WINDOW, "flash": [{"question": QUESTION, "max_tokens": 6}]}
        with ServerProcess(*args) as first:
            peer = await raw(first.url)
            created = await peer.request(create)
            sid = created["session_id"]
            await feed(peer, sid, range(1, 61))
            for i in range(61, 71):  # in flight when the process dies
                await peer.send({"type": "input.text.append", "session_id": sid, "text": rows[i - 1],
                                 "client_seq": i})
            first.kill()
        with ServerProcess(*args) as second:
            peer = await raw(second.url)
            resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                          "token": created["tokens"]["producer"], "last_client_seq": 60})
            assert resumed["type"] == "session.resumed", resumed
            last = resumed["last_client_seq"]
            assert last >= 60
            await feed(peer, sid, range(last + 1, len(rows) + 1))
            got = await answers(peer, sid)
            ref = (await peer.request(create))["session_id"]
            await feed(peer, ref, range(1, len(rows) + 1))
            want = await answers(peer, ref)
            return resumed, got, want, await FileStore(store).read_log(sid)

    resumed, got, want, records = asyncio.run(run())
    # creation + checkpoint + a tail, not 60+: the tail holds up to checkpoint_records records, and
    # those logged while a due checkpoint waited for the engine to read its backlog (inputs are held
    # for it after ~0.5 s of tries: before that hold, a feed outpacing the engine put the checkpoint
    # off to the end, and this bound failed in ~1 run of 5), here the 10 sent unacknowledged before the kill
    assert resumed["replayed_records"] <= 2 + 10 + 10, resumed
    assert got == want
    appends = [r["client_seq"] for r in records if r["kind"] == "append"]
    # a checkpoint taken after the last rows may have compacted every append: it states the
    # client seq it covers, and the appends the log keeps come after it, each once, in order
    covered = max((r.get("client_seq") or 0 for r in records if r["kind"] == "checkpoint"), default=0)
    assert appends == sorted(set(appends)) and all(a > covered for a in appends), (covered, appends)
    assert max([covered, *appends]) == len(rows), (covered, appends)  # every row is in, up to the last


# ---- Redis ----------------------------------------------------------------------------------------


def test_redis_store_persists_named_blobs_and_compacts_atomically(redis_url):
    """A blob a log names has no TTL (put before or after the record); compaction drops
    positions 2 .. checkpoint-1 in one script, deletes the superseded checkpoint blob and gives
    the blobs no log names any more their TTL back; a blob two sessions name keeps none until
    both let go; a closed session's blobs expire with its log."""
    from streamer.store import open_store

    async def run():
        store = await open_store(redis_url, worker_id="wa", retention_s=60).start()
        ttl = lambda data: store.redis.ttl(store.key("blob", _digest(data)))  # noqa: E731
        named, shared, loose, old, new = (b"frame A", b"frame both", b"loose", b"checkpoint 1", b"checkpoint 2")
        await store.put_blob(_digest(named), named)  # put first (as the server does), then named
        await store.put_blob(_digest(loose), loose)
        for sid in ("s", "t"):
            await store.claim(sid)
            await store.append(sid, {"kind": "create"}, n=1, rid="r1")
            await store.append(sid, {"kind": "frame", "text": "", "blob": _digest(shared), "frame_tokens": 4},
                               n=2, rid="r2")
        await store.append("s", {"kind": "checkpoint", "state": {}, "blob": _digest(old)}, n=3, rid="r3")
        await store.append("s", {"kind": "frame", "text": "", "blob": _digest(named), "frame_tokens": 4}, n=4, rid="r4")
        await store.put_blob(_digest(shared), shared)
        await store.put_blob(_digest(old), old)
        assert await ttl(named) == -1 and await ttl(shared) == -1 and await ttl(old) == -1
        assert 0 < await ttl(loose) <= 60
        await store.append("s", {"kind": "checkpoint", "state": {}, "blob": _digest(new)}, n=5, rid="r5")
        await store.put_blob(_digest(new), new)
        assert await store.compact("s", 5, (_digest(old),)) == 3
        assert [r["n"] for r in await store.read_log("s")] == [1, 5] and await store.log_length("s") == 5
        assert await store.append("s", {"kind": "append", "text": "y"}) == 6
        assert await store.get_blob(_digest(old)) is None  # superseded: gone now
        assert 0 < await ttl(named) <= 60  # no log names it: it expires after the retention time
        assert await ttl(shared) == -1  # t still names it
        assert await ttl(new) == -1
        await store.closed("t")
        assert 0 < await ttl(shared) <= 60
        await store.closed("s")
        assert 0 < await ttl(new) <= 60
        await _taken_once(store)
        await store.close()

    asyncio.run(run())
