"""Fuzz the protocol core, and optionally a live server, with random and mutated messages.

    python bench/fuzz.py                      # 100,000 inputs against the sans-I/O core
    python bench/fuzz.py --n 10000 --live 2000  # plus 2,000 over a real socket (tiny model)
    python bench/fuzz.py --n 0 --flood 100000   # invalid frames flooded at a server at default limits
    python bench/fuzz.py --n 0 --store 5000     # appends while a private Redis is killed, emptied, stalled

Inputs: well-formed messages built from the schemas, then mutated (fields dropped, added,
retyped, oversized, unicode edge cases, deep nesting, extreme numbers), byte-level mutations
of their JSON (flips, truncation, splices, duplication), random bytes, and binary frames with
media-style headers. The oracle: every input either parses into a command of a known type or
raises a ProtocolError whose code is listed in docs/protocol.md, recoverable, within a time
bound; anything else is a crash. Live mode also requires that every error event carries a
documented code, that no `internal_error` appears, and that the session still answers after.
Last line: `RESULT fuzzed=<n> crashes=<n>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import struct
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from streamer.protocol import SCHEMAS, Command, ProtocolError, ProtocolLimits, ServerProtocol  # noqa: E402
from streamer.recovery import applied  # noqa: E402


def documented_codes() -> set[str]:
    """Error codes in the table of docs/protocol.md (first column)."""
    text = (ROOT / "docs" / "protocol.md").read_text()
    table = text[text.index("| code | when |"):]
    codes: set[str] = set()
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        codes.update(re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return codes


WEIRD_STRINGS = ["", " ", "\x00", "\u2028", "\ud800", "\udfff", "é" * 3, "🦜" * 4, "a\u200bb", "\x7f", "\\", '"',
                 "{}", "null", "𝔘𝔫𝔦", "\r\n", "x" * 70, "x" * 5000, "\t", "%s%n", "../../etc/passwd", "<script>"]
WEIRD_VALUES = [None, True, False, 0, -1, 1, 2**31, 2**63, -2**63, 2**64 + 1, 10**400, 0.5, -0.0, 1e308, 1e-308,
                [], {}, [None], {"a": 1}, [[[]]], "1", "true", 1.5, -7, [1.0] * 70, {"type": "x"}]
KIND_VALUES = {
    "str": ["hello", "What is the tide?", "ünïcode ✓"],
    "id": ["s-1", "abc", "x" * 64],
    "int": [0, 1, 5, 100, 10_000],
    "float": [0.0, 0.7, 1.0, 2.5],
    "bool": [True, False],
    "strlist": [["stop"], [], ["a", "b"]],
    "numlist": [[0.0, 1.0], [], [3.0]],
    "anyobject": [{"cmd": "go"}, {}],
    "object": [{"mode": "dual"}, {"mode": "off"}, {"mode": "interleaved", "every_tokens": 8}],
    "flashlist": [[{"question": "Is it raining?"}], []],
}


def valid_message(rng: random.Random, session_ids: list[str]) -> dict:
    kind = rng.choice(sorted(SCHEMAS))
    msg: dict = {"type": kind}
    if rng.random() < 0.5:
        msg["event_id"] = f"e{rng.randrange(1000)}"
    for name, spec in SCHEMAS[kind].items():
        if not spec.required and rng.random() < 0.5:
            continue
        if name == "session_id":
            msg[name] = rng.choice(session_ids)
        else:
            msg[name] = rng.choice(KIND_VALUES[spec.kind])
    return msg


def mutate_message(rng: random.Random, msg: dict) -> dict:
    msg = dict(msg)
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(7)
        keys = list(msg)
        if op == 0 and keys:
            msg.pop(rng.choice(keys))
        elif op == 1:
            msg[rng.choice(["extra", "Type", "session", "tokens", "__proto__", "type "])] = rng.choice(WEIRD_VALUES)
        elif op == 2 and keys:
            msg[rng.choice(keys)] = rng.choice(WEIRD_VALUES)
        elif op == 3 and keys:
            msg[rng.choice(keys)] = rng.choice(WEIRD_STRINGS)
        elif op == 4:
            msg["type"] = rng.choice([*SCHEMAS, "session.create ", "SESSION.CREATE", "", "input", "query.*"])
        elif op == 5 and keys:
            depth = rng.randint(1, 3000)
            msg[rng.choice(keys)] = json.loads("[" * min(depth, 500) + "]" * min(depth, 500))
        else:
            name = rng.choice(keys) if keys else "text"
            msg[name] = "w" * rng.choice([1, 1000, 9000, 300_000])
    return msg


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            del b[rng.randrange(len(b)):]
        elif op == 2:
            pos = rng.randrange(len(b) + 1)
            b[pos:pos] = rng.choice([b"\xff", b"\x00", b'"', b"{", b"}", b"\\u", b"\xed\xa0\x80", b"NaN", b"1e999",
                                     b"-", b",", b":"])
        elif op == 3 and b:
            i, j = sorted(rng.randrange(len(b)) for _ in range(2))
            b[i:i] = b[i:j]
        elif op == 4:
            b = bytearray(rng.randbytes(rng.randint(0, 64)))
        else:
            b = bytearray(b.replace(b'"type"', b'"type","type"', 1) if rng.random() < 0.5 else b.upper())
    return bytes(b)


def media_frame(rng: random.Random, session_ids: list[str]) -> bytes:
    """A binary frame in the media layout (4-byte header length, JSON header, payload), mutated."""
    header = {"session_id": rng.choice(session_ids), "kind": rng.choice(["video", "image", "audio", "text", 5]),
              "format": rng.choice(["mp4", "webm", "mpegts", "jpeg", "png", "pcm_s16le", "opus", "aac", "gif", ""]),
              "seq": rng.choice([1, 0, -1, 2**70, "1"]), "ts": rng.choice([0.0, 1.5, -1.0, "now", None])}
    if rng.random() < 0.5:
        header.update(sample_rate=rng.choice([16000, 0, -5, 48000.5]), channels=rng.choice([1, 2, 0, 300]))
    for key in rng.sample(list(header), k=rng.randint(0, 2)):
        header.pop(key)
    raw_header = json.dumps(header).encode()
    if rng.random() < 0.3:
        raw_header = mutate_bytes(rng, raw_header)
    length = len(raw_header) if rng.random() < 0.8 else rng.choice([0, 1, 2**32 - 1, len(raw_header) + 9])
    payload = rng.randbytes(rng.choice([0, 1, 16, 4096]))
    frame = struct.pack(">I", length) + raw_header + payload
    return frame[: rng.randrange(len(frame) + 1)] if rng.random() < 0.1 else frame


def generate(rng: random.Random, session_ids: list[str]) -> str | bytes:
    """One fuzz input: a text frame (str or raw bytes sent as text) or a binary frame (bytes)."""
    r = rng.random()
    if r < 0.25:
        return json.dumps(valid_message(rng, session_ids))
    if r < 0.6:
        return json.dumps(mutate_message(rng, valid_message(rng, session_ids)))
    if r < 0.85:
        return mutate_bytes(rng, json.dumps(valid_message(rng, session_ids)).encode())
    if r < 0.95:
        return media_frame(rng, session_ids)
    return rng.randbytes(rng.randint(0, 256))


def check_core(proto: ServerProtocol, data, codes: set[str], binary: bool, time_limit_s: float = 2.0,
               outcomes: dict | None = None) -> str | None:
    """None when the outcome is allowed; otherwise a description of the crash."""
    start = time.perf_counter()
    try:
        cmd = proto.receive_binary(data) if binary else proto.receive_text(data)
    except ProtocolError as err:
        if outcomes is not None:
            outcomes[err.code] = outcomes.get(err.code, 0) + 1
        if err.code not in codes:
            return f"undocumented code {err.code!r}: {err.message}"
        if not err.recoverable or not err.message:
            return f"{err.code} not recoverable or without a message"
        proto.protocol_error(err)  # the error event must serialize
    except Exception:
        return "exception: " + traceback.format_exc(limit=3)
    else:
        if outcomes is not None:
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        if not isinstance(cmd, Command) or cmd.type not in SCHEMAS and cmd.type != "media":
            return f"parsed into an unknown command {cmd!r}"[:300]
    if time.perf_counter() - start > time_limit_s:
        return f"took {time.perf_counter() - start:.2f} s"
    return None


def fuzz_core(n: int, seed: int = 0, report=print, outcomes: dict | None = None) -> tuple[int, list[str]]:
    codes = documented_codes()
    rng = random.Random(seed)
    proto = ServerProtocol(ProtocolLimits(max_message_bytes=256 * 1024, max_text_chars=200_000))
    crashes: list[str] = []
    for i in range(n):
        data = generate(rng, ["s-1", "s-2", "", "x" * 65])
        binary = isinstance(data, bytes) and rng.random() < 0.5
        problem = check_core(proto, data, codes, binary, outcomes=outcomes)
        if problem is None and isinstance(data, bytes) and not binary:
            try:  # the same bytes as a decoded text frame, when they decode
                problem = check_core(proto, data.decode("utf-8"), codes, False)
            except UnicodeDecodeError:
                pass
        if problem is not None:
            crashes.append(f"input {i}: {problem} <- {data[:200]!r}")
        if report and (i + 1) % 20_000 == 0:
            report(f"  core: {i + 1}/{n} inputs, {len(crashes)} crashes")
    return n, crashes


async def fuzz_live(n: int, seed: int = 1, report=print, outcomes: dict | None = None) -> tuple[int, list[str]]:
    """Mutated messages over a real socket to a real server on a tiny model."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from websockets.asyncio.client import connect

    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from transformers import AutoTokenizer

    from streamer.sessions.models import build_tiny_model, embedded_model_dir
    from streamer.sessions.runner import ModelRunner

    codes = documented_codes()
    lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=3)
    engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name),
                    EngineLimits(max_context_tokens=512, max_answer_tokens=8, max_sessions=16)).start()
    server = await StreamerServer(engine, ServerConfig(port=0, messages_per_s=1e6, messages_burst=10**6,
                                                       refused_per_s=1e6, refused_burst=10**6,
                                                       protocol=ProtocolLimits(max_message_bytes=64 * 1024))).start()
    url = f"ws://127.0.0.1:{server.port}"
    rng = random.Random(seed)
    crashes: list[str] = []
    try:
        ws = await connect(url, max_size=None)
        await ws.send(json.dumps({"type": "session.create", "event_id": "setup"}))
        sid = json.loads(await ws.recv())["session_id"]
        sent = 0
        for i in range(n):
            data = generate(rng, [sid, sid, sid, "nope"])
            if isinstance(data, str) and len(data) > 60_000:
                continue
            try:
                await ws.send(data)  # bytes go as binary frames, str as text frames
            except Exception as exc:
                crashes.append(f"live input {i}: send failed: {exc!r}")
                break
            sent += 1
            while True:  # drain what has arrived, without waiting for replies that may never come
                try:
                    raw = await asyncio.wait_for(ws.recv(), 0.001 if i % 50 else 0.5)
                except asyncio.TimeoutError:
                    break
                event = json.loads(raw)
                if outcomes is not None:
                    key = event["error"]["code"] if event["type"] == "error" else event["type"]
                    outcomes[key] = outcomes.get(key, 0) + 1
                if event["type"] == "error":
                    code = event["error"]["code"]
                    if code not in codes or code == "internal_error":
                        crashes.append(f"live input {i}: error {code}: {event['error']['message']}")
                if event.get("session_id") == sid and (event["type"] == "session.closed" or event.get("ended")):
                    sid = "pending"  # the fuzz closed or ended it: go on with a fresh session
                    await ws.send(json.dumps({"type": "session.create", "event_id": "again"}))
                if event["type"] == "session.created":
                    if event.get("reply_to") == "again":
                        sid = event["session_id"]
                    else:  # one the fuzz created: close it, so the session limit is not what it tests
                        await ws.send(json.dumps({"type": "session.close", "session_id": event["session_id"]}))
            if report and (i + 1) % 1000 == 0:
                report(f"  live: {i + 1}/{n} inputs, {len(crashes)} crashes")
        # the fuzzing connection goes (its sessions close with it); the server still serves
        await ws.close()
        for _ in range(200):
            if not server.connections:
                break
            await asyncio.sleep(0.05)
        probe = await connect(url)
        await probe.send(json.dumps({"type": "session.create"}))
        created = json.loads(await asyncio.wait_for(probe.recv(), 60))
        if created["type"] != "session.created":
            crashes.append(f"server refused a new session after the live fuzz: {created}")
        else:
            await probe.send(json.dumps({"type": "input.text.append", "session_id": created["session_id"],
                                         "text": "still here"}))
            ack = json.loads(await asyncio.wait_for(probe.recv(), 60))
            if ack["type"] != "input.ack":
                crashes.append(f"server stopped serving after the live fuzz: {ack}")
        await probe.close()
    finally:
        await server.stop()
        engine.stop()
    return sent, crashes


