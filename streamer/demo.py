"""`streamer demo`: the whole service on the embedded model, in one process, in a minute.

Starts the engine and the websocket server on a free port, connects the real client over
loopback, streams a document into a session chunk by chunk, asks questions as the context
grows, and prints each answer with its latency and the context it was asked at.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from streamer.clients.cli import chunks_of
from streamer.clients.client import StreamerClient
from streamer.sessions.engine import Engine, EngineLimits

DEFAULT_DOC = "lighthouse_log.txt"
DEFAULT_QUESTIONS = "lighthouse_questions.json"
GENERIC_QUESTIONS = [{"after_fraction": 0.5, "question": "What is this document about?", "expect": []},
                     {"after_fraction": 1.0, "question": "What is this document about?", "expect": []}]


def _bundled(name: str) -> str:
    return resources.files("streamer").joinpath("data", name).read_text(encoding="utf-8")


async def _stream_and_ask(url: str, text: str, questions: list[dict], chunk_chars: int) -> None:
    pieces = chunks_of(text, chunk_chars)
    pending = sorted(questions, key=lambda q: q["after_fraction"])
    rows = []
    async with await StreamerClient.connect(url) as client:
        session = await client.create_session()
        print(f"session {session.id}: {session.info['tokens']} tokens of framing, "
              f"context window {session.info['context_window']} tokens\n")
        read = ingest_ms = tokens = 0
        for piece in pieces:
            ack = await session.append(piece)
            read += len(piece)
            ingest_ms += ack.lag_ms
            tokens += ack.tokens
            print(f"  streamed {read:6d}/{len(text)} chars -> {ack.total_tokens:5d} tokens in cache "
                  f"(this chunk: {ack.tokens} tokens, {ack.lag_ms:.0f} ms)")
            while pending and read >= pending[0]["after_fraction"] * len(text) - 1:
                rows.append(await _ask(session, pending.pop(0)))
        await session.end_input()
        for q in pending:
            rows.append(await _ask(session, q))
        await session.close()
    print("\n  context  first-token  total   question")
    for ctx, first, total, question in rows:
        print(f"  {ctx:7d}  {first:8.0f} ms  {total:5.0f} ms  {question}")
    print(f"\ningest: {tokens} tokens in {ingest_ms / 1000:.1f} s ({tokens / max(ingest_ms / 1000, 1e-9):.0f} tokens/s)."
          "\nQuestion latency tracks the question's own tokens, not the context: the document was read "
          "once, as it arrived.")


async def _ask(session, q: dict) -> tuple:
    answer = await session.ask(q["question"], max_tokens=48)  # the SDK's ANSWER_STYLE
    t = answer.timing
    found = [k for k in q.get("expect", []) if k.lower() in answer.text.lower()]
    verdict = ""
    if q.get("expect"):
        verdict = f"   [expected {' / '.join(q['expect'])}: {'found' if found else 'not found'}]"
    print(f"\n  Q ({answer.context_tokens} tokens read): {q['question']}\n  A: {answer.text.strip()}\n"
          f"     first token {t['first_token_ms']:.0f} ms, answer {t['total_ms']:.0f} ms "
          f"({answer.tokens} tokens){verdict}\n")
    return answer.context_tokens, t["first_token_ms"], t["total_ms"], q["question"]


def run_demo(args: argparse.Namespace, limits: EngineLimits, build: Callable[[], Engine] | None = None) -> int:
    """The demo on an engine from `build()` (default: `args.model` with `limits`)."""
    from streamer.server import ServerConfig, StreamerServer

    if build is None:
        from streamer.app import build_engine

        def build() -> Engine:
            return build_engine(args.model, args.dtype, args.device, limits, args.threads,
                                getattr(args, "weights", "auto"))

    if args.file:
        text, questions = Path(args.file).read_text(encoding="utf-8"), GENERIC_QUESTIONS
    else:
        text, questions = _bundled(DEFAULT_DOC), json.loads(_bundled(DEFAULT_QUESTIONS))
    started = time.monotonic()
    print(f"loading {args.model} model ...", flush=True)
    engine = build()
    print(f"model ready in {time.monotonic() - started:.1f} s: {engine.runner.name}, "
          f"{engine.runner.weights.format} weights", flush=True)

    async def main() -> None:
        server = await StreamerServer(engine, ServerConfig(port=0)).start()
        url = f"ws://127.0.0.1:{server.port}"
        print(f"service on {url}; streaming {len(text)} characters\n", flush=True)
        try:
            await _stream_and_ask(url, text, questions, args.chunk_chars)
        finally:
            await server.stop()

    try:
        asyncio.run(main())
    finally:
        engine.stop()
    print(f"\ndemo finished in {time.monotonic() - started:.1f} s")
    return 0
