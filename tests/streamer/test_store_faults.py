"""The durability contract under store faults, against a private redis-server (never the
shared one): killed, stalled with SIGSTOP, restarted empty, in the middle of a stream over a
real websocket. Every reply path answers (`store_unavailable`, recoverable); an input whose
write failed is not applied and its resend is accepted; a session whose Redis came back empty
is re-claimed and its log re-written; a second worker that replays the log answers exactly as a
control session fed the same inputs."""

import asyncio
import os
import shutil
import signal
import socket
import subprocess

import pytest

pytest.importorskip("redis")

from helpers import until  # noqa: E402
from redisutil import answers  # noqa: E402
from wsutil import check_error, raw  # noqa: E402

from streamer.recovery import applied  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from test_durability import CHUNKS, QUESTION, SYSTEM, stream  # noqa: E402


class PrivateRedis:
    """A redis-server of the test's own on a free port. No persistence: a restart is empty;
    `persist`: an append-only file synced on every write, so a restart after SIGKILL keeps it all."""

    def __init__(self, tmp, persist: bool = False) -> None:
        self.persist = persist
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("needs redis-server (Debian package redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.tmp, self.proc = tmp, None
        self.start()

    def start(self) -> None:
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.persist else ["--appendonly", "no"]
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--save", "", *aof,
                                      "--dir", str(self.tmp)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self) -> None:
        await until(lambda: answers(self.port), 10, "the private redis-server")

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)

    def stall(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.kill()


async def append(peer, sid, text, seq):
    return await peer.request({"type": "input.text.append", "session_id": sid, "text": text, "client_seq": seq})


async def ask(peer, sid):
    await peer.send({"type": "query.create", "session_id": sid, "question": QUESTION, "max_tokens": 12})
    return (await peer.until("query.done"))[-1]["text"]


async def adopt_and_check(peer, url, sid, token, texts, system_prompt, ask_):
    """A second worker (`peer` on it) adopts the dead worker's session by replay: every acked
    input is there once, in order, and it answers as a control session fed the same inputs."""
    from streamer.store import open_store

    async def adopted():  # the dead worker's heartbeat must expire first
        reply = await peer.request({"type": "session.resume", "session_id": sid, "token": token})
        return reply if reply["type"] == "session.resumed" else None

    resumed = await until(adopted, 60, "the second worker to adopt the session")
    assert resumed["last_client_seq"] == len(texts) and resumed["session"]["last_seq"] == len(texts)
    control = await peer.create(system_prompt=system_prompt)
    await stream(peer, control, texts)
    assert await ask_(peer, sid) == await ask_(peer, control)
    store = await open_store(url, worker_id="reader").start()
    records = await store.read_log(sid)
    await store.redis.aclose()
    assert [r["text"] for r in applied(records) if r["kind"] == "append"] == texts  # each once, in order


def test_store_faults_cost_no_acked_input_and_resends_are_accepted(tiny_engine, tmp_path):
    redis = PrivateRedis(tmp_path)

    async def main():
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
        a = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="a")).start()
        b = None
        try:
            peer = await raw(f"ws://127.0.0.1:{a.port}")
            created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(peer, sid, CHUNKS[:1])

            # 1. Redis dies: every reply path answers with a recoverable store_unavailable.
            redis.kill()
            check_error(await peer.request({"type": "sessions.list"}), "store_unavailable")
            check_error(await peer.request({"type": "session.create"}), "store_unavailable")
            failed = check_error(await append(peer, sid, CHUNKS[1], 2), "store_unavailable")
            assert "resend" in failed["message"]
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            assert (state["inputs"], state["last_seq"]) == (1, 1)  # not applied, no seq taken

            # 2. Redis comes back empty: the session is re-claimed and its log re-written; the
            # resend is accepted (it was never logged), not answered as a duplicate.
            redis.start()
            await redis.ready()
            assert (await peer.request({"type": "sessions.list"}))["type"] == "sessions"
            assert (await peer.request({"type": "session.create"}))["type"] == "session.created"
            ack = await append(peer, sid, CHUNKS[1], 2)
            assert ack["type"] == "input.ack" and ack["seq"] == 2 and not ack.get("duplicate"), ack
            assert a.events.counters["relogged"] == 1

            # 3. Redis stalls mid-write: the write times out (it may land when Redis wakes, and
            # is then voided: its client was told it was not applied); the resend is accepted
            # as a new input. Either way nothing is lost or doubled.
            redis.stall()
            check_error(await append(peer, sid, CHUNKS[2], 3), "store_unavailable")
            redis.resume()
            again = await append(peer, sid, CHUNKS[2], 3)
            assert again["type"] == "input.ack" and not again.get("duplicate"), again
            await stream(peer, sid, CHUNKS[3:], first_seq=4)
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            assert (state["inputs"], state["last_seq"]) == (4, 4)
            live = await ask(peer, sid)
            log = await a.store.read_log(sid)
            texts = [r["text"] for r in applied(log) if r["kind"] == "append"]
            assert texts == CHUNKS  # each input once, in order
            await peer.ws.close()
        finally:
            await a.stop()  # its engine copies go; the log stays, owned by nobody alive

        # 4. Another worker replays the log: the same inputs, the same answer as a control
        # session fed the same chunks.
        b = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="b")).start()
        try:
            peer = await raw(f"ws://127.0.0.1:{b.port}")
            resumed = await peer.request({"type": "session.resume", "session_id": sid, "token": token})
            assert resumed["type"] == "session.resumed" and resumed["last_client_seq"] == 4, resumed
            assert resumed["session"]["last_seq"] == 4
            control = await peer.create(system_prompt=SYSTEM)
            await stream(peer, control, CHUNKS)
            assert await ask(peer, sid) == await ask(peer, control) == live
            await peer.ws.close()
        finally:
            await b.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 240))
    finally:
        redis.close()