async def fuzz_flood(n: int, seed: int = 2, report=print, outcomes: dict | None = None) -> tuple[int, list[str]]:
    """Invalid frames as fast as the socket takes them, against a server at its default limits:
    every error must be documented, a flooding connection must be closed with rate_limited
    (1008) and reconnects; a bystander's session must answer before, during and after."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model, embedded_model_dir
    from streamer.sessions.runner import ModelRunner

    codes = documented_codes()
    lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=3)
    engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name), EngineLimits(max_context_tokens=4096)).start()
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    url = f"ws://127.0.0.1:{server.port}"
    rng = random.Random(seed)
    crashes: list[str] = []
    outcomes = outcomes if outcomes is not None else {}

    async def bystander_ok(ws, sid: str, what: str) -> None:
        await ws.send(json.dumps({"type": "session.get", "session_id": sid, "event_id": "probe"}))
        while True:
            event = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if event.get("reply_to") == "probe":
                break
        if event["type"] != "state":
            crashes.append(f"bystander refused {what} the flood: {event}")

    sent = 0
    try:
        bystander = await connect(url)
        await bystander.send(json.dumps({"type": "session.create", "event_id": "b"}))
        sid = json.loads(await bystander.recv())["session_id"]
        await bystander_ok(bystander, sid, "before")
        while sent < n:
            ws = await connect(url, max_size=None)

            async def drain() -> None:
                async for raw in ws:
                    event = json.loads(raw)
                    code = event["error"]["code"] if event["type"] == "error" else event["type"]
                    outcomes[code] = outcomes.get(code, 0) + 1
                    if event["type"] == "error" and code not in codes:
                        crashes.append(f"flood: undocumented error {code}")

            reader = asyncio.get_running_loop().create_task(drain())
            try:
                while sent < n:
                    data = mutate_bytes(rng, json.dumps(valid_message(rng, [sid, "nope"])).encode())
                    await ws.send(data if rng.random() < 0.3 else data.decode("utf-8", "replace") + "}{")
                    sent += 1
                    if sent % 64 == 0:  # one event loop for client and server here: let the server read
                        await asyncio.sleep(0)
            except ConnectionClosed:
                pass
            await asyncio.wait({reader}, timeout=10)
            reader.cancel()
            if sent < n:  # closed by the server: it must say why
                close = ws.protocol.close_rcvd
                if close is not None and close.code != 1008:  # None: aborted after a bounded wait
                    crashes.append(f"flood connection closed with {close.code}, not 1008")
                outcomes["closed_1008"] = outcomes.get("closed_1008", 0) + 1
                if outcomes["closed_1008"] % 10 == 0:
                    await bystander_ok(bystander, sid, "during")
            else:
                await ws.close()
            if report and sent // 10000 != (sent - 1) // 10000:
                report(f"  flood: {sent}/{n} frames, {outcomes.get('closed_1008', 0)} connections closed")
        await bystander_ok(bystander, sid, "after")
        await bystander.close()
    finally:
        await server.stop()
        engine.stop()
    return sent, crashes


class _Redis:
    """A redis-server of the bench's own on a free port, without persistence (a restart is empty),
    that the fault injector kills, stalls (SIGSTOP) and restarts."""

    def __init__(self, tmp: str) -> None:
        import shutil
        import socket

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise SystemExit("--store needs redis-server (Debian package redis-server)")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.tmp, self.proc, self.stalled = tmp, None, False
        import atexit

        atexit.register(self.reap)  # never left running by a run that stopped on an error

    def reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def start(self) -> None:
        import subprocess

        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                                      "--dir", self.tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    async def ready(self) -> None:
        import socket

        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError("the bench's redis-server did not start")

    def signal(self, sig) -> None:
        import os

        os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        import signal

        if self.stalled:
            self.signal(signal.SIGCONT)
            self.stalled = False
        self.proc.kill()
        self.proc.wait(10)


async def _read_log(store, sid: str) -> list[dict]:
    """The bench reads the log back like a client would: a timed-out read is retried."""
    from streamer.store import StoreError

    for _ in range(20):
        try:
            return await store.read_log(sid)
        except StoreError:
            await asyncio.sleep(0.5)
    return await store.read_log(sid)


async def fuzz_store(n: int, seed: int = 3, report=print, outcomes: dict | None = None) -> tuple[int, list[str]]:
    """Store faults under a stream: a producer pipelines `n` appends (with client_seq, resending
    from the first `store_unavailable` on, as the SDK does) while a second connection sends fuzzed
    messages, and a private Redis is killed and restarted empty, or stalled, every ~1.5 s. The
    oracle: every error is documented and none is `internal_error`; at the end every acked input
    is in the log exactly once, in client_seq order; a second worker that replays the log
    answers the question exactly as the first did."""
    import os
    import signal
    import tempfile
    from collections import OrderedDict

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    from websockets.asyncio.client import connect

    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model, embedded_model_dir
    from streamer.sessions.runner import ModelRunner

    codes = documented_codes()
    outcomes = outcomes if outcomes is not None else {}
    crashes: list[str] = []
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="streamer-fuzz-store-")
    redis = _Redis(tmp)
    redis.start()
    await redis.ready()
    url = f"redis://127.0.0.1:{redis.port}/0?socket_timeout=0.5&socket_connect_timeout=0.5"
    lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=3, max_positions=4096)
    engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name),
                    EngineLimits(max_context_tokens=4096, max_answer_tokens=16, max_sessions=32)).start()
    # no checkpoints on worker a: the check below reads every acked input back from the whole log
    # (a checkpoint compacts the records before it; tests/streamer/test_checkpoints.py holds those)
    relaxed = dict(messages_per_s=1e6, messages_burst=10**6, refused_per_s=1e6, refused_burst=10**6,
                   checkpoint_records=0)
    a = await StreamerServer(engine, ServerConfig(port=0, store_url=url, worker_id="a", **relaxed)).start()
    question = {"type": "query.create", "question": "What was the last row?", "max_tokens": 12, "stream": False}
    faults = {"killed": 0, "stalled": 0}
    done = asyncio.Event()

    def note(event: dict, where: str) -> None:
        key = event["error"]["code"] if event["type"] == "error" else event["type"]
        outcomes[key] = outcomes.get(key, 0) + 1
        if event["type"] == "error" and (key not in codes or key == "internal_error"):
            crashes.append(f"store fuzz ({where}): error {key}: {event['error']['message']}")

    async def inject() -> None:  # kill and restart empty, or stall, in turn
        # Each fault comes after 0.8-2 s or after the next 1/12-1/6 of the inputs is acked, whichever
        # is first: a fast engine gets through a short run between timed faults, the paced ones still hit it.
        gap, mark = max(20, n // 6), 0
        while not done.is_set():
            mark += rng.randint(gap // 2, gap)
            deadline = time.monotonic() + rng.uniform(0.8, 2.0)
            while not done.is_set() and len(acked) < mark and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if done.is_set():
                break
            if rng.random() < 0.5:
                redis.kill()
                faults["killed"] += 1
                await asyncio.sleep(rng.uniform(0.1, 0.6))
                redis.start()
                await redis.ready()
            else:
                redis.signal(signal.SIGSTOP)
                redis.stalled = True
                faults["stalled"] += 1
                await asyncio.sleep(rng.uniform(0.3, 1.2))
                redis.signal(signal.SIGCONT)
                redis.stalled = False

    async def fuzzer(ws, sid: str) -> None:  # fuzzed messages on their own session meanwhile
        while not done.is_set():
            await ws.send(generate(rng, [sid, sid, "nope"]))
            try:
                while True:
                    note(json.loads(await asyncio.wait_for(ws.recv(), 0.02)), "fuzz")
            except asyncio.TimeoutError:
                pass

    acked: dict[int, tuple[int, str]] = {}  # client_seq -> (seq, text)
    unacked: OrderedDict[int, str] = OrderedDict()
    try:
        producer = await connect(f"ws://127.0.0.1:{a.port}", max_size=None)
        while True:  # the store may be down already: retry the create like a client would
            await producer.send(json.dumps({"type": "session.create", "event_id": "c"}))
            created = json.loads(await producer.recv())
            if created["type"] == "session.created":
                break
            await asyncio.sleep(0.2)
        sid, token = created["session_id"], created["tokens"]["producer"]
        fuzz_ws = await connect(f"ws://127.0.0.1:{a.port}", max_size=None)
        await fuzz_ws.send(json.dumps({"type": "session.create", "event_id": "f"}))
        fuzz_sid = json.loads(await fuzz_ws.recv()).get("session_id", "nope")
        tasks = [asyncio.create_task(inject()), asyncio.create_task(fuzzer(fuzz_ws, fuzz_sid))]
        inflight, resend, sent, next_seq = set(), False, 0, 1

        async def send(cs: int) -> None:
            nonlocal sent
            await producer.send(json.dumps({"type": "input.text.append", "session_id": sid, "event_id": f"a{cs}",
                                            "client_seq": cs, "text": unacked[cs]}))
            inflight.add(cs)
            sent += 1

        while next_seq <= n or unacked:
            if not resend:
                while next_seq <= n and len(inflight) < 16:
                    unacked[next_seq] = f" Row {next_seq}: {rng.choice(['calm', 'wind', 'rain', 'fog'])}."
                    await send(next_seq)
                    next_seq += 1
            elif not inflight:  # every reply is in: resend from the first unacked, in order
                await asyncio.sleep(0.1)
                resend = False
                for cs in list(unacked):
                    await send(cs)
            event = json.loads(await asyncio.wait_for(producer.recv(), 60))
            note(event, "producer")
            cs = int(event["reply_to"][1:]) if str(event.get("reply_to", "")).startswith("a") else None
            if cs is None:
                continue
            inflight.discard(cs)
            if event["type"] == "input.ack":
                acked[cs] = (event.get("seq"), unacked.pop(cs, ""))
            elif event["type"] == "error" and event["error"]["code"] == "store_unavailable":
                resend = True
            else:
                crashes.append(f"store fuzz: append {cs} answered {event}")
                unacked.pop(cs, None)
            if report and cs % 1000 == 0 and event["type"] == "input.ack":
                report(f"  store: {len(acked)}/{n} inputs acked, faults {faults}")
        done.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if redis.stalled:
            redis.signal(signal.SIGCONT)
            redis.stalled = False
        await producer.send(json.dumps({**question, "session_id": sid, "event_id": "q"}))
        while (answer := json.loads(await asyncio.wait_for(producer.recv(), 60))).get("reply_to") != "q":
            pass
        for _ in range(40):  # a Redis restarted empty by the last fault is re-written at the next heartbeat (2 s)
            log = await _read_log(a.store, sid)
            logged = [r["text"] for r in applied(log) if r["kind"] == "append"]  # voided ones never took effect
            if len(logged) >= len(acked):
                break
            await asyncio.sleep(0.25)
        # inputs after a refused one are refused until it is resent: the log is in client_seq order
        expected = [text for _, (_, text) in sorted(acked.items())]
        if logged != expected:
            crashes.append(f"store fuzz: the log holds {len(logged)} appends, {len(expected)} were acked; "
                           f"first difference at {next((i for i, (x, y) in enumerate(zip(logged, expected)) if x != y), min(len(logged), len(expected)))}")
        # The fuzzing connection goes first: both are one client, and the sessions the fuzz made
        # would otherwise push the producer's (detached first, the oldest) past the per-client
        # detach cap, which closes it by design.
        await fuzz_ws.close()
        await asyncio.sleep(0.5)  # its sessions are detached (the server's side of the close)
        await producer.close()
    finally:
        done.set()
        await a.stop()
    b = await StreamerServer(engine, ServerConfig(port=0, store_url=url, worker_id="b")).start()
    try:  # a second worker replays the log: the same session, the same answer
        peer = await connect(f"ws://127.0.0.1:{b.port}", max_size=None)
        for _ in range(20):  # store_unavailable is recoverable: a client retries it, as the docs say
            await peer.send(json.dumps({"type": "session.resume", "session_id": sid, "token": token,
                                        "event_id": "r"}))
            resumed = json.loads(await asyncio.wait_for(peer.recv(), 300))
            if resumed["type"] != "error" or resumed["error"]["code"] != "store_unavailable":
                break
            outcomes["resume_retried"] = outcomes.get("resume_retried", 0) + 1
            await asyncio.sleep(0.5)
        if resumed["type"] != "session.resumed" or resumed["last_client_seq"] != n:
            log = await _read_log(b.store, sid)
            kinds = [r["kind"] for r in log]
            crashes.append(f"store fuzz: resume on a second worker gave {resumed}; the log holds {len(log)} "
                           f"records, first {kinds[:1]}, {kinds.count('close')} close, "
                           f"{kinds.count('void')} void; counters {a.events.counters}")
        else:
            await peer.send(json.dumps({**question, "session_id": sid, "event_id": "q"}))
            while (again := json.loads(await asyncio.wait_for(peer.recv(), 60))).get("reply_to") != "q":
                pass
            if again.get("text") != answer.get("text"):
                crashes.append(f"store fuzz: replayed answer {again.get('text')!r} != live {answer.get('text')!r}")
        await peer.close()
    finally:
        await b.stop()
        engine.stop()
        redis.kill()
    outcomes.update({f"faults_{k}": v for k, v in faults.items()})
    outcomes["appends_sent"] = sent
    return n, crashes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="inputs against the protocol core")
    parser.add_argument("--live", type=int, default=0, help="inputs over a socket to a real server")
    parser.add_argument("--flood", type=int, default=0, help="invalid frames flooded at a server at default limits")
    parser.add_argument("--store", type=int, default=0,
                        help="appends streamed while a private Redis is killed, restarted empty and stalled")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    outcomes: dict[str, int] = {}
    fuzzed, crashes = fuzz_core(args.n, args.seed, outcomes=outcomes)
    print(f"core: {fuzzed} inputs in {time.perf_counter() - t0:.1f} s, {len(crashes)} crashes")
    print("  outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items(), key=lambda kv: -kv[1])))
    if args.live:
        t1 = time.perf_counter()
        live_outcomes: dict[str, int] = {}
        live, live_crashes = asyncio.run(fuzz_live(args.live, args.seed + 1, outcomes=live_outcomes))
        print(f"live: {live} inputs in {time.perf_counter() - t1:.1f} s, {len(live_crashes)} crashes")
        print("  events: " + ", ".join(f"{k}={v}" for k, v in sorted(live_outcomes.items(), key=lambda kv: -kv[1])))
        fuzzed += live
        crashes += live_crashes
    if args.flood:
        t2 = time.perf_counter()
        flood_outcomes: dict[str, int] = {}
        flooded, flood_crashes = asyncio.run(fuzz_flood(args.flood, args.seed + 2, outcomes=flood_outcomes))
        print(f"flood: {flooded} invalid frames in {time.perf_counter() - t2:.1f} s, {len(flood_crashes)} crashes")
        print("  events: " + ", ".join(f"{k}={v}" for k, v in sorted(flood_outcomes.items(), key=lambda kv: -kv[1])))
        fuzzed += flooded
        crashes += flood_crashes
    if args.store:
        t3 = time.perf_counter()
        store_outcomes: dict[str, int] = {}
        stored, store_crashes = asyncio.run(fuzz_store(args.store, args.seed + 3, outcomes=store_outcomes))
        print(f"store: {stored} acked inputs under store faults in {time.perf_counter() - t3:.1f} s, "
              f"{len(store_crashes)} crashes")
        print("  events: " + ", ".join(f"{k}={v}" for k, v in sorted(store_outcomes.items(), key=lambda kv: -kv[1])))
        fuzzed += stored
        crashes += store_crashes
    for crash in crashes[:20]:
        print(crash)
    print(f"RESULT fuzzed={fuzzed} crashes={len(crashes)}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
