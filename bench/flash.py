"""Flash questions versus asking on demand, on the embedded model at ~4K tokens of context.

Everything runs in one process: the engine, the websocket server on a free port, and the
real client over loopback.
  1. Latency of a registered question whose answer is current (served from the flash cache),
     server side and client side, versus asking the same question on demand on the live
     session, versus stateless re-prefill of context + question.
  2. Staleness: from sending an append to every registered answer being current for it
     (1, 4 and 16 questions registered).
  3. Batched evaluation of 16 questions (one FlashJob) versus 16 sequential questions.

Run: python bench/flash.py [--context 4096] [--max-tokens 16] [--weights auto|fp32|int8|int4]
The last line is `RESULT flash_vs_ondemand=<x> batched16_vs_sequential=<x> staleness16_s=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from baselines import stateless_answer  # noqa: E402

from streamer.clients.client import StreamerClient  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402
from streamer.sessions.flash import FlashJob, FlashQuestion  # noqa: E402
from streamer.sessions.jobs import drive  # noqa: E402
from streamer.sessions.query import QueryJob  # noqa: E402
from streamer.app import build_runner  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402

# The flash questions are registered without the SDK's answer style: ask with the same sampling
# (the service's defaults), or the answers could not come from the flash cache.
PLAIN = {"end_bias": None, "frequency_penalty": None}

QUESTIONS = [
    "What is the keeper's name?", "Who is the assistant keeper?", "What is the supply boat called?",
    "What is the name of the cat?", "How many kittens did Pepper have?", "What broke in the storm?",
    "What new part was fitted to the lamp?", "How many barrels of oil are in the store?",
    "Who is the skipper of the supply boat?", "What is the name of the island?", "What colour is the cat?",
    "What time is the lamp lit?", "Who arrived on March 10?", "Why did Walter Crane leave?",
    "What are the kittens called?", "What is the weather like?",
]


def document(runner, tokens: int) -> list[str]:
    """Paragraphs of the bundled log, repeated, up to about `tokens` tokens."""
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    paragraphs = [p + "\n\n" for p in text.split("\n\n") if p.strip()]
    out, total, i = [], 0, 0
    while True:
        n = len(runner.tokenizer(paragraphs[i % len(paragraphs)], add_special_tokens=False)["input_ids"])
        if total + n > tokens:
            return out
        out.append(paragraphs[i % len(paragraphs)])
        total += n
        i += 1


async def wait_current(session, version: int, count: int, poll: float = 0.01) -> float:
    started = time.perf_counter()
    while True:
        state = await session.state()
        done = [f for f in state["flash"] if f.get("data_version") == version]
        if len(done) >= count and state["data_version"] == version:
            return time.perf_counter() - started
        await asyncio.sleep(poll)


async def latency_and_staleness(url: str, paragraphs: list[str], max_tokens: int, reps: int) -> dict:
    out: dict = {}
    async with await StreamerClient.connect(url) as client:
        session = await client.create_session()
        for p in paragraphs:
            ack = await session.append(p)
        out["context"] = ack.total_tokens
        question = QUESTIONS[0]
        on_demand = [await session.ask(question, max_tokens=max_tokens, **PLAIN) for _ in range(reps)]
        out["ondemand_client"] = statistics.median(a.client_ms for a in on_demand) / 1000
        out["ondemand_server"] = statistics.median(a.timing["total_ms"] for a in on_demand) / 1000
        out["answer"] = on_demand[0].text
        await client.request({"type": "flash.register", "session_id": session.id, "question": question,
                              "max_tokens": max_tokens})
        await wait_current(session, ack.data_version, 1)
        cached = [await session.ask(question, max_tokens=max_tokens, **PLAIN) for _ in range(reps * 5)]
        assert all(a.timing["total_ms"] == 0 for a in cached), "expected answers from the flash cache"
        out["flash_client"] = statistics.median(a.client_ms for a in cached) / 1000
        out["flash_server"] = statistics.median(a.timing["total_ms"] for a in cached) / 1000
        out["flash_answer"] = cached[0].text
        # staleness with 1, 4, 16 registered questions
        registered = 1
        out["staleness"] = {}
        for count in (1, 4, 16):
            for q in QUESTIONS[registered:count]:
                await client.request({"type": "flash.register", "session_id": session.id, "question": q,
                                      "max_tokens": max_tokens})
            registered = count
            await wait_current(session, ack.data_version, count)
            samples = []
            for k in range(2):
                started = time.perf_counter()
                ack = await session.append(f"Note {count}.{k}: the wind is from the west. ")
                await wait_current(session, ack.data_version, count)
                samples.append(time.perf_counter() - started)
            out["staleness"][count] = statistics.median(samples)
            print(f"  staleness with {count:2d} questions: {out['staleness'][count]:.2f} s", flush=True)
        await session.close()
    return out


def batched_vs_sequential(runner, paragraphs: list[str], max_tokens: int) -> tuple[float, float, bool]:
    from streamer.sessions.jobs import PrefillJob
    from streamer.sessions.session import Session

    session = Session("b", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None))
    for p in paragraphs:
        drive(runner, PrefillJob(session, session.tokenize(p), p))
    stop = frozenset([runner.tokenizer.eos_token_id])
    questions = [FlashQuestion(f"f{i}", q, session.question_ids(q), max_tokens) for i, q in enumerate(QUESTIONS)]
    job = FlashJob(session, questions, stop)
    started = time.perf_counter()
    while not job.done:
        steps = job.plan(4096)
        if steps:
            job.complete_many(runner.forward(steps, logits="last"))
    batched = time.perf_counter() - started
    started = time.perf_counter()
    sequential = [drive(runner, QueryJob(session, "q", q, SamplingParams(max_tokens=max_tokens), stop))
                  for q in QUESTIONS]
    seq_s = time.perf_counter() - started
    same = all(a.tokens == s.tokens for (_, a), s in zip(job.results, sequential))
    return batched, seq_s, same


def stateless(runner, paragraphs: list[str], question: str, max_tokens: int) -> float:
    from streamer.sessions.session import Session

    s = Session("x", runner)
    ids = s.prefix_ids + [t for p in paragraphs for t in s.tokenize(p)] + s.question_ids(question)
    return stateless_answer(runner, ids, max_tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096, help="tokens of context (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer tokens (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--weights", default="auto", help="weight format, as `streamer serve --weights` "
                                                          "(default: %(default)s, what the server runs)")
    args = parser.parse_args()
    runner = build_runner("embedded", weights=args.weights)
    print(f"embedded model, weights {runner.weights.format} ({runner.weights.source})")
    paragraphs = document(runner, args.context - 60)

    engine = Engine(runner, EngineLimits()).start()

    async def served() -> dict:
        server = await StreamerServer(engine, ServerConfig(port=0)).start()
        try:
            return await latency_and_staleness(f"ws://127.0.0.1:{server.port}", paragraphs, args.max_tokens, args.reps)
        finally:
            await server.stop()

    try:
        r = asyncio.run(served())
    finally:
        engine.stop()
    cold = stateless(runner, paragraphs, QUESTIONS[0], args.max_tokens)
    batched, sequential, same = batched_vs_sequential(runner, paragraphs, args.max_tokens)

    print(f"\nmodel {runner.name}, context {r['context']} tokens, answers up to {args.max_tokens} tokens")
    print(f"answer on demand: {r['answer'].strip()!r}; from flash: {r['flash_answer'].strip()!r}")
    print("\n| registered question at ~4K tokens | server ms | client ms |")
    print("|---|---:|---:|")
    print(f"| flash (current answer) | {r['flash_server'] * 1000:.2f} | {r['flash_client'] * 1000:.2f} |")
    print(f"| on demand (live session) | {r['ondemand_server'] * 1000:.1f} | {r['ondemand_client'] * 1000:.1f} |")
    print(f"| stateless re-prefill | {cold * 1000:.1f} | - |")
    print("\n| registered questions | staleness: append -> all answers current (s) |")
    print("|---:|---:|")
    for count, seconds in r["staleness"].items():
        print(f"| {count} | {seconds:.2f} |")
    print(f"\n16 questions: one batched evaluation {batched:.2f} s vs 16 sequential {sequential:.2f} s "
          f"= {sequential / batched:.2f}x (target >= 3); same answers: {same}")
    ratio = r["ondemand_client"] / r["flash_client"]
    print(f"flash vs on demand (client side): {ratio:.0f}x; vs stateless: {cold / r['flash_client']:.0f}x")
    print(f"RESULT flash_vs_ondemand={ratio:.1f} batched16_vs_sequential={sequential / batched:.2f} "
          f"staleness16_s={r['staleness'][16]:.2f}")


if __name__ == "__main__":
    main()
