"""Flash staleness on a paced feed, and whether `flash.stale` says anything: a session with two
flash questions is fed one CSV row every 1/R s over the websocket for --seconds (R = 2 and 10
rows/s, as a sensor would), on the embedded model. Every evaluation's `staleness_ms` (from the
moment the data it saw was accepted to its answer, in `flash.updated` and `flash.evaluated`,
read by an engine listener) gives p50/p95, and the `flash.stale` events the client got are
counted.

Side by side in one run, each phase on a fresh engine over the same model: the staleness rule
of the service (time, scaled to the question's own evaluation cost: `flash_stale_s` 5 s or 4x
the cost, and an evaluation runs beside queued input once 0.25 s or its cost behind) against
the version rule it replaced (`flash_stale_versions=8`, `flash_stale_s=20`: a question 8
versions behind was pushed stale, which a 10 rows/s feed reaches in under a second while its
answers keep up).

    python bench/flash_paced.py [--seconds 30] [--model embedded]

Last line: `RESULT staleness_p95_10rps_s=<x> stale_10rps=<n> stale_10rps_versions8=<n>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

from streamer.app import build_runner  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402

QUESTIONS = ["Which station is the warmest right now?", "Is it windy anywhere?"]
STATIONS = ["north", "harbour", "airport", "hill", "valley"]
RULES = {"time": {}, "versions8": {"flash_stale_versions": 8, "flash_stale_s": 20.0}}


def row(i: int) -> str:
    return f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{STATIONS[i % 5]},{(i * 7) % 35 - 5}.5,{(i * 13) % 60}\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def paced(engine, url: str, rate: float, seconds: float) -> dict:
    """Feed one row every 1/rate s for `seconds`; the staleness of every evaluation (an engine
    listener: the client hears `flash.updated` only, when an answer changes) and the
    flash.stale events the client got."""
    async with connect(url, max_size=None) as ws:
        async def request(msg: dict) -> dict:
            msg = {**msg, "event_id": f"e{time.monotonic_ns()}"}
            await ws.send(json.dumps(msg))
            while True:
                event = json.loads(await ws.recv())
                if event.get("reply_to") == msg["event_id"]:
                    return event

        created = await request({"type": "session.create",
                                 "flash": [{"question": q, "max_tokens": 8} for q in QUESTIONS]})
        sid = created["session_id"]
        staleness, stale, evaluations, changed = [], [], 0, 0
        started = stop_at = float("inf")

        def evaluated(event: str, payload: dict) -> None:  # on the engine thread
            nonlocal evaluations
            if event in ("flash.updated", "flash.evaluated") and started <= time.monotonic() < stop_at:
                staleness.append(payload["staleness_ms"] / 1000)
                evaluations += 1

        engine.add_listener(sid, evaluated)
        for i in range(40):  # some data before the clock starts: the questions have something to read
            await request({"type": "input.text.append", "session_id": sid, "text": row(i)})
        started = time.monotonic()
        stop_at = started + seconds

        async def feed() -> None:
            i = 40
            while time.monotonic() < stop_at:
                await ws.send(json.dumps({"type": "input.text.append", "session_id": sid, "text": row(i)}))
                i += 1
                await asyncio.sleep(max(0.0, started + (i - 40) / rate - time.monotonic()))

        async def read() -> None:
            nonlocal changed
            while time.monotonic() < stop_at + 5:
                try:
                    event = json.loads(await asyncio.wait_for(ws.recv(), 1.0))
                except TimeoutError:
                    continue
                if event["type"] == "flash.updated" and time.monotonic() < stop_at:
                    changed += 1
                elif event["type"] == "flash.stale" and time.monotonic() < stop_at:
                    stale.append(event)

        await asyncio.gather(feed(), read())
        return {"staleness": staleness, "stale": stale, "evaluations": evaluations, "changed": changed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each phase (default: %(default)s)")
    parser.add_argument("--model", default="embedded", help="model spec (default: %(default)s)")
    args = parser.parse_args()
    runner = build_runner(args.model)
    phases = [("time", 2.0), ("time", 10.0), ("versions8", 10.0)]
    results = {}
    for rule, rate in phases:
        engine = Engine(runner, EngineLimits(**RULES[rule])).start()

        async def run() -> dict:
            server = await StreamerServer(engine, ServerConfig(port=0)).start()
            try:
                return await paced(engine, f"ws://127.0.0.1:{server.port}", rate, args.seconds)
            finally:
                await server.stop()

        try:
            r = asyncio.run(run())
        finally:
            engine.stop()
        results[(rule, rate)] = r
        s = r["staleness"]
        reasons = sorted({e["reason"] for e in r["stale"]})
        print(f"rule {rule:9s} {rate:4.0f} rows/s: {r['evaluations']:4d} answers ({r['changed']} changed), staleness p50 "
              f"{percentile(s, 0.5):.2f} s p95 {percentile(s, 0.95):.2f} s max {max(s, default=float('nan')):.2f} s, "
              f"flash.stale {len(r['stale'])} {reasons}", flush=True)
        if r["stale"]:
            print(f"    first: {r['stale'][0]['message']}")
    fast = results[("time", 10.0)]
    old = results[("versions8", 10.0)]
    mean = statistics.fmean(fast["staleness"]) if fast["staleness"] else float("nan")
    print(f"10 rows/s, time rule: staleness mean {mean:.2f} s; version rule: "
          f"p95 {percentile(old['staleness'], 0.95):.2f} s with {len(old['stale'])} flash.stale")
    print(f"RESULT staleness_p95_10rps_s={percentile(fast['staleness'], 0.95):.2f} stale_10rps={len(fast['stale'])} "
          f"stale_10rps_versions8={len(old['stale'])}")


if __name__ == "__main__":
    main()
