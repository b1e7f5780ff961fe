"""Many sessions on one model: the batched scheduler versus serving sessions one at a time.

Each session streams its own text in small appends (--chunk-tokens, like transcript lines or
messages) and asks a question with an 8-token answer every --ask-every appends, at a
different phase per session. The same workload runs through one engine twice in this run:
  - batched: every session's client runs at once; the engine packs their work into steps;
  - serial: one session at a time, start to finish.
Reported: aggregate ingest tokens/s, p50/p99 question latency (batched, under ingest load)
versus an idle session's, and the pool's KV bytes per token against the physical size
(layers x 2 x kv_heads x head_dim x dtype bytes).

Run: python bench/multisession.py [--sessions 1,4,16,32] [--chunks 8] [--chunk-tokens 32]
The last line is `RESULT throughput16_vs_serial=<x> p99_loaded_vs_idle=<x> kv_bytes_vs_physical=<x>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402
from streamer.sessions.models import load_model  # noqa: E402
from streamer.sessions.runner import ModelRunner  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402

QUESTION = "What is the supply boat called?"
ANSWER = SamplingParams(max_tokens=8)


def texts(runner, sessions: int, chunks: int, chunk_tokens: int) -> list[list[str]]:
    """Per session, `chunks` pieces of about `chunk_tokens` tokens, each session from its own
    place in the bundled log."""
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    ids = runner.tokenizer(text, add_special_tokens=False)["input_ids"]
    out = []
    for s in range(sessions):
        start = (s * 97) % (len(ids) - chunks * chunk_tokens)
        out.append([runner.tokenizer.decode(ids[start + i * chunk_tokens:start + (i + 1) * chunk_tokens])
                    for i in range(chunks)])
    return out


def drive_session(engine: Engine, pieces: list[str], phase: int, ask_every: int, latencies: list, ingested: list):
    sid = engine.create_session().result()["session_id"]
    for i, piece in enumerate(pieces):
        ingested.append(engine.append(sid, piece).result().tokens)
        if (i + phase) % ask_every == ask_every - 1:
            started = time.perf_counter()
            engine.query(sid, QUESTION, ANSWER).future.result()
            latencies.append(time.perf_counter() - started)
    return sid


def run(engine: Engine, work: list[list[str]], ask_every: int, batched: bool) -> dict:
    latencies: list[float] = []
    ingested: list[int] = []
    started = time.perf_counter()
    if batched:
        threads = [threading.Thread(target=drive_session, args=(engine, p, i, ask_every, latencies, ingested))
                   for i, p in enumerate(work)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i, p in enumerate(work):
            drive_session(engine, p, i, ask_every, latencies, ingested)
    elapsed = time.perf_counter() - started
    pool = engine.pool
    tokens = sum(s.cache.length for s in engine.sessions.values())
    shared = sum(len(p.tokens) * (p.users - 1) for p in pool.prefixes.values())  # counted once in the pool
    out = {"tokens_s": sum(ingested) / elapsed, "elapsed": elapsed, "latencies": sorted(latencies),
           "kv_ratio": pool.used_bytes() / max(1, tokens) / pool.shape.bytes_per_token,
           "kv_ratio_unshared": pool.used_bytes() / max(1, tokens - shared) / pool.shape.bytes_per_token}
    for sid in list(engine.sessions):
        engine.close_session(sid).result()
    return out


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,4,16,32")
    parser.add_argument("--chunks", type=int, default=8, help="appends per session")
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--ask-every", type=int, default=4)
    parser.add_argument("--step-tokens", type=int, default=EngineLimits.step_tokens)
    parser.add_argument("--query-step-tokens", type=int, default=EngineLimits.query_step_tokens)
    args = parser.parse_args()
    counts = [int(n) for n in args.sessions.split(",")]
    lm = load_model("embedded")
    runner = ModelRunner(lm.model, lm.tokenizer, lm.name)
    engine = Engine(runner, EngineLimits(max_sessions=max(counts) + 1, step_tokens=args.step_tokens,
                                         query_step_tokens=args.query_step_tokens)).start()
    try:
        # idle question latency: one session, nothing else running (warm-up first)
        idle_work = texts(runner, 1, args.chunks, args.chunk_tokens)[0]
        sid = engine.create_session().result()["session_id"]
        for piece in idle_work:
            engine.append(sid, piece).result()
        engine.query(sid, QUESTION, ANSWER).future.result()
        idle = []
        for _ in range(7):
            started = time.perf_counter()
            engine.query(sid, QUESTION, ANSWER).future.result()
            idle.append(time.perf_counter() - started)
        engine.close_session(sid).result()
        idle_p50, idle_p99 = statistics.median(idle), max(idle)
        rows = []
        for n in counts:
            work = texts(runner, n, args.chunks, args.chunk_tokens)
            serial = run(engine, work, args.ask_every, batched=False)
            batched = run(engine, work, args.ask_every, batched=True)
            rows.append((n, serial, batched))
            print(f"  {n:2d} sessions: batched {batched['tokens_s']:6.0f} tok/s vs serial {serial['tokens_s']:6.0f} "
                  f"tok/s ({batched['tokens_s'] / serial['tokens_s']:.2f}x); question p50/p99 "
                  f"{pct(batched['latencies'], .5) * 1000:.0f}/{pct(batched['latencies'], .99) * 1000:.0f} ms", flush=True)
    finally:
        engine.stop()

    print(f"\nmodel {lm.name}; step budget {args.step_tokens} tokens ({args.query_step_tokens} while a question "
          f"runs); per session {args.chunks} appends of ~{args.chunk_tokens} tokens, a question "
          f"(8-token answer) every {args.ask_every}; idle question p50 {idle_p50 * 1000:.0f} ms, "
          f"max {idle_p99 * 1000:.0f} ms")
    print("\n| sessions | batched tok/s | serial tok/s | speedup | question p50 ms (batched) | p99 ms | "
          "p99 / idle p50 | KV bytes/token vs physical |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, serial, batched in rows:
        lat = batched["latencies"]
        print(f"| {n} | {batched['tokens_s']:.0f} | {serial['tokens_s']:.0f} | "
              f"{batched['tokens_s'] / serial['tokens_s']:.2f}x | {pct(lat, .5) * 1000:.0f} | {pct(lat, .99) * 1000:.0f} | "
              f"{pct(lat, .99) / idle_p50:.2f} | {batched['kv_ratio']:.3f} ({batched['kv_ratio_unshared']:.3f} "
              f"without the shared prefix) |")
    pick = next((r for r in rows if r[0] == 16), rows[-1])
    throughput = pick[2]["tokens_s"] / pick[1]["tokens_s"]
    p99 = pct(pick[2]["latencies"], .99) / idle_p50
    kv = max(r[2]["kv_ratio_unshared"] for r in rows)
    print(f"\nat {pick[0]} sessions: throughput {throughput:.2f}x serial (target >= 2.5), question p99 under load "
          f"{p99:.2f}x the idle p50 (target <= 2); KV bytes per token {kv:.3f}x physical (target <= 1.1)")
    print(f"RESULT throughput16_vs_serial={throughput:.2f} p99_loaded_vs_idle={p99:.2f} kv_bytes_vs_physical={kv:.3f}")


if __name__ == "__main__":
    main()
