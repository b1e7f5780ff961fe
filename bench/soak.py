"""Soak: N sessions for M minutes on loopback, mixed traffic, errors/latency/memory over time.

    python bench/soak.py --sessions 8 --minutes 10            # the embedded model
    python bench/soak.py --sessions 4 --minutes 1 --model tiny  # quick (a tiny random model)

Each session is a producer connection that streams text (appends, with a revise now and then),
registers flash questions, asks questions with a deadline, and is watched by a subscriber
connection with a read-only token; with the media extra installed, producers also send JPEG
frames. Sessions are closed and replaced as the run goes (churn), so creation and teardown are
soaked too. Every error event or failed request counts as an error. Latency is request to
reply (input.ack, query.done); p99 is reported per window. Memory is the process RSS (the
server runs in this process), sampled through the run; growth is RSS after every session has
closed minus RSS after a warm-up session, so it shows what the service kept.
Last line: `RESULT sessions=<n> minutes=<x> errors=<n> p99_s=<x> mem_growth_mb=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

LOG_LINES = [line.strip() for line in (Path(__file__).resolve().parents[1] / "streamer" / "data" /
                                       "lighthouse_log.txt").read_text().splitlines() if line.strip()]
QUESTIONS = ["What is the weather?", "Who is on duty?", "Is the lamp lit?", "What happened last?"]
FLASH = ["Is there a storm?", "Is a ship in sight?"]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def release_memory() -> None:
    gc.collect()
    try:  # hand freed heap pages back to the OS so RSS reflects what is still held
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@dataclass
class Stats:
    started: float = field(default_factory=time.monotonic)
    latencies: list[tuple[float, str, float]] = field(default_factory=list)  # (t, kind, seconds)
    errors: list[str] = field(default_factory=list)
    memory: list[tuple[float, float]] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    sessions_run: int = 0

    def op(self, kind: str, seconds: float | None = None) -> None:
        self.ops[kind] = self.ops.get(kind, 0) + 1
        if seconds is not None:
            self.latencies.append((time.monotonic() - self.started, kind, seconds))


def held(obj: object, depth: int = 3) -> str:
    """What keeps `obj` alive, as a chain of referrer types (frames and this function's own
    lists left out): the first thing to read when a session or connection outlives its close."""
    chain, current = [type(obj).__name__], obj
    for _ in range(depth):
        referrers = [r for r in gc.get_referrers(current)
                     if not isinstance(r, type(sys._getframe())) and r is not chain]
        if not referrers:
            break
        previous, current = current, referrers[0]
        name = type(current).__name__
        if isinstance(current, dict):
            keys = [k for k, v in current.items() if v is previous][:2]
            name += f"{keys}" if keys else ""
        chain.append(name)
    return " <- ".join(chain)


def p99(values: list[float]) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


class Peer:
    """A websocket client that matches replies by event_id and collects pushed events."""

    def __init__(self, ws, stats: Stats, name: str) -> None:
        self.ws, self.stats, self.name = ws, stats, name
        self.waiting: dict[str, asyncio.Future] = {}
        self.pushed: dict[str, int] = {}
        self.ids = iter(range(1, 1 << 62))
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            async for raw in self.ws:
                if isinstance(raw, bytes):
                    continue
                event = json.loads(raw)
                if event["type"] == "error":
                    self.stats.errors.append(f"{self.name}: {event['error']['code']}: {event['error']['message']}")
                fut = self.waiting.get(event.get("reply_to"))
                if fut is not None and event["type"] != "query.delta" and not fut.done():
                    fut.set_result(event)
                elif fut is None:
                    self.pushed[event["type"]] = self.pushed.get(event["type"], 0) + 1
        except ConnectionClosed as exc:
            if exc.rcvd is None or exc.rcvd.code not in (1000, 1001):
                self.stats.errors.append(f"{self.name}: connection closed: {exc}")

    async def request(self, msg: dict, kind: str, timeout: float = 120.0) -> dict | None:
        eid = f"{kind}{next(self.ids)}"
        fut = self.waiting[eid] = asyncio.get_running_loop().create_future()
        start = time.perf_counter()
        try:
            await self.ws.send(json.dumps({**msg, "event_id": eid}))
            reply = await asyncio.wait_for(fut, timeout)
        except Exception as exc:  # a timeout or a dead connection is an error of the run
            self.stats.errors.append(f"{self.name}: {kind} failed: {exc!r}")
            return None
        finally:
            self.waiting.pop(eid, None)
        self.stats.op(kind, time.perf_counter() - start)
        return None if reply["type"] == "error" else reply

    async def close(self) -> None:
        await self.ws.close()
        await asyncio.wait({self.reader}, timeout=10)


def jpeg_frame(rng: random.Random, sid: str, seq: int, ts: float) -> bytes | None:
    """A media frame (issue 7 wire format) carrying a small JPEG, if PyAV and the media path exist."""
    try:
        import io
        import struct

        import av  # noqa: F401  (the media path the frame goes to)
        from PIL import Image
    except ImportError:
        return None
    img = Image.new("RGB", (64, 48), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    header = json.dumps({"session_id": sid, "kind": "image", "format": "jpeg", "seq": seq, "ts": ts}).encode()
    return struct.pack(">I", len(header)) + header + buf.getvalue()


async def session_life(url: str, stats: Stats, deadline: float, rng: random.Random, index: int,
                       media: bool, max_tokens: int) -> None:
    from websockets.asyncio.client import connect

    while time.monotonic() < deadline:
        producer = Peer(await connect(url, max_size=None), stats, f"s{index}")
        created = await producer.request({"type": "session.create", "flash": [{"question": q, "max_tokens": 4}
                                                                             for q in FLASH]}, "create")
        if created is None:
            await producer.close()
            return
        stats.sessions_run += 1
        sid = created["session_id"]
        watcher = Peer(await connect(url, max_size=None), stats, f"w{index}")
        await watcher.request({"type": "subscribe", "session_id": sid, "token": created["tokens"]["subscriber"]},
                              "subscribe")
        life_end = min(deadline, time.monotonic() + rng.uniform(15, 40))  # churn: sessions come and go
        step, media_seq = 0, 0
        while time.monotonic() < life_end:
            step += 1
            line = rng.choice(LOG_LINES)
            if step % 7 == 0:
                await producer.request({"type": "input.text.revise", "session_id": sid, "text": " " + line},
                                       "revise")
            else:
                await producer.request({"type": "input.text.append", "session_id": sid, "text": " " + line},
                                       "append")
            if step % 3 == 0:
                await producer.request({"type": "query.create", "session_id": sid, "question": rng.choice(QUESTIONS),
                                        "max_tokens": max_tokens, "stream": rng.random() < 0.5}, "query")
            if step % 5 == 0:
                await watcher.request({"type": "session.get", "session_id": sid}, "state")
            if media and step % 2 == 0:
                media_seq += 1
                frame = jpeg_frame(rng, sid, media_seq, time.time())
                if frame is not None:
                    await producer.ws.send(frame)
                    stats.op("media")
            state = await producer.request({"type": "session.get", "session_id": sid}, "state")
            if state and state["session"]["tokens"] > 0.7 * state["session"].get("context_window", 1 << 30):
                break  # near the window: start a new session
            await asyncio.sleep(rng.uniform(0.05, 0.4))
        await producer.request({"type": "session.close", "session_id": sid}, "close")
        for peer in (watcher, producer):
            await peer.close()


async def sampler(stats: Stats, stop: asyncio.Event) -> None:
    while not stop.is_set():
        stats.memory.append((time.monotonic() - stats.started, rss_mb()))
        try:
            await asyncio.wait_for(stop.wait(), 2.0)
        except asyncio.TimeoutError:
            pass


async def soak(sessions: int, minutes: float, model: str = "embedded", seed: int = 0, media: bool = True,
               window_s: float = 10.0, report=print, kv_budget_mb: int = 512) -> dict:
    """The KV pool is one preallocated tensor whose pages the OS maps as blocks are first used,
    so RSS climbs towards the pool size as sessions come and go; a fixed budget (512 MiB by
    default) keeps that climb bounded and visible instead of spread over half the memory."""
    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.runner import ModelRunner

    if model == "tiny":
        from transformers import AutoTokenizer

        from streamer.sessions.models import build_tiny_model, embedded_model_dir

        lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=5)
        max_tokens = 8
    else:
        from streamer.sessions.models import load_model

        lm = load_model(model)
        max_tokens = 16
    engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name),
                    EngineLimits(max_context_tokens=2048, max_sessions=max(64, 2 * sessions),
                                 kv_budget_bytes=kv_budget_mb << 20)).start()
    from streamer.server import Connection
    from streamer.sessions.session import Session

    # sessions and connections alive before the soak (another engine's in the same process, a
    # test run before this one) are not the soak's to account for: held here so their ids stay theirs
    earlier = [o for o in gc.get_objects() if type(o) in (Session, Connection)]
    earlier_ids = {id(o) for o in earlier}
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    url = f"ws://127.0.0.1:{server.port}"
    stats = Stats()
    rng = random.Random(seed)
    try:
        # warm-up: the same load for a while (a quarter of the run, 5-30 s), so lazy imports,
        # allocator pools and caches of every shape in use are in the baseline; growth after
        # that is what the service kept
        warm_until = time.monotonic() + min(30.0, max(5.0, minutes * 15))
        await asyncio.gather(*(session_life(url, Stats(), warm_until, random.Random(seed + 99 + i), i, media,
                                            max_tokens) for i in range(sessions)))
        release_memory()
        baseline = rss_mb()
        blocks0 = sys.getallocatedblocks()
        stats.started = time.monotonic()
        stop = asyncio.Event()
        mem_task = asyncio.get_running_loop().create_task(sampler(stats, stop))
        deadline = time.monotonic() + minutes * 60
        await asyncio.gather(*(session_life(url, stats, deadline, random.Random(rng.random()), i, media, max_tokens)
                               for i in range(sessions)))
        stop.set()
        await mem_task
        for _ in range(100):  # every connection has gone and every session closed
            if not server.connections and engine.snapshot_stats()["sessions"] == 0:
                break
            await asyncio.sleep(0.1)
        release_memory()
        final = rss_mb()
        blocks = sys.getallocatedblocks() - blocks0
        live_sessions = engine.snapshot_stats()["sessions"]
        left: list = []
        for attempt in range(200):  # connection tasks finish their cleanup just after the last close
            left = [o for o in gc.get_objects() if type(o) in (Session, Connection) and id(o) not in earlier_ids]
            if not left or attempt == 199:
                break
            left = []
            await asyncio.sleep(0.1)
            gc.collect()
        leftovers = len(left)
        held_by = [held(o) for o in left]
        left = earlier = None
    finally:
        await server.stop()
        engine.stop()
    elapsed = time.monotonic() - stats.started
    windows = []
    for w in range(int(elapsed // window_s) + 1):
        lat = [s for t, _, s in stats.latencies if w * window_s <= t < (w + 1) * window_s]
        mem = [m for t, m in stats.memory if w * window_s <= t < (w + 1) * window_s]
        if lat or mem:
            windows.append({"t_s": w * window_s, "ops": len(lat), "p99_s": round(p99(lat), 3),
                            "rss_mb": round(max(mem), 1) if mem else None})
    result = {
        "sessions": sessions, "sessions_run": stats.sessions_run, "minutes": round(elapsed / 60, 2),
        "errors": len(stats.errors), "error_samples": stats.errors[:10],
        "p99_s": round(p99([s for _, _, s in stats.latencies]), 3),
        "p99_by_kind": {k: round(p99([s for _, kk, s in stats.latencies if kk == k]), 3) for k in sorted(stats.ops)},
        "ops": dict(stats.ops), "baseline_mb": round(baseline, 1), "peak_mb": round(max(m for _, m in stats.memory), 1),
        "final_mb": round(final, 1), "mem_growth_mb": round(final - baseline, 1), "windows": windows,
        "sessions_left": live_sessions, "objects_left": leftovers, "objects_held_by": held_by, "py_blocks_growth": blocks,
        "rss_growth_second_half_mb": _half_growth(stats.memory),
    }
    if report:
        report(f"{'t (s)':>7} {'ops':>6} {'p99 (s)':>8} {'rss (MB)':>9}")
        for w in windows:
            report(f"{w['t_s']:>7.0f} {w['ops']:>6} {w['p99_s']:>8.3f} {w['rss_mb'] or 0:>9.1f}")
        report(f"ops: {result['ops']}")
        report(f"p99 by kind (s): {result['p99_by_kind']}")
        report(f"memory: baseline {result['baseline_mb']} MB, peak {result['peak_mb']} MB, after close "
               f"{result['final_mb']} MB (growth {result['mem_growth_mb']} MB, of it {result['rss_growth_second_half_mb']} "
               f"MB in the second half of the run); Python heap blocks {blocks:+d}; sessions left {live_sessions}, "
               f"session/connection objects left {leftovers}")
        for e in result["error_samples"]:
            report(f"error: {e}")
    return result


def _half_growth(memory: list[tuple[float, float]]) -> float | None:
    """RSS growth over the second half of the run: a leak keeps its slope, a cache flattens."""
    if len(memory) < 4:
        return None
    half = memory[len(memory) // 2:]
    return round(half[-1][1] - half[0][1], 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--model", default="embedded", help="'embedded' (default) or 'tiny' (random weights)")
    parser.add_argument("--no-media", action="store_true", help="text only")
    parser.add_argument("--kv-budget-mb", type=int, default=512, help="KV pool size (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    r = asyncio.run(soak(args.sessions, args.minutes, args.model, args.seed, media=not args.no_media,
                         kv_budget_mb=args.kv_budget_mb))
    print(f"RESULT sessions={r['sessions']} minutes={r['minutes']} errors={r['errors']} p99_s={r['p99_s']} "
          f"mem_growth_mb={r['mem_growth_mb']}")
    return 1 if r["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
