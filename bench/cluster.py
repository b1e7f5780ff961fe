"""Failover behind one address: HAProxy in front of 3 workers on loopback, kill -9 one of them.

24 sessions (ids chosen by the client, so HAProxy's hash on ?session= places them) stream rows,
each with a flash question, through `streamer.clients.failover.ClusterSession`. Then the worker
holding the most sessions is killed with SIGKILL while every session keeps going: each asks a
question at once (the SDK reconnects through the same URL and resumes), then streams the rest
of its rows and asks the final question. Reported:

- failover p50 / p99: from the kill to the first answer of each session that was on the killed
  worker (the heartbeat TTL, the adoption sweep and the replay of its log are in it);
- lost: acknowledged inputs missing from the logs in Redis (each client_seq is read back);
- answers equal control: every session's final answer equals that of a control session (same
  input, created after the failover, never moved) - the baseline run in the same process;
- resume_50k_vs_500: bench/recovery.py `run_recovery` on a 500-row and a `--recovery-rows`-row
  session (default 50,000; 0 skips it and prints nan), resume time of the long over the short;
- drain_reprefill_tokens: bench/drain.py `run_drain` (tokens read again when a SIGTERM'd
  worker's sessions move to another; a plain stop's replay is its baseline).

Run: python bench/cluster.py [--sessions 24] [--rows 12] [--model tiny] [--redis redis://127.0.0.1:6379/0]
     [--worker-ttl 6] [--recovery-rows 50000]
The last line is `RESULT failover_p50_s=<x> failover_p99_s=<x> resume_50k_vs_500=<x> drain_reprefill_tokens=<n> lost=<n>`.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import redis  # noqa: E402

from streamer.app import build_engine  # noqa: E402
from streamer.clients.failover import ClusterSession  # noqa: E402
from streamer.cluster import LocalCluster  # noqa: E402

SYSTEM = "You are a harbour master's assistant."
FLASH = [{"question": "How fast is the wind?", "max_tokens": 6, "end_bias": 0.0, "frequency_penalty": 0.0}]
ASK = {"max_tokens": 8, "end_bias": 0.0, "frequency_penalty": 0.0}
QUESTION = "How fast is the wind at buoy 2?"


def rows(n: int) -> list[str]:
    return [f"row {i}: buoy {i % 3} reads {17 + i} knots from the {'north' if i % 2 else 'west'}. "
            for i in range(1, n + 1)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream(session: ClusterSession, feed: list[str], acked: list[int]) -> None:
    for text in feed:
        seq = session.session.next_client_seq
        await session.append(text)
        acked.append(seq)


async def run(args: argparse.Namespace, cluster: LocalCluster, r: redis.Redis, prefix: str) -> dict:
    feed = rows(args.rows)
    half = args.rows // 2
    sessions = await asyncio.gather(*(ClusterSession.create(cluster.url, session_id=f"bench-{i}",
                                                            system_prompt=SYSTEM, flash=[dict(q) for q in FLASH])
                                      for i in range(args.sessions)))
    acked: dict[str, list[int]] = {s.id: [] for s in sessions}
    await asyncio.gather(*(stream(s, feed[:half], acked[s.id]) for s in sessions))
    owners = {s.id: r.get(f"{prefix}:owner:{s.id}") for s in sessions}
    victim = max(set(owners.values()), key=list(owners.values()).count)
    moved = {sid for sid, w in owners.items() if w == victim}
    print(f"{len(sessions)} sessions on {len(set(owners.values()))} workers; killing {victim} "
          f"({len(moved)} sessions)", flush=True)

    failover: dict[str, float] = {}
    cluster.kill(int(victim.split("-")[0][1:]) - 1)
    killed_at = time.monotonic()

    async def after(s: ClusterSession) -> str:
        await s.ask(QUESTION, **ASK)
        if s.id in moved:
            failover[s.id] = time.monotonic() - killed_at
        await stream(s, feed[half:], acked[s.id])
        return (await s.ask(QUESTION, **ASK)).text

    finals = await asyncio.gather(*(after(s) for s in sessions))
    control = await ClusterSession.create(cluster.url, session_id="bench-control", system_prompt=SYSTEM,
                                          flash=[dict(q) for q in FLASH])
    await stream(control, feed, [])
    expected = (await control.ask(QUESTION, **ASK)).text
    lost = 0
    for s in sessions:
        logged = {json.loads(f["r"]).get("client_seq") for _, f in r.xrange(f"{prefix}:log:{s.id}")}
        lost += sum(1 for seq in acked[s.id] if seq not in logged)
    equal = sum(1 for text in finals if text == expected)
    for s in [*sessions, control]:
        await s.close()
    return {"failover": list(failover.values()), "lost": lost, "equal": equal, "sessions": len(sessions),
            "moved": len(moved)}


def load_bench(name: str):
    """bench/<name>.py as a module (its `run_*` functions)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def resume_ratio(model: str, short: int, long: int) -> float:
    """bench/recovery.py's figure: resume time of a `long`-row session over a `short`-row one."""
    recovery = load_bench("recovery")
    engine = build_engine(model)

    async def both():
        out = {}
        for rows in (short, long):
            step = max(1000, rows // 10)
            out[rows] = await recovery.run_recovery(
                engine, rows, None, rounds=3,
                progress=lambda n, rows=rows, step=step: n % step == 0 and print(f"  recovery: {n}/{rows} rows",
                                                                                 flush=True))
        return out

    try:
        out = asyncio.run(both())
    finally:
        engine.stop()
    for rows, r in out.items():
        print(f"recovery of a {rows}-row session: resume {r['resume_s'] * 1000:.1f} ms, replayed "
              f"{r['replayed_records']} records, log {r['log_bytes']} B + blobs {r['blob_bytes']} B", flush=True)
    return out[long]["resume_s"] / out[short]["resume_s"]


def drain_tokens(model: str) -> int:
    """bench/drain.py's figure: tokens read again when a drained worker's sessions move."""
    out = asyncio.run(load_bench("drain").run_drain(model=model, sessions=4, rows_per_session=20))
    print(f"drain: {out['drain']['handed_off']} sessions handed over, {out['drain_reprefill_tokens']} tokens read "
          f"again (a plain stop and replay: {out['baseline']['reprefill_tokens']})", flush=True)
    return int(out["drain_reprefill_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=24)
    parser.add_argument("--rows", type=int, default=12)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--worker-ttl", type=float, default=None,
                        help="the workers' heartbeat TTL in seconds (default: the server's, 6)")
    parser.add_argument("--recovery-rows", type=int, default=50_000,
                        help="rows of the long session whose resume is compared with a 500-row one's (0: skip)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stop the cluster on the way out
    prefix = f"streamer-bench-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(args.redis, decode_responses=True)
    started = time.monotonic()
    with LocalCluster(3, f"{args.redis}?prefix={prefix}", f"127.0.0.1:{free_port()}",
                      ["--model", args.model, "--threads", "1", "--detach-ttl", "600",
                       *(["--worker-ttl", str(args.worker_ttl)] if args.worker_ttl else [])]) as cluster:
        print(f"cluster up in {time.monotonic() - started:.1f} s: {cluster.url} -> {cluster.worker_urls}", flush=True)
        out = asyncio.run(run(args, cluster, r, prefix))
    keys = list(r.scan_iter(f"{prefix}:*"))
    if keys:
        r.delete(*keys)
    times = out["failover"]
    p50, p99 = (statistics.median(times) if times else math.nan), percentile(times, 0.99)
    print(f"failover of {out['moved']} sessions: p50 {p50:.2f} s, p99 {p99:.2f} s, max {max(times or [math.nan]):.2f} s "
          f"(up to the heartbeat TTL, {args.worker_ttl or 6:g} s, of it: a dead worker's sessions are adoptable "
          "once its key expires; then the 1 s sweep, the replay and the client's backoff)")
    print(f"answers equal control: {out['equal']}/{out['sessions']}; lost acked inputs: {out['lost']}")
    resume = resume_ratio(args.model, 500, args.recovery_rows) if args.recovery_rows else math.nan
    drain = drain_tokens(args.model)
    drain_text = str(drain)
    print(f"RESULT failover_p50_s={p50:.2f} failover_p99_s={p99:.2f} resume_50k_vs_500={resume:.2f} "
          f"drain_reprefill_tokens={drain_text} lost={out['lost']}")


if __name__ == "__main__":
    main()
