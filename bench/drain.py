"""What a drain saves: sessions moved with their KV cache versus re-read from their logs.

Side by side in this run, on one engine and one store (a file store in a temporary directory,
or --redis), the same workload twice: --sessions sessions on worker A each read --rows rows;
then A stops and worker B resumes every session.
  - baseline: A shuts down without a drain (what a stop did before): B replays each log,
    prefilling every input again;
  - drain: A drains (streamer.drain): B imports each session's handoff blob, prefilling
    nothing.
Reported per mode: the input tokens B read again (`reprefill_tokens` summed over the
`session.resumed` replies) and the seconds from A's stop to the last session resumed on B;
the drain's ratio of time to the baseline's, and the handoff bytes per session.

`run_drain(...)` is importable (bench/cluster.py prints its numbers with the cluster's).
Run: python bench/drain.py [--model embedded] [--sessions 4] [--rows 40] [--redis redis://127.0.0.1:6379/0]
The last line is `RESULT drain_reprefill_tokens=<n> drain_s=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

from streamer.app import build_engine  # noqa: E402
from streamer.drain import drain  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402

SYSTEM = "You watch a sensor feed. Answer in a few words."
FLASH = [{"question": "Is any reading out of range?", "max_tokens": 6}]


def rows(n: int) -> list[str]:
    return [f"t={i:04d} temperature {20 + (i * 7) % 5}.{i % 10} C, pressure {1000 + (i * 3) % 11} hPa, "
            f"valve {'open' if i % 4 else 'shut'}. " for i in range(n)]


async def request(ws, msg: dict) -> dict:
    msg = {**msg, "event_id": msg.get("event_id") or uuid.uuid4().hex[:12]}
    await ws.send(json.dumps(msg))
    while True:
        event = json.loads(await ws.recv())
        if event.get("reply_to") == msg["event_id"]:
            if event["type"] == "error":
                raise RuntimeError(f"{msg['type']}: {event['error']}")
            return event


async def feed(url: str, sessions: int, lines: list[str]) -> tuple[list, list[tuple[str, str]]]:
    """Open `sessions` sessions on `url`, each reading every line; (connections, [(id, token)])."""
    conns, made = [], []
    for _ in range(sessions):
        ws = await connect(url, max_size=None)
        created = await request(ws, {"type": "session.create", "system_prompt": SYSTEM, "flash": FLASH})
        for i, line in enumerate(lines, 1):
            await request(ws, {"type": "input.text.append", "session_id": created["session_id"], "text": line,
                               "client_seq": i})
        conns.append(ws)
        made.append((created["session_id"], created["tokens"]["producer"]))
    return conns, made


async def move(engine, store_url: str, sessions: int, lines: list[str], handoff: bool) -> dict:
    """Feed on worker A, stop A (drain or plain shutdown), resume everything on worker B."""
    a = await StreamerServer(engine, ServerConfig(port=0, store_url=store_url, worker_id="bench-a",
                                                  shutdown_grace_s=120)).start()
    conns, made = await feed(f"ws://127.0.0.1:{a.port}", sessions, lines)
    await asyncio.sleep(0.5)  # the flash answers of the last row settle
    start = time.perf_counter()
    done = await drain(a, reason="bench") if handoff else await a.shutdown()
    for ws in conns:
        await ws.close()
    b = await StreamerServer(engine, ServerConfig(port=0, store_url=store_url, worker_id="bench-b")).start()
    try:
        ws = await connect(f"ws://127.0.0.1:{b.port}", max_size=None)
        reprefill = 0
        for sid, token in made:
            resumed = await request(ws, {"type": "session.resume", "session_id": sid, "token": token})
            reprefill += resumed["reprefill_tokens"]
        seconds = time.perf_counter() - start
        await ws.close()
        return {"reprefill_tokens": reprefill, "seconds": seconds, "handoff_bytes": a.handoffs["handoff_bytes"],
                "handed_off": done.get("handed_off", 0)}
    finally:
        await b.stop()


async def run_drain(engine=None, model: str = "embedded", sessions: int = 4, rows_per_session: int = 40,
                    store_url: str | None = None) -> dict:
    """Both modes on the same engine and store kind (a coroutine). Returns {"baseline": ...,
    "drain": ...} (each: reprefill_tokens, seconds, handoff_bytes, handed_off), the ratio
    `drain_vs_baseline_s`, and `drain_reprefill_tokens` and `drain_s` for a RESULT line."""
    engine = engine or build_engine(model)
    lines = rows(rows_per_session)
    out = {}
    for mode in ("baseline", "drain"):
        with tempfile.TemporaryDirectory() as tmp:
            url = store_url or f"file://{tmp}/store"
            if store_url and store_url.startswith("redis://"):
                url = f"{store_url}?prefix=bench-drain-{uuid.uuid4().hex[:8]}"
            out[mode] = await move(engine, url, sessions, lines, handoff=mode == "drain")
    out["drain_vs_baseline_s"] = out["drain"]["seconds"] / out["baseline"]["seconds"]
    out["drain_reprefill_tokens"], out["drain_s"] = out["drain"]["reprefill_tokens"], out["drain"]["seconds"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--redis", default=None, help="redis://host:port/db (default: a file store)")
    args = parser.parse_args()
    out = asyncio.run(run_drain(model=args.model, sessions=args.sessions, rows_per_session=args.rows,
                                store_url=args.redis))
    base, moved = out["baseline"], out["drain"]
    print(f"{args.sessions} sessions x {args.rows} rows, stop worker A, resume all on worker B")
    print(f"  baseline (shutdown, replay): re-read {base['reprefill_tokens']} tokens, {base['seconds']:.2f} s")
    print(f"  drain (handoff with the KV): re-read {moved['reprefill_tokens']} tokens, {moved['seconds']:.2f} s, "
          f"{moved['handoff_bytes'] / max(1, moved['handed_off']) / 1e6:.2f} MB per session")
    print(f"  drain time / baseline time: {out['drain_vs_baseline_s']:.2f}x")
    print(f"RESULT drain_reprefill_tokens={moved['reprefill_tokens']} drain_s={moved['seconds']:.3f}")


if __name__ == "__main__":
    main()
