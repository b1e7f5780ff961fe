"""Feeds per machine: how many live feeds one `streamer serve` keeps within its service levels.

Each feed is a session of its own connection: one CSV row a second, two flash questions
registered, and a question (8 tokens) every 10 s. A trial runs N feeds for --seconds and passes
when the flash staleness p95 (the server's `streamer_flash_staleness_seconds_hist`, accepted
data to the answer evaluated on it, over that trial's evaluations) is at most 2 s and the
question latency p95 (client side, sent to `query.done`) at most 1 s. N doubles from 1 until a
trial fails, then bisects between the last pass and the first failure.

The server is a separate process (`python -m streamer serve`), so the feeds' client work does
not share its interpreter; on a 2-core machine they still share the cores.

    python bench/capacity.py [--model embedded] [--seconds 40] [--max-feeds 256]

The peer half (the same workload on llama.cpp's `llama-server`, re-asking each standing question
after each row) is not built here: this machine has no `llama-server`, and the bench says so.
Last line: `RESULT feeds=<n> llama_feeds=nan`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

FLASH = [{"question": "Which station is the warmest right now?", "max_tokens": 8},
         {"question": "Is it windy anywhere?", "max_tokens": 8}]
QUESTION = "What was the last temperature at the harbour?"
STATIONS = ["north", "harbour", "airport", "hill", "valley"]
STALENESS_P95_S, QUESTION_P95_S = 2.0, 1.0


def row(feed: int, i: int) -> str:
    return (f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{STATIONS[(i + feed) % 5]},"
            f"{(i * 7 + feed) % 35 - 5}.5,{(i * 13 + feed) % 60}\n")


class Server:
    """`python -m streamer serve --port 0` in its own process."""

    def __init__(self, model: str, extra: list[str]) -> None:
        cmd = [sys.executable, "-m", "streamer", "serve", "--port", "0", "--model", model,
               "--limit", "messages_per_s=1000", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url: str | None = None
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.lines = (self.lines + [line])[-200:]
                m = re.search(r"streamer listening on (ws://\S+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(600) or self.url is None:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-30:]))
        self.http = self.url.replace("ws://", "http://").rstrip("/")

    def staleness(self) -> dict[float, int]:
        """Evaluations at or under each staleness bound (cumulative, +Inf: all), summed over the
        sessions /metrics lists."""
        text = urllib.request.urlopen(self.http + "/metrics", timeout=30).read().decode()
        sums: dict[float, int] = {}
        for m in re.finditer(r'streamer_flash_staleness_seconds_hist_bucket\{session="[^"]*",le="([^"]+)"\} (\d+)', text):
            bound = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
            sums[bound] = sums.get(bound, 0) + int(m.group(2))
        return dict(sorted(sums.items()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def feed(url: str, n: int, seconds: float, start_at: float, latencies: list[float], errors: list,
               fed: asyncio.Event, measured: asyncio.Event, left: list[int]) -> None:
    """One feed: its own connection and session, a row a second, a question every 10 s; the
    session is closed once the trial's figures are read (a closed session leaves /metrics)."""
    async with connect(url, max_size=None) as ws:
        pending: dict[str, asyncio.Future] = {}

        async def reader() -> None:
            async for text in ws:
                event = json.loads(text)
                if event["type"] == "error":
                    errors.append(event["error"])
                key = event.get("reply_to")
                if key in pending and event["type"] != "query.delta":
                    pending.pop(key).set_result(event)

        async def request(msg: dict, key: str) -> dict:
            pending[key] = asyncio.get_running_loop().create_future()
            await ws.send(json.dumps({**msg, "event_id": key}))
            return await asyncio.wait_for(pending[key], 120)

        reading = asyncio.create_task(reader())
        created = await request({"type": "session.create", "flash": FLASH}, "c")
        sid = created["session_id"]
        for i in range(10):  # some data before the clock starts
            await request({"type": "input.text.append", "session_id": sid, "text": row(n, i)}, f"w{i}")
        await asyncio.sleep(max(0.0, start_at - time.monotonic()) + (n % 10) / 10)  # feeds staggered over a second
        t0 = time.monotonic()
        i = 10
        while time.monotonic() - t0 < seconds:
            await ws.send(json.dumps({"type": "input.text.append", "session_id": sid, "text": row(n, i)}))
            if (i - 10) % 10 == 5:  # a question every 10 rows (10 s), from the 6th row on
                asked = time.monotonic()
                done = await request({"type": "query.create", "session_id": sid, "question": QUESTION,
                                      "max_tokens": 8, "stream": False}, f"q{i}")
                if done["type"] == "query.done":
                    latencies.append(time.monotonic() - asked)
            i += 1
            await asyncio.sleep(max(0.0, t0 + (i - 10) - time.monotonic()))
        left[0] -= 1
        if not left[0]:
            fed.set()
        await measured.wait()
        await request({"type": "session.close", "session_id": sid}, "x")
        reading.cancel()


