"""How long `streamer serve` takes to answer /healthz, with a cold cache and a warm one.

Each run starts `python -m streamer serve` as a subprocess on a free port and polls
`GET /healthz` (every 20 ms) until it answers 200 with status ok; the figure is the wall time
from spawning the process to that answer. The process is then stopped.
  cold: a fresh, empty STREAMER_CACHE (a temp dir per run): the embedded GGUF is converted to
        safetensors, the C kernels compiled, the int4 weights packed (and the packed weights
        written to the cache).
  warm: the cache the last cold run filled: every later start.
Where a start goes is read from the server's log, each line timestamped as it arrives:
  import+setup (spawn -> the model starts loading), GGUF conversion (cold only: "converted in X s"),
  model load (the "loaded ... in X s" line), kernel build (cold only: "compiled in X s"),
  weights (the model loaded -> "linear layers as ...", less the kernel build: the packing, or
  reading the packed weights from the cache), engine+server (-> "streamer listening"),
  first /healthz (-> the first 200).
The baseline, run in the same run on the same warm cache: `--baseline-runs` warm starts with
STREAMER_PACK_CACHE=0 (the int4 packing runs at every start, as before the packed-weight cache);
the warm start is printed as a ratio of it. `--no-pack-cache` runs every start that way.

Run: python bench/startup.py [--cold-runs 2] [--warm-runs 3] [--baseline-runs 2] [--model embedded]
     [--weights auto] [--no-pack-cache] [--cache DIR]
The last line is `RESULT cold_start_s=<median> warm_start_s=<median> no_pack_cache_start_s=<median>
warm_vs_no_pack_cache=<ratio>`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

PHASES = ("import+setup", "GGUF conversion", "model load", "kernel build", "weights", "engine+server",
          "first /healthz")


@dataclass(slots=True)
class Run:
    total_s: float
    phases: dict[str, float] = field(default_factory=dict)
    log: list[tuple[float, str]] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthz(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return resp.status == 200 and json.loads(resp.read()).get("status") == "ok"
    except (OSError, urllib.error.URLError, ValueError):
        return False


def start_once(cache: str, args: argparse.Namespace, pack_cache: bool = True) -> Run:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "STREAMER_CACHE": cache}
    if args.no_pack_cache or not pack_cache:
        env["STREAMER_PACK_CACHE"] = "0"
    port = free_port()
    cmd = [sys.executable, "-m", "streamer", "serve", "--port", str(port), "--model", args.model,
           "--weights", args.weights, *(["--threads", str(args.threads)] if args.threads else [])]
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[tuple[float, str]] = []

    def read() -> None:
        for line in proc.stdout:
            log.append((time.monotonic() - started, line.rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = started + args.timeout
    try:
        while not healthz(port):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode}):\n"
                                   + "\n".join(line for _, line in log[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"no /healthz within {args.timeout} s:\n" + "\n".join(line for _, line in log[-30:]))
            time.sleep(0.02)
        total = time.monotonic() - started
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
        reader.join(5)
    return Run(total, phases(log, total), log)


def phases(log: list[tuple[float, str]], total: float) -> dict[str, float]:
    """Where the start went, from the log lines' arrival times (empty where a line is missing)."""
    def at(pattern: str) -> tuple[float, re.Match] | None:
        for t, line in log:
            if m := re.search(pattern, line):
                return t, m
        return None

    loaded = at(r"loaded .* in ([\d.]+) s")
    packed = at(r"linear layers as ")
    listening = at(r"streamer listening on ")
    if not (loaded and packed and listening):
        return {}
    load_s = float(loaded[1].group(1))
    convert = at(r"converted in ([\d.]+) s")  # cold: the GGUF -> safetensors conversion, inside the load
    convert_s = float(convert[1].group(1)) if convert else 0.0
    compiled = at(r"compiled in ([\d.]+) s")  # cold: the C kernels' build, inside the weights step
    compile_s = float(compiled[1].group(1)) if compiled else 0.0
    return {"import+setup": loaded[0] - load_s - convert_s, "GGUF conversion": convert_s, "model load": load_s,
            "kernel build": compile_s, "weights": packed[0] - loaded[0] - compile_s,
            "engine+server": listening[0] - packed[0], "first /healthz": total - listening[0]}


def report(kind: str, runs: list[Run]) -> None:
    totals = [r.total_s for r in runs]
    print(f"{kind}: " + ", ".join(f"{t:.2f}" for t in totals) + f" s (median {statistics.median(totals):.2f} s)")
    with_phases = [r for r in runs if r.phases]
    if with_phases:
        print("  " + "  ".join(f"{p} {statistics.median(r.phases[p] for r in with_phases):.2f} s" for p in PHASES))
    notes = [line.split(": ", 1)[-1] for r in runs[-1:] for _, line in r.log
             if re.search(r"packed|compiled in|converted in", line)]
    for note in notes:
        print(f"  log: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold-runs", type=int, default=2)
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--baseline-runs", type=int, default=2,
                        help="warm starts with STREAMER_PACK_CACHE=0 on the same cache (the baseline)")
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a start may take")
    parser.add_argument("--no-pack-cache", action="store_true",
                        help="STREAMER_PACK_CACHE=0: pack the weights at every start (the old behaviour)")
    parser.add_argument("--cache", default=None,
                        help="run the warm starts on this cache dir (default: the last cold run's)")
    args = parser.parse_args()
    temps: list[str] = []
    try:
        cold = []
        for _ in range(args.cold_runs):
            temps.append(tempfile.mkdtemp(prefix="streamer-cold-"))
            cold.append(start_once(temps[-1], args))
        warm_dir = args.cache or (temps[-1] if temps else None)
        if warm_dir is None:
            warm_dir = tempfile.mkdtemp(prefix="streamer-warm-")
            temps.append(warm_dir)
        if not cold:
            start_once(warm_dir, args)  # fills what it lacks (and the page cache); not counted
        warm = [start_once(warm_dir, args) for _ in range(args.warm_runs)]
        baseline = [start_once(warm_dir, args, pack_cache=False) for _ in range(args.baseline_runs)]
    finally:
        for path in temps:
            shutil.rmtree(path, ignore_errors=True)
    print(f"streamer serve --model {args.model} --weights {args.weights} -> GET /healthz ok"
          f"{' (STREAMER_PACK_CACHE=0)' if args.no_pack_cache else ''}")
    if cold:
        report("cold start (empty STREAMER_CACHE)", cold)
    if warm:
        report("warm start", warm)
    if baseline:
        report("baseline: warm start, STREAMER_PACK_CACHE=0 (packs at every start)", baseline)
    median = lambda runs: statistics.median(r.total_s for r in runs) if runs else float("nan")  # noqa: E731
    ratio = median(warm) / median(baseline) if warm and baseline else float("nan")
    print(f"RESULT cold_start_s={median(cold):.2f} warm_start_s={median(warm):.2f} "
          f"no_pack_cache_start_s={median(baseline):.2f} warm_vs_no_pack_cache={ratio:.2f}")


if __name__ == "__main__":
    main()
