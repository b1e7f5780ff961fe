"""Question latency on a live session versus stateless re-prefill, as context grows.

For accumulated contexts of 512 .. 8K tokens on the embedded model, in one process:
  - session: the context was ingested as it arrived; a 16-token question plus an 8-token
    answer runs as a fork on the live cache (what streamer does);
  - stateless: the context + question is prefilled from scratch, then the same 8 tokens are
    decoded (what a request-driven engine pays for every question).
Also ingest throughput (tokens/s of chunked appends, as a stream would deliver them) versus
one-shot prefill throughput of the same tokens in a single forward.

Run: python bench/query_latency.py [--sizes 512,1024,2048,4096,8192] [--reps 7] [--chunk-tokens 128]
The last line is `RESULT flat_8k_vs_512=<x> speedup_vs_stateless_8k=<x> ingest_vs_prefill=<x>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from streamer.sessions.jobs import PrefillJob, QueryJob, drive  # noqa: E402
from streamer.sessions.models import load_model  # noqa: E402
from streamer.sessions.runner import ModelRunner, SeqStep  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402
from streamer.sessions.session import Session  # noqa: E402

ANSWER_TOKENS = 8
QUESTION = ("Which boat brought the new burner for the lamp, and who was its skipper on that "
            "trip to the island?")


def question_text(session: Session, tokens: int = 16) -> str:
    """A question of exactly `tokens` tokens (before framing)."""
    ids = session.tokenize(QUESTION)
    while len(ids) < tokens:
        ids = ids + ids
    text = session.tokenizer.decode(ids[:tokens])
    if len(session.tokenize(text)) != tokens:
        raise RuntimeError("could not build a question of the requested length")
    return text


def corpus(session: Session, tokens: int) -> list[int]:
    from importlib import resources

    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    ids = session.tokenize(text)
    out: list[int] = []
    while len(out) < tokens:
        out.extend(ids)
    return out[:tokens]


def ask_session(runner, session, question) -> float:
    job = QueryJob(session, "bench", question, SamplingParams(max_tokens=ANSWER_TOKENS), frozenset())
    started = time.perf_counter()
    result = drive(runner, job)
    elapsed = time.perf_counter() - started
    assert len(result.tokens) == ANSWER_TOKENS
    return elapsed


def ask_stateless(runner, ids: list[int]) -> tuple[float, float]:
    """Prefill everything in one forward on a fresh cache, then decode greedily.
    Returns (total seconds, prefill seconds)."""
    cache = runner.new_cache()
    started = time.perf_counter()
    logits = runner.forward([SeqStep(cache, 0, ids)], logits="last")[0]
    prefill = time.perf_counter() - started
    pos = len(ids)
    for _ in range(ANSWER_TOKENS - 1):
        token = int(torch.argmax(logits))
        logits = runner.forward([SeqStep(cache, pos, [token])], logits="last")[0]
        pos += 1
    return time.perf_counter() - started, prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="512,1024,2048,4096,8192")
    parser.add_argument("--reps", type=int, default=7, help="session questions per size")
    parser.add_argument("--stateless-reps", type=int, default=3, help="stateless runs per size (2 above 2K)")
    parser.add_argument("--chunk-tokens", type=int, default=128, help="tokens per append while ingesting")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    lm = load_model("embedded")
    runner = ModelRunner(lm.model, lm.tokenizer, lm.name)
    session = Session("bench", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    question = question_text(session)
    q_framed = len(session.question_ids(question))
    room = q_framed + ANSWER_TOKENS
    window = session.context_window
    sizes = [min(s, window - room) for s in sizes]
    data = corpus(session, max(sizes))
    print(f"model {lm.name}, {torch.get_num_threads()} threads, question 16 tokens "
          f"({q_framed} framed), answer {ANSWER_TOKENS} tokens, appends of {args.chunk_tokens} tokens")

    # warm-up (excluded): one question and one small stateless run
    drive(runner, PrefillJob(session, data[:64], "warm-up"))
    ask_session(runner, session, question)
    ask_stateless(runner, data[:256])
    session = Session("bench", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))

    rows = []
    fed = 0
    ingest_s = 0.0
    for size in sizes:
        target = size - len(session.prefix_ids)
        while fed < target:
            piece = data[fed:min(target, fed + args.chunk_tokens)]
            started = time.perf_counter()
            drive(runner, PrefillJob(session, piece, "chunk"))
            ingest_s += time.perf_counter() - started
            fed += len(piece)
        context = session.cache.length
        live = [ask_session(runner, session, question) for _ in range(args.reps)]
        ids = session.context_ids() + session.question_ids(question)
        reps = args.stateless_reps if size <= 2048 else min(2, args.stateless_reps)
        cold = [ask_stateless(runner, ids) for _ in range(reps)]
        rows.append((context, statistics.median(live), statistics.median(c[0] for c in cold),
                     statistics.median(c[1] for c in cold), max(live)))
        r = rows[-1]
        print(f"  context {context:5d}: session p50 {r[1] * 1000:7.1f} ms (max {r[4] * 1000:6.1f}), "
              f"stateless p50 {r[2] * 1000:8.1f} ms, speedup {r[2] / r[1]:5.1f}x", flush=True)

    ingest_tps = fed / ingest_s
    final_ids = session.context_ids()
    cache = runner.new_cache()
    started = time.perf_counter()
    runner.forward([SeqStep(cache, 0, final_ids)], logits="last")
    prefill_tps = len(final_ids) / (time.perf_counter() - started)

    print("\n| context tokens | session p50 ms | stateless p50 ms | stateless prefill ms | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for context, live, cold, prefill, _ in rows:
        print(f"| {context} | {live * 1000:.1f} | {cold * 1000:.1f} | {prefill * 1000:.1f} | {cold / live:.1f}x |")
    flat = rows[-1][1] / rows[0][1]
    speedup = rows[-1][2] / rows[-1][1]
    print(f"\ningest {ingest_tps:.0f} tokens/s ({args.chunk_tokens}-token appends) vs one-shot prefill "
          f"{prefill_tps:.0f} tokens/s of the same {len(final_ids)} tokens")
    print(f"session latency at {rows[-1][0]} vs {rows[0][0]} tokens: {flat:.2f}x (target <= 1.5); "
          f"vs stateless: {speedup:.1f}x (target >= 15); ingest/prefill {ingest_tps / prefill_tps:.2f} (target >= 0.8)")
    print(f"RESULT flat_8k_vs_512={flat:.2f} speedup_vs_stateless_8k={speedup:.1f} "
          f"ingest_vs_prefill={ingest_tps / prefill_tps:.2f}")


if __name__ == "__main__":
    main()
