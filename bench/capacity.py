"""Feeds per machine: how many live feeds one `streamer serve` keeps within its service levels.

Each feed is a session of its own connection: one CSV row a second, two flash questions
registered, and a question (8 tokens) every 10 s. A trial runs N feeds for --seconds and passes
when the flash staleness p95 (the server's `streamer_flash_staleness_seconds_hist`, accepted
data to the answer evaluated on it, over that trial's evaluations) is at most 2 s and the
question latency p95 (client side, sent to `query.done`) at most 1 s. N doubles from 1 until a
trial fails, then bisects between the last pass and the first failure.

The server is a separate process (`python -m streamer serve`), so the feeds' client work does
not share its interpreter; on a 2-core machine they still share the cores.

    python bench/capacity.py [--model embedded] [--seconds 40] [--max-feeds 256] [--feeds 12,14]

The peer half runs the same workload on llama.cpp's `llama-server` (a bench dependency only:
`bash bench/build_llama_server.sh` builds it from the llama.cpp source that `llama-cpp-python`
ships), on the same GGUF file the embedded model is read from, with as many threads: one slot
per feed (`-np N`, each feed's requests pinned to its slot, `cache_prompt` on, so a slot keeps
its feed's prefix and evaluates only what is new), greedy, up to 8 answer tokens. Its users
re-ask each standing question after each row (a re-ask still running when rows arrive is
followed by one over all of them), and ask the same question every 10 s. A flash evaluation's
staleness is the same as the server's: the newest row it read arriving to its answer. The
same pass rule and search; the server restarts for each trial (its slot count is N).
Without a `llama-server` (not on PATH, not built to the default place, no --llama-server)
that half is skipped, saying so, and its count prints as nan.

    python bench/capacity.py [--only ours|llama] [--llama-server PATH] [--threads N]

Last line: `RESULT feeds=<n> llama_feeds=<n> feeds_vs_llama=<x>`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import math
import re
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from websockets.asyncio.client import connect  # noqa: E402

FLASH = [{"question": "Which station is the warmest right now?", "max_tokens": 8},
         {"question": "Is it windy anywhere?", "max_tokens": 8}]
QUESTION = "What was the last temperature at the harbour?"
STATIONS = ["north", "harbour", "airport", "hill", "valley"]
STALENESS_P95_S, QUESTION_P95_S = 2.0, 1.0
LLAMA_DEFAULT = Path.home() / ".cache" / "streamer-bench" / "llama-server"  # where build_llama_server.sh puts it


def row(feed: int, i: int) -> str:
    return (f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{STATIONS[(i + feed) % 5]},"
            f"{(i * 7 + feed) % 35 - 5}.5,{(i * 13 + feed) % 60}\n")


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


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
        stop_process(self.proc)


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
    return summary(n, counts, latencies, errors)


def summary(n: int, counts: dict[float, int], latencies: list[float], errors: list) -> dict:
    """A trial's figures from its staleness counts (cumulative at bounds, +Inf: all) and question
    latencies; it passes with >= 95% of evaluations within 2 s, question p95 <= 1 s, no errors."""
    total = counts.get(float("inf"), 0)
    ok_fraction = counts.get(STALENESS_P95_S, 0) / total if total else 0.0
    p95_bucket = next((b for b, c in counts.items() if total and c / total >= 0.95), float("inf"))
    q95 = sorted(latencies)[min(len(latencies) - 1, int(0.95 * len(latencies)))] if latencies else float("inf")
    passed = ok_fraction >= 0.95 and q95 <= QUESTION_P95_S and not errors
    return {"n": n, "evaluations": total, "staleness_p95_le": p95_bucket, "within_2s": ok_fraction,
            "questions": len(latencies), "question_p95_s": q95,
            "question_p50_s": statistics.median(latencies) if latencies else float("nan"),
            "errors": errors[:3], "passed": passed}

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_json(port: int, method: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    """One HTTP/1.1 request to 127.0.0.1:port, its own connection (many run at once: one per
    feed and request in flight); (status, JSON body)."""
    async def go() -> tuple[int, dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            data = json.dumps(body).encode() if body is not None else b""
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
            await writer.drain()
            raw = await reader.read()
        finally:
            writer.close()
        head, _, payload = raw.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if b"transfer-encoding: chunked" in head.lower():
            chunks, rest = [], payload
            while rest:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if not size:
                    break
                chunks.append(rest[:size])
                rest = rest[size + 2:]
            payload = b"".join(chunks)
        try:
            return status, json.loads(payload) if payload.strip() else {}
        except json.JSONDecodeError:
            return status, {"raw": payload[:200].decode(errors="replace")}
    return await asyncio.wait_for(go(), timeout)


class LlamaServer:
    """`llama-server` on the embedded GGUF: `slots` parallel slots of `ctx_per_slot` tokens each."""

    def __init__(self, binary: str, gguf: str, slots: int, ctx_per_slot: int, threads: int) -> None:
        self.port = free_port()
        cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
               "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
               "--threads-http", str(2 * slots + 4), "--no-webui", "--log-disable"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                self.lines = (self.lines + [line])[-200:]

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"llama-server did not start ({' '.join(cmd)}):\n" + "".join(self.lines[-30:]))
            try:
                status, _ = asyncio.run(http_json(self.port, "GET", "/health", timeout=5))
                if status == 200:
                    return
            except (OSError, asyncio.TimeoutError, ValueError, IndexError):
                pass
            time.sleep(0.2)

    async def complete(self, prompt: str, slot: int) -> dict:
        status, body = await http_json(self.port, "POST", "/completion", {
            "prompt": prompt, "id_slot": slot, "cache_prompt": True, "n_predict": 8, "temperature": 0.0,
            "stream": False})
        if status != 200:
            raise RuntimeError(f"llama-server answered {status}: {str(body)[:200]}")
        return body

    def stop(self) -> None:
        stop_process(self.proc)


def llama_prompt(rows: list[str], question: str) -> str:
    return ("Live weather readings, one a line: time,station,temperature (C),wind (km/h).\n" + "".join(rows)
            + f"\nQuestion: {question}\nAnswer:")


async def llama_feed(srv: LlamaServer, n: int, seconds: float, start_at: float, latencies: list[float],
                     staleness: list[float], errors: list) -> None:
    """One feed on its own slot: a row a second; after each row its user re-asks both standing
    questions (over every row that has arrived), and every 10 rows asks the question."""
    rows = [row(n, i) for i in range(10)]
    arrived = [time.time()] * 10
    for q in FLASH:  # the standing questions' first answers, before the clock (as the server's)
        await srv.complete(llama_prompt(rows, q["question"]), n)
    new_row = asyncio.Event()

    async def reask() -> None:
        while True:
            await new_row.wait()
            new_row.clear()
            upto = len(rows)
            for q in FLASH:
                try:
                    await srv.complete(llama_prompt(rows[:upto], q["question"]), n)
                except (OSError, RuntimeError, asyncio.TimeoutError) as exc:
                    errors.append(repr(exc))
                    continue
                staleness.append(time.time() - arrived[upto - 1])

    standing = asyncio.create_task(reask())
    await asyncio.sleep(max(0.0, start_at - time.monotonic()) + (n % 10) / 10)
    t0 = time.monotonic()
    i = 10
    while time.monotonic() - t0 < seconds:
        rows.append(row(n, i))
        arrived.append(time.time())
        new_row.set()
        if (i - 10) % 10 == 5:
            asked = time.monotonic()
            try:
                await srv.complete(llama_prompt(rows, QUESTION), n)
                latencies.append(time.monotonic() - asked)
            except (OSError, RuntimeError, asyncio.TimeoutError) as exc:
                errors.append(repr(exc))
        i += 1
        await asyncio.sleep(max(0.0, t0 + (i - 10) - time.monotonic()))
    await asyncio.sleep(2)  # the re-asks of the last rows (the server's trial waits as long)
    standing.cancel()


def llama_trial(binary: str, gguf: str, threads: int, n: int, seconds: float) -> dict:
    ctx = 256 * math.ceil((24 * (seconds + 20) + 160) / 256)  # 10 rows ahead, the trial's, slack; ~20 tokens a row
    srv = LlamaServer(binary, gguf, n, ctx, threads)
    latencies: list[float] = []
    staleness: list[float] = []
    errors: list = []
    try:
        async def run() -> None:
            start_at = time.monotonic() + 5 + n * 0.2
            await asyncio.gather(*(llama_feed(srv, k, seconds, start_at, latencies, staleness, errors) for k in range(n)))
        asyncio.run(run())
    finally:
        srv.stop()
    return summary(n, staleness_within(staleness), latencies, errors)


def staleness_within(values: list[float]) -> dict[float, int]:
    """Cumulative counts at the server histogram's bounds (+Inf: all) of a list of stalenesses."""
    bounds = [0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, float("inf")]
    return {b: sum(v <= b for v in values) for b in bounds}


