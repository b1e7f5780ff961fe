"""Crash and failover with real server processes on the embedded model.

Crash: a worker is killed with SIGKILL while input is in flight; a restarted worker on the
same store recovers the session on resume; the client resends what was not acknowledged; the
flash answers and a greedy question's answer equal those of an uninterrupted run of the same
input (a fresh session on the same process), and the log holds every input exactly once.

Failover: two workers share a Redis; a session lives on worker A (B answers `moved` while A
is alive); A is killed; B adopts the session on resume by replaying its log from Redis.
"""

import asyncio

import pytest
from procutil import ServerProcess
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)
from helpers import until
from wsutil import raw

from streamer.store import FileStore, open_store

pytestmark = pytest.mark.embedded

SYSTEM = "You are a harbour master's assistant. Answer in a few words."
CHUNKS = [
    "Log of the fishing boat Dora, skipper Ana Reyes. ",
    "06:10 left the harbour of Porto Velho, wind light from the east. ",
    "07:30 nets out two miles south of the red buoy. ",
    "09:05 engine trouble: the fuel filter is clogged. ",
    "09:40 the mate, Tomas, changed the filter; engine running again. ",
    "11:15 nets in: mostly sardines, some mackerel. ",
    "12:50 fog rolling in from the west; course set for home. ",
    "14:20 moored at the north quay of Porto Velho. ",
]
FLASH = [{"question": "What was wrong with the engine?", "max_tokens": 8},
         {"question": "Where is the boat now?", "max_tokens": 8}]
QUESTION = "Who fixed the engine, and how?"


async def flash_at(peer, sid, version):
    async def reached():
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        if all(q.get("data_version", -1) >= version for q in state["flash"]):
            return {q["flash_id"]: (q["answer"], q["data_version"]) for q in state["flash"]}
        return None

    return await until(reached, 300, f"flash answers of data_version {version}")


async def ask(peer, sid):
    done = await peer.request({"type": "query.create", "session_id": sid, "question": QUESTION,
                               "max_tokens": 16, "stream": False})
    assert done["type"] == "query.done", done
    return done["text"]


async def start_stream(url, kill_after):
    """Create a session, pipeline every chunk, return once `kill_after` acks have arrived
    (the rest are in flight): (created event, acknowledged client seqs)."""
    peer = await raw(url)
    created = await peer.request({"type": "session.create", "system_prompt": SYSTEM, "flash": FLASH})
    sid = created["session_id"]
    for i, text in enumerate(CHUNKS, 1):
        await peer.send({"type": "input.text.append", "session_id": sid, "text": text, "client_seq": i,
                         "event_id": f"in{i}"})
    acked = []
    while len(acked) < kill_after:
        event = await peer.recv(120)
        if event["type"] == "input.ack":
            acked.append(event["client_seq"])
        assert event["type"] != "error", event
    return peer, created, acked


async def finish(url, created, acked, attempts=1):
    """Resume on `url`, resend what the server lacks, read answers; then an uninterrupted
    reference session on the same process with the same input."""
    peer = await raw(url)
    sid = created["session_id"]
    for _ in range(attempts):
        resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                      "token": created["tokens"]["producer"], "last_client_seq": max(acked)})
        if resumed["type"] == "session.resumed" or resumed["error"]["code"] != "moved":
            break
        await asyncio.sleep(0.2)  # the dead owner's heartbeat has not expired yet
    assert resumed["type"] == "session.resumed", resumed
    last = resumed["last_client_seq"]
    assert last >= max(acked), (last, acked)  # nothing acknowledged was lost
    assert resumed["replayed_records"] == 1 + last  # create + one record per input it holds
    for i in range(max(acked) - 1, len(CHUNKS) + 1):  # resend from before the last ack on: dups are ignored
        if i < 1:
            continue
        ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": CHUNKS[i - 1],
                                  "client_seq": i})
        assert ack["type"] == "input.ack", ack
        assert ack.get("duplicate", False) == (i <= last), (i, last, ack)
    got = (await flash_at(peer, sid, len(CHUNKS)), await ask(peer, sid))

    ref = await peer.create(system_prompt=SYSTEM, flash=FLASH)
    for text in CHUNKS:
        assert (await peer.request({"type": "input.text.append", "session_id": ref, "text": text}))["type"] == "input.ack"
    want = (await flash_at(peer, ref, len(CHUNKS)), await ask(peer, ref))
    return got, want, last


def check_log(records):
    assert records[0]["kind"] == "create"
    appends = [r for r in records if r["kind"] == "append"]
    assert [r["client_seq"] for r in appends] == list(range(1, len(CHUNKS) + 1))  # each once, in order
    assert all(r["first"] for r in appends)  # logged before they were applied (their seqs follow from the order)
    assert [r["text"] for r in appends] == CHUNKS


def test_kill9_mid_stream_then_restart(tmp_path):
    store = str(tmp_path / "state")

    async def run():
        with ServerProcess("--store", store) as first:
            peer, created, acked = await start_stream(first.url, kill_after=3)
            first.kill()
        assert acked == [1, 2, 3]
        with ServerProcess("--store", store) as second:
            return created, await finish(second.url, created, acked)

    created, (got, want, last) = asyncio.run(run())
    print(f"acknowledged before kill: 3; in the log after the crash: {last}; answers {got}")
    assert got == want
    check_log(asyncio.run(FileStore(store).read_log(created["session_id"])))


def test_two_workers_failover(redis_url):
    async def run():
        with ServerProcess("--store", redis_url, "--worker-id", "wa") as a, \
                ServerProcess("--store", redis_url, "--worker-id", "wb") as b:
            peer, created, acked = await start_stream(a.url, kill_after=4)
            sid = created["session_id"]
            other = await raw(b.url)  # routed by id: B sends the client to the owner while it lives
            moved = await other.request({"type": "session.resume", "session_id": sid,
                                         "token": created["tokens"]["producer"]})
            assert moved["type"] == "error" and moved["error"]["code"] == "moved", moved
            assert moved["error"]["owner"] == {"worker": "wa", "url": a.url, "alive": True}
            a.kill()
            result = await finish(b.url, created, acked, attempts=600)
            store = await open_store(redis_url, worker_id="reader").start()
            records = await store.read_log(sid)
            owner = await store.owner(sid)
            await store.redis.aclose()
            return result, records, owner

    (got, want, last), records, owner = asyncio.run(run())
    print(f"acknowledged before kill: 4; in the log at adoption: {last}; answers {got}")
    assert got == want
    assert owner["worker"] == "wb"
    check_log(records)
