"""Time to first answer delta through /v1/realtime (the `openai` SDK) versus the native protocol,
on the same session of the same server.

One server on the embedded model (default weights). A Realtime connection creates the session and
appends the bundled lighthouse log; then rounds alternate: the Realtime connection asks each
question (`response.create`, timed from the send to the first `response.output_text.delta`), then a
native connection resumes the same session (`session.resume` with the resume token: a live
session is re-attached, nothing replayed) and asks the same questions (`query.create`, timed to
the first `query.delta`), then the Realtime connection resumes it back. Same cache, same questions,
same answers; interleaving spreads machine drift over both.

Run: python bench/realtime.py [--rounds 5] [--max-tokens 4]
The last line is `RESULT realtime_first_delta_ms=<median> native_first_delta_ms=<median> ratio=<x>`
(the target is ratio <= 1.05).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai  # noqa: E402
import websockets  # noqa: E402

from streamer.app import build_engine  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402

QUESTIONS = ["Who keeps the lighthouse?", "What is the name of the island?", "Which boat brings the supplies?",
             "What colour is the lamp?", "When did the storm come?"]


async def realtime_round(port: int, resume: dict | None, questions: list[str], max_tokens: int,
                         document: str | None) -> tuple[list[float], dict]:
    client = openai.AsyncOpenAI(api_key="bench", base_url=f"http://127.0.0.1:{port}/v1",
                                websocket_base_url=f"ws://127.0.0.1:{port}/v1")
    times = []
    async with client.realtime.connect(model="streamer", extra_query=resume or {}) as conn:
        created = await conn.recv()
        assert created.type == "session.created", created
        resume = resume or created.session.model_extra["streamer"]["resume_query"]
        if document is not None:
            await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": document}]})
            while (await conn.recv()).type != "conversation.item.done":
                pass
        for question in questions:
            start = time.perf_counter()
            await conn.response.create(response={"instructions": question, "max_output_tokens": max_tokens})
            first = None
            while True:
                event = await conn.recv()
                if event.type == "response.output_text.delta" and first is None:
                    first = time.perf_counter() - start
                if event.type == "error":
                    raise RuntimeError(event.error.message)
                if event.type == "response.done":
                    break
            times.append(first * 1000)
    return times, resume


async def native_round(port: int, resume: dict, questions: list[str], max_tokens: int) -> list[float]:
    times = []
    async with websockets.connect(f"ws://127.0.0.1:{port}/", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.resume", "session_id": resume["session_id"],
                                  "token": resume["resume_token"]}))
        reply = json.loads(await ws.recv())
        assert reply["type"] == "session.resumed", reply
        for question in questions:
            start = time.perf_counter()
            await ws.send(json.dumps({"type": "query.create", "session_id": resume["session_id"], "question": question,
                                      "max_tokens": max_tokens}))
            first = None
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "query.delta" and first is None:
                    first = time.perf_counter() - start
                if event["type"] == "error":
                    raise RuntimeError(event["error"]["message"])
                if event["type"] == "query.done":
                    break
            times.append(first * 1000)
    return times


async def main(args: argparse.Namespace) -> None:
    engine = build_engine("embedded")
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    document = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    try:
        _, resume = await realtime_round(server.port, None, [], args.max_tokens, document)
        await realtime_round(server.port, resume, QUESTIONS[:1], args.max_tokens, None)  # warm both paths
        await native_round(server.port, resume, QUESTIONS[:1], args.max_tokens)
        rt, native = [], []
        for r in range(args.rounds):
            order = ("rt", "native") if r % 2 == 0 else ("native", "rt")
            for which in order:
                if which == "rt":
                    rt += (await realtime_round(server.port, resume, QUESTIONS, args.max_tokens, None))[0]
                else:
                    native += await native_round(server.port, resume, QUESTIONS, args.max_tokens)
            print(f"round {r + 1}: realtime median {statistics.median(rt):.1f} ms, native median "
                  f"{statistics.median(native):.1f} ms")
    finally:
        await server.stop()
        engine.stop()
    rt_ms, native_ms = statistics.median(rt), statistics.median(native)
    print(f"{len(rt)} questions each on one session of {engine.runner.name}: realtime first delta "
          f"{rt_ms:.1f} ms (p90 {statistics.quantiles(rt, n=10)[-1]:.1f}), native {native_ms:.1f} ms "
          f"(p90 {statistics.quantiles(native, n=10)[-1]:.1f})")
    print(f"RESULT realtime_first_delta_ms={rt_ms:.1f} native_first_delta_ms={native_ms:.1f} "
          f"ratio={rt_ms / native_ms:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    asyncio.run(main(parser.parse_args()))
