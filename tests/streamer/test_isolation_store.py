"""Issue 33, items 5, 7 and 9: a worker that lost its lease is fenced at once, a timed-out store
write is never applied behind its client's back, and the in-memory log copy costs what its cap
says.

- Zombie worker: two real `streamer serve` processes share one real Redis; the owner is paused
  with SIGSTOP past its heartbeat TTL, the other adopts the session by replay and takes more
  input, then the paused one is continued (SIGCONT). Its first command on the session renews
  its lease, finds the session adopted and drops it: questions, writes and resumes there are
  answered `moved` to the new owner, never from the stale copy and never `store_unavailable`.
- Store timeout: a private redis-server is stopped (SIGSTOP) so that an append's write times out
  (`store_unavailable`: not applied, resend it); when Redis wakes, the stalled write lands. The
  input must still not take effect until its client resends it, and the resend is a new input.
- Log copy: tracemalloc of the copy while it fills up to `relog_max_bytes`.
"""

import asyncio
import gc
import os
import signal
import tracemalloc

import pytest
from helpers import until
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)
from test_durability import stream
from test_store_faults import PrivateRedis, append
from wsutil import check_error, raw

from streamer.directory import Directory
from streamer.eventlog import LogWriter, Pipe
from streamer.recovery import applied
from streamer.server import ServerConfig, StreamerServer
from streamer.store import Store, open_store

SYSTEM = "You keep a ship's log. Answer in a few words."
TEXTS = [f" Entry {i}: the {w} held steady." for i, w in enumerate(["wind", "tide", "fog", "rain", "calm", "sun"])]


# ---- item 9: the log copy's memory ------------------------------------------------------------


def test_the_log_copy_costs_no_more_memory_than_its_cap():
    """The copy kept to re-write a lost log holds every record written until it would pass
    `relog_max_bytes`, and the memory it really holds (tracemalloc: what the structure keeps
    allocated) stays within the cap and within a few percent of what it counts. Records as the
    event log writes them: short appends (the worst case: per-record overhead dominates)."""
    cap = 1 << 20
    writer = LogWriter(Store(), Directory(False, 8), cap, {"log_records": 0, "log_errors": 0})
    writer.mirror(Pipe(), 1, "warm", {"kind": "append", "text": "-"})  # the json module's first-use caches
    pipe = Pipe()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held, kept = 0, 0
        for n in range(1, 100_000):
            record = {"kind": "append", "text": f" Reading {n}: 12.5 knots, heading 270.", "client_seq": n,
                      "first": True, "ts": 1_700_000_000.0 + n / 10, "n": n}
            writer.mirror(pipe, n, f"{n:016x}", record)
            del record
            if pipe.mirror is None:
                break
            kept = n
            held = tracemalloc.get_traced_memory()[0] - base
            # it counts what it holds (4 KiB: the interpreter's one-off allocations, not per record)
            assert held <= pipe.mirror_bytes + 4096, (n, held, pipe.mirror_bytes)
    finally:
        tracemalloc.stop()
    assert pipe.mirror is None, "the copy never reached its cap"
    print(f"log copy: {kept} records held in {held} bytes ({held / kept:.0f} B/record) under a cap of {cap}")
    assert held <= cap
    assert held >= 0.8 * cap  # it does use its cap: a copy dropped early would lose durability for nothing
    assert kept >= cap // 256  # ~160 bytes a record: compact (a dict of fields cost ~0.9 KB)


def test_the_log_copy_rewrites_exactly_what_was_written():
    """The compact copy gives back each record as written (position, id, fields), so a store
    that lost the log gets the same records again."""
    writer = LogWriter(Store(), Directory(False, 8), 1 << 20, {"log_records": 0, "log_errors": 0})
    pipe = Pipe()
    records = [{"kind": "create", "system_prompt": "Zoë's log ✓", "flash": [], "n": 1},
               {"kind": "append", "text": "line\nwith \"quotes\"", "client_seq": 1, "first": True, "ts": 1.5, "n": 2}]
    for record in records:
        writer.mirror(pipe, record["n"], f"rid{record['n']}", {**record, "session_id": "s"})
    assert writer.mirrored(pipe) == [(r["n"], f"rid{r['n']}", {k: v for k, v in r.items() if k != "n"})
                                     for r in records]


# ---- item 7: a timed-out write is never applied silently -----------------------------------------


