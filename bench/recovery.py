"""Recovery in O(window): resume time of a long session versus a short one.

Two sessions on the same engine and the same kind of store, side by side in this run: one fed
--long rows (default 50,000), one fed --short rows (default 500), each row a short CSV line
logged through the server's event log (`EventLog.first`: logged, then applied; checkpoints and
compaction as configured) into a windowed session. Then each session is dropped from the
engine (what kill -9 leaves: the store only) and recovered through `streamer.recovery.restore`,
the code path `session.resume` and adoption run (read the log, restore the last checkpoint,
replay the records after it). Reported per session: resume time, records replayed, log and
blob bytes in the store; and the ratios long/short. Without checkpoints (--checkpoint-records
0) the long session replays its whole history (run it with a smaller --long to see).

Run: python bench/recovery.py [--model tiny] [--long 50000] [--short 500] [--store file|memory|redis://...]
     [--checkpoint-records 1000] [--checkpoint-min-records 16] [--rounds 3]
The last line is `RESULT resume_50k_vs_500=<x> log_bytes_50k_vs_500=<y>`.
`run_recovery(engine, rows, ...)` is importable: it streams one session and returns its numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamer.app import build_engine  # noqa: E402
from streamer.directory import Directory  # noqa: E402
from streamer.eventlog import DEFAULT_CHECKPOINT_MIN_RECORDS, DEFAULT_CHECKPOINT_RECORDS, EventLog  # noqa: E402
from streamer.recovery import restore  # noqa: E402
from streamer.records import Append, Create  # noqa: E402
from streamer.store import open_store  # noqa: E402

WINDOW = {"max_tokens": 900, "keep_tokens": 650}
BATCH = 64  # rows in flight at once (a pipelining client)


def row(i: int) -> str:
    return f"{i:06d},station-{i % 7},{(i * 7) % 31 - 5}.{i % 10},{i % 97}\n"


async def store_bytes(store, sid: str) -> tuple[int, int]:
    """(log bytes, bytes of the blobs the log names) in the store."""
    records = await store.read_log(sid)
    log_bytes = sum(len(json.dumps(r, separators=(",", ":"))) + 1 for r in records)
    blobs = {r["blob"] for r in records if isinstance(r.get("blob"), str)}
    blob_bytes = 0
    for digest in blobs:
        data = await store.get_blob(digest)
        blob_bytes += len(data) if data is not None else 0
    return log_bytes, blob_bytes


async def run_recovery(engine, rows: int, store_url: str | None = None, *, window: dict | None = None,
                       checkpoint_records: int = DEFAULT_CHECKPOINT_RECORDS,
                       checkpoint_min_records: int = DEFAULT_CHECKPOINT_MIN_RECORDS, rounds: int = 1,
                       progress=None) -> dict:
    """Stream `rows` rows into a new session through an EventLog on `store_url` (None: a fresh
    temporary directory), drop the session from the engine, and recover it `rounds` times (after
    one uncounted warm-up recovery).
    Returns {rows, ingest_s, resume_s (median), resume_all, replayed_records, log_records,
    log_bytes, blob_bytes, checkpoints, tokens}."""
    tmp = None
    if store_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="recovery-bench-")
        store_url = tmp.name
    store = await open_store(store_url, worker_id=f"bench-{uuid.uuid4().hex[:6]}").start()
    try:
        events = EventLog(store, Directory(False, 1 << 20), engine=engine, checkpoint_records=checkpoint_records,
                          checkpoint_min_records=checkpoint_min_records)
        sid = f"recovery-{rows}-{uuid.uuid4().hex[:8]}"
        create = Create(window=window or WINDOW)
        await asyncio.wrap_future(create.apply(engine, sid))
        await events.created(sid, create)
        start = time.perf_counter()
        for first in range(1, rows + 1, BATCH):
            tasks = []
            for i in range(first, min(rows, first + BATCH - 1) + 1):
                record = Append(text=row(i), client_seq=i)
                tasks.append(events.first(sid, record, lambda r=record: r.apply(engine, sid), i))
            await asyncio.gather(*tasks)
            if progress is not None:
                progress(min(rows, first + BATCH - 1))
        await events.drain()
        ingest_s = time.perf_counter() - start
        live = await asyncio.wrap_future(engine.session_state(sid))
        events.forget(sid)
        await asyncio.wrap_future(engine.close_session(sid))  # what kill -9 leaves: the store
        log_bytes, blob_bytes = await store_bytes(store, sid)
        times, replayed = [], 0
        for k in range(rounds + 1):  # the first one warms up (allocations, the store's caches): not counted
            t0 = time.perf_counter()
            out = await restore(engine, store, sid)
            if k:
                times.append(time.perf_counter() - t0)
            replayed = out["records"]
            state = out["state"]
            if (state["last_seq"], state["tokens"]) != (live["last_seq"], live["tokens"]):
                raise RuntimeError(f"recovered {state['last_seq']}/{state['tokens']}, live was "
                                   f"{live['last_seq']}/{live['tokens']}")
            await asyncio.wrap_future(engine.close_session(sid))
        return {"rows": rows, "ingest_s": ingest_s, "resume_s": statistics.median(times), "resume_all": times,
                "replayed_records": replayed, "log_records": len(await store.read_log(sid)),
                "log_bytes": log_bytes, "blob_bytes": blob_bytes, "checkpoints": events.counters["checkpoints"],
                "tokens": live["tokens"]}
    finally:
        await store.close()
        if tmp is not None:
            tmp.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--long", type=int, default=50_000)
    parser.add_argument("--short", type=int, default=500)
    parser.add_argument("--store", default="file", help="file (a temporary directory), memory, or a redis:// URL")
    parser.add_argument("--checkpoint-records", type=int, default=DEFAULT_CHECKPOINT_RECORDS)
    parser.add_argument("--checkpoint-min-records", type=int, default=DEFAULT_CHECKPOINT_MIN_RECORDS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    engine = build_engine(args.model, threads=args.threads)
    url = {"file": None, "memory": "memory:"}.get(args.store, args.store)

    async def both():
        out = {}
        for name, rows in (("short", args.short), ("long", args.long)):
            step = max(BATCH, rows // 10 // BATCH * BATCH)
            out[name] = await run_recovery(
                engine, rows, url, checkpoint_records=args.checkpoint_records,
                checkpoint_min_records=args.checkpoint_min_records, rounds=args.rounds,
                progress=lambda n, rows=rows, step=step: n % step == 0 and print(f"  {n}/{rows} rows", flush=True))
        return out

    try:
        out = asyncio.run(both())
    finally:
        engine.stop()
    for name in ("short", "long"):
        r = out[name]
        print(f"{name:5s} {r['rows']:>6d} rows: ingest {r['ingest_s']:.1f} s, resume {r['resume_s'] * 1000:.1f} ms "
              f"(runs {', '.join(f'{t * 1000:.1f}' for t in r['resume_all'])}), replayed {r['replayed_records']} "
              f"records, log {r['log_records']} records / {r['log_bytes']} B, blobs {r['blob_bytes']} B, "
              f"{r['checkpoints']} checkpoints, window {r['tokens']} tokens")
    s, lg = out["short"], out["long"]
    resume = lg["resume_s"] / s["resume_s"]
    log_ratio = lg["log_bytes"] / s["log_bytes"]
    stored = (lg["log_bytes"] + lg["blob_bytes"]) / (s["log_bytes"] + s["blob_bytes"])
    print(f"long/short: resume {resume:.2f}x, log bytes {log_ratio:.2f}x, log+blob bytes {stored:.2f}x "
          f"(rows {lg['rows'] / s['rows']:.0f}x)")
    print(f"RESULT resume_50k_vs_500={resume:.2f} log_bytes_50k_vs_500={log_ratio:.2f}")


if __name__ == "__main__":
    main()
