"""Endless live feed: a plain session under a steady CSV feed for minutes, with two flash questions,
once without thinking and once with dual thinking, on one in-process server (real websocket).

    python bench/endless.py                          # embedded model, 10 min per run, 1 row / 0.2 s
    python bench/endless.py --minutes 1 --model tiny  # quick
    python bench/endless.py --weights fp32            # the embedded model's weights unquantized

Measured side by side in the same process:
- ack latency p50/p99 (send to `input.ack`), and p99 of the acks whose input evicted old ones
  (`evicted_seqs`) against the acks that did not (target: within 2x);
- the cost of one slide (the window's `last_slide_ms`/`slide_ms_mean`: a copy and a key
  rotation) against re-prefilling the kept tokens (a fresh prefill of the session's kept ids,
  timed on the same engine thread right after the run) (target: the slide >= 20x cheaper);
- flash staleness p50/p99 (`staleness_ms` of each `flash.updated`, and the server's own
  per-session histogram of every evaluation), target p50 <= 2 s with 2 questions;
- RSS at minute 1 and at the end (flat).
Last line: `RESULT slide_vs_reprefill=<x> ack_p99_slide_vs_plain=<x> flash_staleness_p50_s=<x> rss_growth_mb=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STATIONS = ["north-pier", "harbour-gate", "airport-east", "hill-top", "valley-floor", "old-town"]
QUESTIONS = ["Which station is the warmest right now?", "Is the wind getting stronger?"]


def row(i: int, rnd: random.Random) -> str:
    """One CSV reading of about 46 tokens (the embedded tokenizer)."""
    t = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_764_000_000 + i))
    return (f"{t}Z,{STATIONS[i % len(STATIONS)]},temp_c={rnd.uniform(-5, 30):.1f},humidity={rnd.randint(20, 99)}%,"
            f"wind_kmh={rnd.randint(0, 80)},gust_kmh={rnd.randint(0, 110)},pressure_hpa={rnd.uniform(980, 1040):.1f}\n")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def feed(url: str, minutes: float, interval: float, thinking: bool, report, engine) -> dict:
    import websockets

    rnd = random.Random(1)
    async with websockets.connect(url, max_size=None, ping_interval=None) as ws:
        create = {"type": "session.create", "event_id": "c",
                  "flash": [{"question": q, "max_tokens": 12} for q in QUESTIONS]}
        if thinking:
            create["thinking"] = {"mode": "dual", "unit_tokens": 24}
        await ws.send(json.dumps(create))
        while True:
            msg = json.loads(await ws.recv())
            if msg.get("reply_to") == "c":
                break
        if msg["type"] != "session.created":
            raise RuntimeError(f"session.create failed: {msg}")
        sid = msg["session_id"]
        sent: dict[str, float] = {}
        acks: list[tuple[float, bool]] = []  # (latency s, evicted something)
        staleness: list[float] = []
        stale_events: list[dict] = []
        errors: list[dict] = []
        rss: list[tuple[float, float]] = []
        start = time.monotonic()
        deadline = start + minutes * 60

        async def reader():
            async for raw in ws:
                msg = json.loads(raw)
                kind = msg.get("type")
                if kind == "input.ack" and msg.get("reply_to") in sent:
                    acks.append((time.monotonic() - sent.pop(msg["reply_to"]), bool(msg.get("evicted_seqs"))))
                elif kind == "flash.updated":
                    staleness.append(msg["staleness_ms"] / 1000)
                elif kind == "flash.stale":
                    stale_events.append(msg)
                elif kind == "error":
                    errors.append(msg)

        lags: list[float] = []

        async def loop_lag():  # how late the event loop (server and client share it) wakes up
            while True:
                t = time.monotonic()
                await asyncio.sleep(0.1)
                lags.append(time.monotonic() - t - 0.1)

        task = asyncio.get_running_loop().create_task(reader())
        lag_task = asyncio.get_running_loop().create_task(loop_lag())
        i, next_at, next_report = 0, start, start + 30
        while time.monotonic() < deadline:
            eid = f"a{i}"
            sent[eid] = time.monotonic()
            await ws.send(json.dumps({"type": "input.text.append", "event_id": eid, "session_id": sid,
                                      "text": row(i, rnd), "client_seq": i + 1}))
            i += 1
            now = time.monotonic()
            if now - start >= 60 and not any(t >= 60 for t, _ in rss):
                rss.append((now - start, rss_mb()))
            if now >= next_report:
                lat = [a for a, _ in acks[-200:]]
                report(f"  {now - start:5.0f} s: {i} rows sent, {len(acks)} acked, ack p50 {pct(lat, .5) * 1000:.0f} ms, "
                       f"flash pushes {len(staleness)}, RSS {rss_mb():.0f} MB, loop lag max {max(lags, default=0):.2f} s")
                next_report += 30
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        for _ in range(600):  # let the last acks arrive
            if not sent:
                break
            await asyncio.sleep(0.1)
        rss.append((time.monotonic() - start, rss_mb()))
        # read the state from the engine itself: a session.get on this connection would wait
        # behind whatever backlog backpressure holds in the socket
        state = await asyncio.wrap_future(engine.session_state(sid))
        task.cancel()
        lag_task.cancel()
        return {"sid": sid, "acks": acks, "staleness": staleness, "stale": stale_events, "errors": errors,
                "rss": rss, "state": state, "rows": i, "unacked": len(sent)}


def reprefill_ms(engine, sid: str, repeats: int = 3) -> tuple[float, int]:
    """A fresh prefill of the session's kept tokens (what a re-prefilling slide would run),
    timed on the engine thread between its steps."""
    from streamer.sessions.runner import SeqStep

    def run():
        session = engine.sessions[sid]
        ids = session.context_ids()
        best = float("inf")
        for _ in range(repeats):
            cache = session.runner.new_cache(len(ids) + 1)
            t = time.perf_counter()
            for lo in range(0, len(ids), engine.limits.step_tokens):
                chunk = ids[lo:lo + engine.limits.step_tokens]
                session.runner.forward([SeqStep(cache, lo, chunk)], logits="last")
                cache.commit(lo + len(chunk))
            best = min(best, time.perf_counter() - t)
        return best * 1000, len(ids)

    return engine.call(run).result(600)


async def bench(model: str, minutes: float, interval: float, weights: str = "auto", report=print) -> dict:
    from streamer.app import build_runner
    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits

    runner = build_runner(model, weights=weights)
    report(f"model {runner.name}, weights {runner.weights.format}")
    engine = Engine(runner, EngineLimits(kv_budget_bytes=1 << 30)).start()
    server = await StreamerServer(engine, ServerConfig(port=0, ping_interval=None)).start()
    url = f"ws://127.0.0.1:{server.port}"
    out = {}
    try:
        for name, thinking in (("plain", False), ("dual", True)):
            report(f"{name}: {minutes:g} min, one row every {interval:g} s, 2 flash questions"
                   + (", dual thinking" if thinking else ""))
            run = await feed(url, minutes, interval, thinking, report, engine)
            run["reprefill_ms"], run["kept_tokens"] = await asyncio.to_thread(reprefill_ms, engine, run["sid"])
            hist = engine.metrics()["flash_staleness"].get(run["sid"])
            run["server_evaluations"] = hist[1] if hist else 0
            # a backlog the engine did not catch up with must not run into the next phase
            await asyncio.wrap_future(engine.close_session(run["sid"]))
            out[name] = summarize(name, run, report)
    finally:
        await server.stop()
        engine.stop()
    return out


def summarize(name: str, run: dict, report=print) -> dict:
    acks = run["acks"]
    plain = [a for a, ev in acks if not ev]
    sliding = [a for a, ev in acks if ev]
    window = run["state"]["window"] or {}
    slide_ms = window.get("slide_ms_mean") or float("nan")
    rss = run["rss"]
    growth = rss[-1][1] - rss[0][1] if len(rss) > 1 else float("nan")
    res = {"ack_p50_ms": pct([a for a, _ in acks], .5) * 1000, "ack_p99_ms": pct([a for a, _ in acks], .99) * 1000,
           "ack_p99_slide_ms": pct(sliding, .99) * 1000, "ack_p99_plain_ms": pct(plain, .99) * 1000,
           "slides": window.get("slides", 0), "slide_ms": slide_ms, "reprefill_ms": run["reprefill_ms"],
           "kept_tokens": run["kept_tokens"], "staleness_p50_s": pct(run["staleness"], .5),
           "staleness_p99_s": pct(run["staleness"], .99), "rss_growth_mb": growth}
    report(f"{name}: rows {run['rows']} sent, {len(acks)} acked ({run['unacked']} unacked), errors {len(run['errors'])}; "
           f"ack p50 {res['ack_p50_ms']:.0f} ms, p99 {res['ack_p99_ms']:.0f} ms "
           f"(with a slide {res['ack_p99_slide_ms']:.0f} ms over {len(sliding)}, without {res['ack_p99_plain_ms']:.0f} ms)")
    report(f"{name}: {res['slides']} slides, {slide_ms:.2f} ms each vs re-prefilling {res['kept_tokens']} kept tokens "
           f"{res['reprefill_ms']:.0f} ms (x{res['reprefill_ms'] / slide_ms:.0f})")
    report(f"{name}: flash pushes {len(run['staleness'])} (server evaluations {run['server_evaluations']}), "
           f"staleness p50 {res['staleness_p50_s']:.2f} s, p99 {res['staleness_p99_s']:.2f} s; "
           f"flash.stale events {len(run['stale'])}; thinking units {run['state']['thinking'].get('units', 0)}")
    report(f"{name}: RSS " + ", ".join(f"{t / 60:.1f} min {m:.0f} MB" for t, m in rss) + f" (growth {growth:+.0f} MB)")
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between rows (default: %(default)s)")
    parser.add_argument("--weights", default="auto", help="auto|fp32|bf16|int8|int4 (default: %(default)s)")
    args = parser.parse_args(argv)
    results = asyncio.run(bench(args.model, args.minutes, args.interval, args.weights))
    slide = statistics.median([r["reprefill_ms"] / r["slide_ms"] for r in results.values() if r["slides"]] or [0])
    ack = max(r["ack_p99_slide_ms"] / r["ack_p99_plain_ms"] for r in results.values())
    stale = results["plain"]["staleness_p50_s"]
    growth = max(r["rss_growth_mb"] for r in results.values())
    print(f"RESULT slide_vs_reprefill={slide:.1f} ack_p99_slide_vs_plain={ack:.2f} "
          f"flash_staleness_p50_s={stale:.2f} rss_growth_mb={growth:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