@pytest.mark.embedded
def test_store_faults_then_kill9_replays_every_acked_input(tmp_path):
    """Real `streamer serve` processes on the embedded model and a private Redis: a stall and a
    restart-empty in the middle of a stream, each failed input resent, then the worker is
    killed with SIGKILL; a second worker adopts the session by replay: every acknowledged input
    is there once, in order, and its answer equals a control session fed the same inputs."""
    from procutil import ServerProcess
    from test_durability_procs import CHUNKS as LOG, QUESTION as ASK, SYSTEM as PROMPT

    redis = PrivateRedis(tmp_path)

    async def ask_(peer, sid):
        done = await peer.request({"type": "query.create", "session_id": sid, "question": ASK,
                                   "max_tokens": 16, "stream": False})
        assert done["type"] == "query.done", done
        return done["text"]

    async def main():
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
        with ServerProcess("--store", url, "--worker-id", "wa") as a:
            peer = await raw(a.url)
            created = await peer.request({"type": "session.create", "system_prompt": PROMPT})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(peer, sid, LOG[:2])
            redis.stall()
            check_error(await append(peer, sid, LOG[2], 3), "store_unavailable")
            redis.resume()
            assert (await append(peer, sid, LOG[2], 3))["type"] == "input.ack"
            redis.kill()
            check_error(await append(peer, sid, LOG[3], 4), "store_unavailable")
            redis.start()
            await redis.ready()
            ack = await append(peer, sid, LOG[3], 4)
            assert ack["type"] == "input.ack" and not ack.get("duplicate"), ack
            await stream(peer, sid, LOG[4:], first_seq=5)
            a.kill()
        with ServerProcess("--store", url, "--worker-id", "wb") as b:
            await adopt_and_check(await raw(b.url), url, sid, token, LOG, PROMPT, ask_)

    try:
        asyncio.run(asyncio.wait_for(main(), 400))
    finally:
        redis.close()


