"""Fairness under a flood: a bystander's round-trip latency while another client floods the
server with junk frames, against the same bystander with no flood, side by side in one run.

    python bench/fairness.py                  # 300 round trips per phase, 2 flooding processes
    python bench/fairness.py --trips 100 --flooders 1

The server (a tiny random model: the edge is what is measured) and the bystander run in this
process; each flooder is a separate process that sends invalid JSON and junk binary frames as
fast as its socket takes them and reconnects whenever the server closes it (a determined
attacker). The bystander holds a session and times `session.get` round trips and short
`input.text.append` acknowledgements. Prints p50/p99 per phase and their ratios, the junk frames
sent and the connections the server closed for junk.
Last line: `RESULT p50_flood_vs_idle=<x> p99_flood_vs_idle=<x> junk_frames=<n> junk_closed=<n>`.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def flood(url: str, stop_at: float, counter) -> None:
    """A flooding client (its own process): junk frames until `stop_at`, reconnecting."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    async def run() -> None:
        text, binary = "{not json" * 64, b"\x00" * 4096
        while time.time() < stop_at:
            try:
                async with connect(url, max_size=None) as ws:
                    i = 0
                    while time.time() < stop_at:
                        await ws.send(text if i % 2 else binary)
                        i += 1
                        with counter.get_lock():
                            counter.value += 1
            except (ConnectionClosed, OSError):
                await asyncio.sleep(0.01)

    asyncio.run(run())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def trips(peer, sid: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        msg = ({"type": "session.get", "session_id": sid} if i % 4 else
               {"type": "input.text.append", "session_id": sid, "text": f" tick {i}."})
        t0 = time.perf_counter()
        reply = await peer.request(msg)
        out.append(time.perf_counter() - t0)
        if reply["type"] == "error":
            raise RuntimeError(f"the bystander was refused: {reply}")
    return out


async def main_async(args) -> int:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from transformers import AutoTokenizer
    from wsutil import raw

    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model, embedded_model_dir
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=5)
    engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name), EngineLimits(max_context_tokens=4096)).start()
    server = await StreamerServer(engine, ServerConfig(port=0)).start()
    url = f"ws://127.0.0.1:{server.port}"
    try:
        peer = await raw(url)
        sid = await peer.create()
        await trips(peer, sid, 20)  # warm-up
        idle = await trips(peer, sid, args.trips)
        ctx = multiprocessing.get_context("spawn")
        counter = ctx.Value("q", 0)
        stop_at = time.time() + 600
        procs = [ctx.Process(target=flood, args=(url, stop_at, counter), daemon=True) for _ in range(args.flooders)]
        for p in procs:
            p.start()
        while counter.value < 1000:  # the flood is on
            await asyncio.sleep(0.05)
        flooded = await trips(peer, sid, args.trips)
        for p in procs:
            p.terminate()
            p.join(10)
        junk = counter.value
    finally:
        await server.stop()
        engine.stop()
    i50, i99, f50, f99 = (percentile(idle, 0.5), percentile(idle, 0.99), percentile(flooded, 0.5),
                          percentile(flooded, 0.99))
    print(f"idle:    p50 {i50 * 1000:.2f} ms  p99 {i99 * 1000:.2f} ms  mean {statistics.mean(idle) * 1000:.2f} ms")
    print(f"flooded: p50 {f50 * 1000:.2f} ms  p99 {f99 * 1000:.2f} ms  mean {statistics.mean(flooded) * 1000:.2f} ms")
    print(f"junk frames sent {junk}, connections closed for junk {server.edge['junk_closed']}, "
          f"frames refused for rate {server.edge['rate_limited']}")
    print(f"RESULT p50_flood_vs_idle={f50 / i50:.2f} p99_flood_vs_idle={f99 / i99:.2f} junk_frames={junk} "
          f"junk_closed={server.edge['junk_closed']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=300, help="bystander round trips per phase")
    parser.add_argument("--flooders", type=int, default=2, help="flooding client processes")
    return asyncio.run(main_async(parser.parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