def search(run, max_feeds: int, fixed: list[int] | None = None) -> int:
    """The largest N that passes: double from 1 to the first failure, then bisect to within an
    eighth; with `fixed`, the largest of those counts that passes (each tried once; 0 if none)."""
    if fixed:
        return max([n for n in fixed if run(n)], default=0)
    good, bad, n = 0, None, 1
    while n <= max_feeds:
        if not run(n):
            bad = n
            break
        good, n = n, n * 2
    if bad is not None:
        while bad - good > max(1, good // 8):
            mid = (good + bad) // 2
            if run(mid):
                good = mid
            else:
                bad = mid
    return good


def report(label: str, r: dict) -> bool:
    print(f"{label} {r['n']:4d} feeds: {r['evaluations']:5d} evaluations, staleness p95 <= {r['staleness_p95_le']:g} s "
          f"({r['within_2s']:.1%} within 2 s); {r['questions']:3d} questions p50 {r['question_p50_s']:.2f} s "
          f"p95 {r['question_p95_s']:.2f} s; {'pass' if r['passed'] else 'FAIL'}"
          + (f"; errors {r['errors']}" if r["errors"] else ""), flush=True)
    return r["passed"]


def find_llama_server(given: str | None) -> str | None:
    if given:
        return given
    found = shutil.which("llama-server")
    if found:
        return found
    return str(LLAMA_DEFAULT) if LLAMA_DEFAULT.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="model spec for `streamer serve` (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each trial (default: %(default)s)")
    parser.add_argument("--max-feeds", type=int, default=256, help="stop searching here (default: %(default)s)")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `streamer serve` argument")
    parser.add_argument("--only", choices=["ours", "llama"], help="run one half")
    parser.add_argument("--feeds", help="trials at these feed counts only (comma-separated), no search; "
                                        "RESULT gives the largest that passed")
    parser.add_argument("--llama-server", help=f"the llama-server binary (default: on PATH, else {LLAMA_DEFAULT})")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="llama-server's threads (default: the machine's %(default)s cores, as our pool)")
    args = parser.parse_args()
    fixed = [int(n) for n in args.feeds.split(",")] if args.feeds else None
    ours = llama = float("nan")
    if args.only != "llama":
        server = Server(args.model, args.serve_arg)
        try:
            ours = search(lambda n: report("ours ", trial(server, n, args.seconds)), args.max_feeds, fixed)
        finally:
            server.stop()
        print(f"feeds per machine, ours ({args.model}, 1 row/s, 2 flash questions, a question every 10 s; "
              f"staleness p95 <= {STALENESS_P95_S:g} s, question p95 <= {QUESTION_P95_S:g} s): {ours}", flush=True)
    if args.only != "ours":
        binary = find_llama_server(args.llama_server)
        if binary is None:
            print("llama-server: skipped (none on PATH or at the default place; "
                  "`bash bench/build_llama_server.sh` builds one, or pass --llama-server PATH)")
        else:
            from streamer.sessions.models import embedded_gguf_path
            gguf = str(embedded_gguf_path())
            print(f"llama-server: {binary} on {gguf}, {args.threads} threads", flush=True)
            llama = search(lambda n: report("llama", llama_trial(binary, gguf, args.threads, n, args.seconds)),
                           args.max_feeds, fixed)
            print(f"feeds per machine, llama-server (the same workload and rule): {llama}", flush=True)
    ratio = float("nan") if math.isnan(ours) or math.isnan(llama) else ours / llama if llama else float("inf")
    print(f"RESULT feeds={ours} llama_feeds={llama} feeds_vs_llama={ratio:.2f}")


if __name__ == "__main__":
    main()