def trial(server: Server, n: int, seconds: float) -> dict:
    before = server.staleness()
    latencies: list[float] = []
    errors: list = []

    async def run() -> list[int]:
        start_at = time.monotonic() + 5 + n * 0.2  # every feed created before the clock starts
        fed, measured, left = asyncio.Event(), asyncio.Event(), [n]
        feeds = asyncio.gather(*(feed(server.url, k, seconds, start_at, latencies, errors, fed, measured, left)
                                 for k in range(n)))
        await asyncio.wait({asyncio.ensure_future(fed.wait()), feeds}, return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(2)  # the evaluations of the last rows
        after = await asyncio.to_thread(server.staleness)
        measured.set()
        await feeds
        return after

    after = asyncio.run(run())
    counts = {b: c - before.get(b, 0) for b, c in after.items()}  # this trial's sessions (earlier ones are closed)
    total = counts.get(float("inf"), 0)
    ok_fraction = counts.get(STALENESS_P95_S, 0) / total if total else 0.0
    p95_bucket = next((b for b, c in counts.items() if total and c / total >= 0.95), float("inf"))
    q95 = sorted(latencies)[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else float("inf")
    passed = ok_fraction >= 0.95 and q95 <= QUESTION_P95_S and not errors
    return {"n": n, "evaluations": total, "staleness_p95_le": p95_bucket, "within_2s": ok_fraction,
            "questions": len(latencies), "question_p95_s": q95,
            "question_p50_s": statistics.median(latencies) if latencies else float("nan"),
            "errors": errors[:3], "passed": passed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="model spec for `streamer serve` (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each trial (default: %(default)s)")
    parser.add_argument("--max-feeds", type=int, default=256, help="stop searching here (default: %(default)s)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `streamer serve` argument")
    args = parser.parse_args()
    server = Server(args.model, args.serve_arg)
    results: dict[int, dict] = {}

    def run(n: int) -> bool:
        r = trial(server, n, args.seconds)
        results[n] = r
        print(f"{n:4d} feeds: {r['evaluations']:5d} evaluations, staleness p95 <= {r['staleness_p95_le']:g} s "
              f"({r['within_2s']:.1%} within 2 s); {r['questions']:3d} questions p50 {r['question_p50_s']:.2f} s "
              f"p95 {r['question_p95_s']:.2f} s; {'pass' if r['passed'] else 'FAIL'}"
              + (f"; errors {r['errors']}" if r["errors"] else ""), flush=True)
        return r["passed"]

    try:
        good, bad, n = 0, None, 1
        while n <= args.max_feeds:
            if not run(n):
                bad = n
                break
            good, n = n, n * 2
        if bad is not None:
            while bad - good > max(1, good // 8):  # bisect to within an eighth
                mid = (good + bad) // 2
                if run(mid):
                    good = mid
                else:
                    bad = mid
    finally:
        server.stop()
    print(f"feeds per machine ({args.model}, 1 row/s, 2 flash questions, a question every 10 s; "
          f"staleness p95 <= {STALENESS_P95_S:g} s, question p95 <= {QUESTION_P95_S:g} s): {good}")
    print("llama-server: not run (no llama-server on this machine; the peer half of this bench is not built)")
    print(f"RESULT feeds={good} llama_feeds=nan")


if __name__ == "__main__":
    main()
