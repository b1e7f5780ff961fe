"""Question latency on a live session versus stateless re-prefill, as context grows.

For accumulated contexts of 512 .. 8K tokens on the embedded model, in one process:
  - session: the context was ingested as it arrived; a 16-token question plus an 8-token
    answer runs as a fork on the live cache (what streamer does);
  - stateless: the context + question is prefilled from scratch, then the same 8 tokens are
    decoded (what a request-driven engine pays for every question).
Session latencies are measured in interleaved rounds over all sizes (each size's cache is an
exact prefix copy of the grown session), so machine drift hits every size alike.

Ingest: a stream of appends of --chunk-tokens each goes through the engine as fast as it
takes them (appends that queue up are prefilled together), versus one forward over the same
tokens (one-shot prefill). The one-append-per-forward rate is printed too.

Run: python bench/query_latency.py [--sizes 512,1024,2048,4096,8192] [--reps 7]
The last line is `RESULT flat_8k_vs_512=<x> speedup_vs_stateless_8k=<x> ingest_vs_prefill=<x>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from baselines import stateless_answer  # noqa: E402

from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.query import QueryJob  # noqa: E402
from streamer.sessions.models import load_model  # noqa: E402
from streamer.sessions.runner import ModelRunner, SeqStep  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402
from streamer.sessions.session import Session  # noqa: E402

ANSWER_TOKENS = 8
QUESTION = ("Which boat brought the new burner for the lamp, and who was its skipper on that "
            "trip to the island?")


def question_text(session: Session, tokens: int = 16) -> str:
    """A question of exactly `tokens` tokens (before framing)."""
    ids = session.tokenize(QUESTION)[:tokens]
    text = session.tokenizer.decode(ids)
    if len(session.tokenize(text)) != tokens:
        raise RuntimeError("could not build a question of the requested length")
    return text


def corpus(session: Session, tokens: int) -> list[int]:
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    ids = session.tokenize(text)
    return (ids * (tokens // len(ids) + 1))[:tokens]


def ask_session(runner, session, question) -> float:
    job = QueryJob(session, "bench", question, SamplingParams(max_tokens=ANSWER_TOKENS), frozenset())
    started = time.perf_counter()
    result = drive(runner, job)
    elapsed = time.perf_counter() - started
    assert len(result.tokens) == ANSWER_TOKENS and session.cache.length == job.base
    return elapsed


def ask_stateless(runner, ids: list[int]) -> float:
    return stateless_answer(runner, ids, ANSWER_TOKENS)


def ingest(runner, pieces: list[list[int]]) -> tuple[Session, float]:
    """Stream the pieces through the engine as fast as it takes them; (session, tokens/s)."""
    engine = Engine(runner, EngineLimits()).start()
    try:
        sid = engine.create_session().result()["session_id"]
        started = time.perf_counter()
        futures = [engine.append(sid, runner.tokenizer.decode(p)) for p in pieces]
        acks = [f.result() for f in futures]
        elapsed = time.perf_counter() - started
        session = engine.sessions[sid]
    finally:
        engine.stop()
    return session, sum(a.tokens for a in acks) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192")
    parser.add_argument("--reps", type=int, default=7, help="session questions per size")
    parser.add_argument("--stateless-reps", type=int, default=3, help="stateless runs per size (2 above 2K)")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="tokens per append while ingesting")
    args = parser.parse_args()

    lm = load_model("embedded")
    runner = ModelRunner(lm.model, lm.tokenizer, lm.name)
    probe = Session("probe", runner)
    question = question_text(probe)
    q_framed = len(probe.question_ids(question))
    window = probe.context_window
    sizes = [min(int(s), window - q_framed - ANSWER_TOKENS) for s in args.sizes.split(",")]
    data = corpus(probe, max(sizes) - len(probe.prefix_ids))
    print(f"model {lm.name}, {torch.get_num_threads()} threads, question 16 tokens ({q_framed} framed), "
          f"answer {ANSWER_TOKENS} tokens")

    # warm-up (excluded)
    warm = Session("warm", runner)
    drive(runner, PrefillJob(warm, warm.prefix_ids + data[:200], None))
    ask_session(runner, warm, question)
    ask_stateless(runner, data[:256])

    # ingest: appends through the engine versus one forward over the same tokens
    pieces = [data[i:i + args.chunk_tokens] for i in range(0, len(data), args.chunk_tokens)]
    grown, ingest_tps = ingest(runner, pieces)
    one_each = Session("seq", runner)
    drive(runner, PrefillJob(one_each, one_each.prefix_ids, None))
    started = time.perf_counter()
    for p in pieces[:16]:
        drive(runner, PrefillJob(one_each, p, "piece"))
    sequential_tps = sum(len(p) for p in pieces[:16]) / (time.perf_counter() - started)
    context = grown.context_ids()
    cache = runner.new_cache()
    started = time.perf_counter()
    runner.forward([SeqStep(cache, 0, context)], logits="last")
    prefill_tps = len(context) / (time.perf_counter() - started)
    del cache

    # question latency: exact prefix copies of the grown session, measured in rounds
    sessions = {}
    for size in sizes:
        s = Session(f"s{size}", runner)
        s.cache = grown.cache.clone(size)
        sessions[size] = s
        ask_session(runner, s, question)  # first touch of this copy, excluded
    live = {size: [] for size in sizes}
    for _ in range(args.reps):
        for size in sizes:
            live[size].append(ask_session(runner, sessions[size], question))
    rows = []
    for size in sizes:
        ids = context[:size] + probe.question_ids(question)
        reps = args.stateless_reps if size <= 2048 else min(2, args.stateless_reps)
        cold = statistics.median(ask_stateless(runner, ids) for _ in range(reps))
        rows.append((size, statistics.median(live[size]), min(live[size]), max(live[size]), cold))
        print(f"  context {size:5d}: session p50 {rows[-1][1] * 1000:7.1f} ms, stateless p50 {cold * 1000:8.1f} ms",
              flush=True)

    print("\n| context tokens | session p50 ms | session min..max ms | stateless p50 ms | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for size, p50, lo, hi, cold in rows:
        print(f"| {size} | {p50 * 1000:.1f} | {lo * 1000:.0f}..{hi * 1000:.0f} | {cold * 1000:.1f} | {cold / p50:.1f}x |")
    flat = rows[-1][1] / rows[0][1]
    speedup = rows[-1][4] / rows[-1][1]
    print(f"\ningest {ingest_tps:.0f} tokens/s ({args.chunk_tokens}-token appends through the engine; "
          f"{sequential_tps:.0f} tokens/s one append per forward) vs one-shot prefill {prefill_tps:.0f} tokens/s "
          f"of the same {len(context)} tokens")
    print(f"session latency at {rows[-1][0]} vs {rows[0][0]} tokens: {flat:.2f}x (target <= 1.5); "
          f"vs stateless: {speedup:.1f}x (target >= 15); ingest/prefill {ingest_tps / prefill_tps:.2f} (target >= 0.8)")
    print(f"RESULT flat_8k_vs_512={flat:.2f} speedup_vs_stateless_8k={speedup:.1f} "
          f"ingest_vs_prefill={ingest_tps / prefill_tps:.2f}")


if __name__ == "__main__":
    main()
