"""What durability costs: acknowledgement latency per store, and recovery by replay.

One engine, one in-process server per store, the same workload for each, side by side in this
run: a session streams --chunks appends of about --chunk-tokens tokens, each awaited (the ack
comes only once the input is in the cache *and* in the event log):
  - memory: the log is a list in the process (the floor: what the engine itself costs);
  - file:   an append-only JSON-lines file, written and flushed per input (fsync off);
  - file+fsync: the same with an fsync per input;
  - redis:  a Lua-scripted XADD on a Redis server (skipped when none answers on --redis).
Then the file store's session is recovered on a second server: resume replays its log through
the engine. Reported: mean ack latency per store and its ratio to memory; replay time versus
the time the original ingest took (replay queues every record at once, so it prefills in a
few large steps instead of one per input); and, for the physics under the ratios, one log
append alone per store (no model).

Run: python bench/durability.py [--model embedded] [--chunks 40] [--chunk-tokens 32] [--rounds 3]
     [--redis redis://127.0.0.1:6379/0]
The last line is `RESULT file_ack_vs_memory=<x> redis_ack_vs_memory=<x> replay_vs_ingest=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from importlib import resources

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

from streamer.app import build_engine  # noqa: E402
from streamer.server import ServerConfig, StreamerServer  # noqa: E402
from streamer.store import StoreError  # noqa: E402


def pieces(tokenizer, count: int, size: int) -> list[str]:
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [tokenizer.decode(ids[i * size:(i + 1) * size]) for i in range(count)]


async def request(ws, msg: dict) -> dict:
    import json

    await ws.send(json.dumps(msg))
    while True:
        event = json.loads(await ws.recv())
        if event.get("reply_to") == msg.get("event_id"):
            return event


async def run_store(engine, store_url: str | None, chunks: list[str], fsync: bool = False) -> tuple[list[float], dict]:
    server = StreamerServer(engine, ServerConfig(port=0, store_url=store_url))
    if fsync:
        server.store.fsync = True
    try:
        await server.start()
    except StoreError as exc:
        print(f"{store_url}: skipped ({exc})")
        return [], {}
    try:
        async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
            created = await request(ws, {"type": "session.create", "event_id": "c"})
            latencies, started = [], time.perf_counter()
            for i, text in enumerate(chunks, 1):
                t0 = time.perf_counter()
                ack = await request(ws, {"type": "input.text.append", "session_id": created["session_id"],
                                         "text": text, "client_seq": i, "event_id": f"a{i}"})
                assert ack["type"] == "input.ack", ack
                latencies.append(time.perf_counter() - t0)
            created["ingest_s"] = time.perf_counter() - started
            return latencies, created
    finally:
        await server.stop()


async def append_alone(store_url: str | None, fsync: bool, n: int = 500) -> float:
    """Mean seconds of one log append on its own (no model), for the physics under the ratio."""
    from streamer.store import open_store

    store = open_store(store_url, worker_id="bench")
    if fsync:
        store.fsync = True
    try:
        await store.start()
    except StoreError:
        return float("nan")
    await store.claim("s")
    record = {"kind": "append", "text": "x" * 120, "seq": 1, "client_seq": 1}
    t0 = time.perf_counter()
    for _ in range(n):
        await store.append("s", record)
    elapsed = (time.perf_counter() - t0) / n
    if hasattr(store, "redis"):
        await store.redis.delete(store.key("log", "s"), store.key("owner", "s"))
    await store.close()
    return elapsed


async def replay_time(engine, store_url: str, created: dict) -> float:
    server = await StreamerServer(engine, ServerConfig(port=0, store_url=store_url)).start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}", max_size=None) as ws:
            t0 = time.perf_counter()
            resumed = await request(ws, {"type": "session.resume", "session_id": created["session_id"],
                                         "token": created["tokens"]["producer"], "event_id": "r"})
            assert resumed["type"] == "session.resumed", resumed
            return time.perf_counter() - t0
    finally:
        await server.stop()


async def main(args: argparse.Namespace) -> None:
    engine = build_engine(args.model, threads=args.threads)
    try:
        chunks = pieces(engine.runner.tokenizer, args.chunks, args.chunk_tokens)
        await run_store(engine, None, chunks[:4])  # warm-up, excluded
        with tempfile.TemporaryDirectory() as tmp:
            results: dict[str, list[float]] = {}
            created: dict[str, dict] = {}
            prefix = f"bench-{uuid.uuid4().hex[:8]}"
            stores = (("memory", None, False), ("file", f"{tmp}/file", False), ("file+fsync", f"{tmp}/fsync", True),
                      ("redis", f"{args.redis}?prefix={prefix}", False))
            for _ in range(args.rounds):  # interleaved rounds: drift in machine load hits every store alike
                for name, url, fsync in stores:
                    latencies, info = await run_store(engine, url, chunks, fsync)
                    if latencies:
                        results.setdefault(name, []).extend(latencies)
                        created.setdefault(name, info)
            for name, latencies in results.items():
                print(f"{name}: ack latency mean {statistics.mean(latencies) * 1000:.2f} ms, "
                      f"p50 {statistics.median(latencies) * 1000:.2f} ms over {len(latencies)} appends")
            for name, url, fsync in stores:
                alone = await append_alone(url and url.replace("/file", "/alone").replace("/fsync", "/alone-f"), fsync)
                print(f"{name}: one log append alone {alone * 1e6:.1f} us")
            if "redis" in created:
                import redis

                client = redis.Redis.from_url(args.redis)
                keys = list(client.scan_iter(f"{prefix}:*"))
                if keys:
                    client.delete(*keys)
                client.close()
            replay_s = await replay_time(engine, f"{tmp}/file", created["file"])
        memory = statistics.mean(results["memory"])
        file_ratio = statistics.mean(results["file"]) / memory
        redis_ratio = statistics.mean(results["redis"]) / memory if "redis" in results else float("nan")
        ingest_s = created["file"]["ingest_s"]
        print(f"file ack / memory ack: {file_ratio:.3f}; file+fsync / memory: "
              f"{statistics.mean(results['file+fsync']) / memory:.3f}; redis / memory: {redis_ratio:.3f}")
        print(f"recovery: replay of {args.chunks} inputs {replay_s:.2f} s vs original ingest {ingest_s:.2f} s")
        print(f"RESULT file_ack_vs_memory={file_ratio:.3f} redis_ack_vs_memory={redis_ratio:.3f} "
              f"replay_vs_ingest={replay_s / ingest_s:.3f}")
    finally:
        engine.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--chunk-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    asyncio.run(main(parser.parse_args()))