def test_a_timed_out_input_is_not_applied_unless_resent(tiny_engine, tmp_path):
    """An append whose write times out is answered `store_unavailable` (not applied, resend it).
    Redis was stopped, not dead: when it wakes, the stalled write lands in the log. The worker
    must not apply it then (the client was told it was not applied: 9 inputs for 8 acks); it
    voids it in the log, the resend is a new input (acked with a seq, not as a duplicate), and
    a second worker replays the log to the same session and answer."""
    redis = PrivateRedis(tmp_path)

    async def main():
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
        a = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="a")).start()
        reader = await open_store(url, worker_id="reader").start()
        try:
            peer = await raw(f"ws://127.0.0.1:{a.port}")
            created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(peer, sid, TEXTS[:2])

            redis.stall()
            failed = check_error(await append(peer, sid, TEXTS[2], 3), "store_unavailable")
            assert failed["recoverable"] and "resend" in failed["message"]
            redis.resume()

            def settled():  # the worker settles the timed-out write once Redis answers (written or voided)
                return a.events.counters["log_fenced"] + a.events.counters["log_settled"] >= 1

            await until(settled, 30, "the timed-out write to be settled")
            log = await reader.read_log(sid)
            landed = [r for r in log if r["kind"] == "append" and r.get("client_seq") == 3]
            assert landed, f"the stalled write did not land, so this run tested nothing: {log}"
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            assert (state["inputs"], state["last_seq"]) == (2, 2), state  # still not applied
            assert [r["text"] for r in applied(log) if r["kind"] == "append"] == TEXTS[:2]  # nor replayed

            ack = await append(peer, sid, TEXTS[2], 3)  # the resend: a new input
            assert ack["type"] == "input.ack" and ack["seq"] == 3 and not ack.get("duplicate"), ack
            await stream(peer, sid, TEXTS[3:], first_seq=4)
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            assert (state["inputs"], state["last_seq"]) == (len(TEXTS), len(TEXTS)), state
            live = await ask(peer, sid)
            log = await reader.read_log(sid)
            assert [r["text"] for r in applied(log) if r["kind"] == "append"] == TEXTS  # each once, in order
            assert a.events.counters["log_voided_late"] == 1
            await peer.ws.close()
        finally:
            await a.stop()
        b = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="b")).start()
        try:
            peer = await raw(f"ws://127.0.0.1:{b.port}")
            resumed = await peer.request({"type": "session.resume", "session_id": sid, "token": token})
            assert resumed["type"] == "session.resumed", resumed
            assert resumed["last_client_seq"] == len(TEXTS) and resumed["session"]["last_seq"] == len(TEXTS)
            assert (await ask(peer, sid))["text"] == live["text"]
            await peer.ws.close()
        finally:
            await b.stop()
            await reader.redis.aclose()

    try:
        asyncio.run(asyncio.wait_for(main(), 180))
    finally:
        redis.close()


async def ask(peer, sid):
    done = await peer.request({"type": "query.create", "session_id": sid, "question": "Which entry is last?",
                               "max_tokens": 8, "stream": False})
    assert done["type"] == "query.done", done
    return done


# ---- item 5: a worker that lost its lease ------------------------------------------------------


def test_a_paused_worker_that_lost_its_session_answers_moved_at_once(redis_url):
    """Worker A owns a session; A is paused (SIGSTOP) past its heartbeat TTL; B adopts the
    session on resume and takes two more inputs; A is continued (SIGCONT). The very first
    commands A gets on that session, on the connection that was producing into it, are answered
    `moved` with B as owner: a question (not A's stale answer), a write (not a recoverable
    `store_unavailable`), and a resume on a new connection (not `session.resumed`). B serves
    the session with every input, and A serves new sessions as before."""
    from procutil import ServerProcess

    async def main():
        with ServerProcess("--model", "tiny", "--store", redis_url, "--worker-id", "wa") as a, \
                ServerProcess("--model", "tiny", "--store", redis_url, "--worker-id", "wb") as b:
            old = await raw(a.url)
            created = await old.request({"type": "session.create", "system_prompt": SYSTEM})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(old, sid, TEXTS[:3])
            assert (await ask(old, sid))["data_version"] == 3

            os.kill(a.proc.pid, signal.SIGSTOP)
            try:
                new = await raw(b.url)

                async def adopted():  # B adopts once A's heartbeat key has expired
                    reply = await new.request({"type": "session.resume", "session_id": sid, "token": token})
                    if reply["type"] == "error":
                        assert reply["error"]["code"] == "moved", reply
                        return None
                    return reply

                resumed = await until(adopted, 60, "worker B to adopt the session of the paused worker A")
                assert resumed["last_client_seq"] == 3 and resumed["replayed_records"] == 4
                await stream(new, sid, TEXTS[3:5], first_seq=4)
                owner_answer = await ask(new, sid)
                assert owner_answer["data_version"] == 5
            finally:
                os.kill(a.proc.pid, signal.SIGCONT)

            owner = {"worker": "wb", "url": b.url, "alive": True}
            question = await old.request({"type": "query.create", "session_id": sid, "question": "Which entry is last?",
                                          "max_tokens": 8, "stream": False})
            assert question["type"] == "error", f"the paused worker answered from its stale copy: {question}"
            assert question["error"]["code"] == "moved" and question["error"]["owner"] == owner, question
            write = await append(old, sid, TEXTS[5], 6)
            assert write["type"] == "error" and write["error"]["code"] == "moved", write
            assert write["error"]["owner"] == owner, write
            other = await raw(a.url)
            again = await other.request({"type": "session.resume", "session_id": sid, "token": token})
            assert again["type"] == "error" and again["error"]["code"] == "moved", again
            assert again["error"]["owner"] == owner, again

            ack = await append(new, sid, TEXTS[5], 6)  # the owner takes it
            assert ack["type"] == "input.ack" and ack["seq"] == 6, ack
            assert (await ask(new, sid))["data_version"] == 6
            fresh = await other.create(system_prompt=SYSTEM)  # A itself still works
            await stream(other, fresh, TEXTS[:1])
            store = await open_store(redis_url, worker_id="reader").start()
            log = await store.read_log(sid)
            assert (await store.owner(sid))["worker"] == "wb"
            await store.redis.aclose()
            assert [r["text"] for r in applied(log) if r["kind"] == "append"] == TEXTS  # each once, in order
            assert not any(r["kind"] == "close" for r in log)
            return a.output

    output = asyncio.run(asyncio.wait_for(main(), 240))
    assert any("lost its lease" in line for line in output), "".join(output[-30:])