@pytest.mark.parametrize("checkpoints", [False, True], ids=["no-checkpoint", "checkpointed"])
def test_a_store_restarted_empty_gets_the_logs_back_with_no_new_input(tiny_engine, tmp_path, checkpoints):
    """Redis restarts empty after the last acked input and no input follows: the worker's next
    heartbeat finds itself forgotten and re-writes the logs of its sessions from memory, so a
    second worker still replays every acked input (durability does not wait for a next write).
    With checkpoints (one after the 3 inputs here, the last record) the re-written log names a
    checkpoint whose K/V blob went with Redis: the worker takes a new checkpoint, so the log
    replays."""
    redis = PrivateRedis(tmp_path)
    every = {"checkpoint_records": 3, "checkpoint_min_records": 3} if checkpoints else {"checkpoint_records": 0}

    async def main():
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
        a = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="a", **every)).start()
        try:
            peer = await raw(f"ws://127.0.0.1:{a.port}")
            created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(peer, sid, CHUNKS[:3])
            live = await ask(peer, sid)
            if checkpoints:
                async def checkpointed():
                    task = a.events.pipes[sid].checkpointing
                    return (a.events.counters["checkpoints"] == 1 and task is not None and task.done()) or None

                await until(checkpointed, 30, "the checkpoint after the third input")
                before = a.events.counters["checkpoints"]
            redis.kill()
            redis.start()
            await redis.ready()


            async def rewritten():
                try:
                    records = await a.store.read_log(sid)
                except Exception:
                    return None
                if not checkpoints:
                    return len(records) == 4 or None
                marks = [r for r in records if r.get("kind") == "checkpoint"]
                return (a.events.counters["checkpoints"] > before and bool(marks)
                        and await a.store.get_blob(marks[-1]["blob"]) is not None) or None

            await until(rewritten, 30, "the worker to re-write the lost log")
            assert a.events.counters["relogged"] == 1
            await peer.ws.close()
        finally:
            await a.stop()
        b = await StreamerServer(tiny_engine, ServerConfig(port=0, store_url=url, worker_id="b")).start()
        try:
            peer = await raw(f"ws://127.0.0.1:{b.port}")
            resumed = await peer.request({"type": "session.resume", "session_id": sid, "token": token})
            assert resumed["type"] == "session.resumed" and resumed["last_client_seq"] == 3, resumed
            assert await ask(peer, sid) == live
            await peer.ws.close()
        finally:
            await b.stop()

    try:
        asyncio.run(asyncio.wait_for(main(), 120))
    finally:
        redis.close()


@pytest.mark.parametrize("fault", ["killed", "stalled", "restarted_empty"])
def test_each_store_fault_then_kill9_keeps_every_acked_input(fault, tmp_path):
    """One fault at a time in the middle of a stream, then the worker is killed with SIGKILL:
    - killed: Redis is killed with SIGKILL (the input is refused) and comes back with its data
      (an append-only file);
    - stalled: a write times out while Redis is stopped (it may land when Redis wakes);
    - restarted_empty: Redis comes back with nothing (the worker re-writes the log from memory).
    A second worker adopts the session by replay: every acked input is there once, in order;
    the one input sent during the fault is not applied (absent, or logged after all and voided)
    and its resend is accepted as a new input; the answer equals a control
    session's fed the same inputs. Tiny model (`--model tiny`): the store path is what is tested."""
    from procutil import ServerProcess

    redis = PrivateRedis(tmp_path, persist=fault == "killed")
    texts = [f" Row {i}: the {w} held." for i, w in enumerate(["wind", "tide", "fog", "rain", "calm", "sun"])]

    async def main():
        await redis.ready()
        url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
        with ServerProcess("--model", "tiny", "--store", url, "--worker-id", "wa") as a:
            peer = await raw(a.url)
            created = await peer.request({"type": "session.create", "system_prompt": SYSTEM})
            sid, token = created["session_id"], created["tokens"]["producer"]
            await stream(peer, sid, texts[:2])
            if fault == "stalled":
                redis.stall()
                check_error(await append(peer, sid, texts[2], 3), "store_unavailable")
                redis.resume()
            else:  # killed: back with its data; restarted_empty: back with nothing
                redis.kill()
                check_error(await append(peer, sid, texts[2], 3), "store_unavailable")
                redis.start()
                await redis.ready()
            resent = await append(peer, sid, texts[2], 3)  # as the SDK does: the same client_seq
            assert resent["type"] == "input.ack" and not resent.get("duplicate"), resent
            await stream(peer, sid, texts[3:], first_seq=4)
            a.kill()
        with ServerProcess("--model", "tiny", "--store", url, "--worker-id", "wb") as b:
            await adopt_and_check(await raw(b.url), url, sid, token, texts, SYSTEM, ask)

    try:
        asyncio.run(asyncio.wait_for(main(), 300))
    finally:
        redis.close()
