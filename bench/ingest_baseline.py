"""Ingest tokens/s: this checkout's engine beside an earlier commit's, in alternating rounds.

The live-feeds work set ingest a target against the kernels of the day it began: "2x today's,
on the same run's baseline". This bench checks that commit out (`git worktree add --detach`, a
temporary folder, removed at the end), and in each round runs the same measurement in a fresh
process on each tree: the embedded model on int4 weights (the engine's default on the CPU), a
new session reads its framing, then `--sizes` tokens of the bundled log in steps of 512 tokens
(the engine's chunked prefill), timed over the log. Each tree builds its own C kernels. Rounds
alternate between the trees, so the machine's drift hits both alike; medians are printed.

The default baseline, 6811ab0, is the last commit before that work (its kernels: the AVX-512
VNNI GEMM in micro-tiles of 4 rows, the attention's scores reduced a query at a time; neither
AMX tiles nor read-ahead).

Run: python bench/ingest_baseline.py [--rev 6811ab0] [--sizes 512,4096] [--rounds 3] [--threads 2]
Needs this checkout's git history (a clone, not an exported tree). Last line:
`RESULT ingest<size>_base_tok_s=<x> ingest<size>_tok_s=<x> ingest<size>_vs_base=<x> ...` per size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE_REV = "6811ab0"

# Run in the tree under test: its packages (pyproject's package-dir: streamer.kernels is the
# tree's kernels/, and so on) are imported from the tree, ahead of any installed copy. Uses only
# what both trees have: build_runner, Session, PrefillJob and drive.
CHILD = r"""
import importlib.abc, importlib.util, json, os, re, sys, time
from importlib import resources
from pathlib import Path
tree = Path.cwd()
text = (tree / "pyproject.toml").read_text()
try:
    import tomllib
    dirs = tomllib.loads(text)["tool"]["setuptools"]["package-dir"]
except ModuleNotFoundError:  # Python 3.10: the table is one line of "name" = "folder" pairs
    line = next(l for l in text.splitlines() if l.startswith("package-dir"))
    dirs = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', line))

class TreeFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in dirs:
            return None
        folder = tree / dirs[name]
        return importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])

sys.meta_path.insert(0, TreeFinder())
import torch
torch.set_num_threads(int(sys.argv[1]))
import streamer
import streamer.kernels.cpu
from streamer.app import build_runner
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.session import Session
runner = build_runner("embedded", weights="int4")
text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
rates = {}
for size in [int(s) for s in sys.argv[2].split(",")]:
    session = Session(f"ingest-{size}", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None), 512)
    ids = session.tokenize(text)
    body = (ids * (size // len(ids) + 1))[:size - len(session.prefix_ids)]
    started = time.perf_counter()
    drive(runner, PrefillJob(session, body, None), 512)
    rates[size] = len(body) / (time.perf_counter() - started)
print("RATES " + json.dumps({"files": [streamer.__file__, streamer.kernels.cpu.__file__], "rates": rates}))
"""


def run_child(tree: Path, threads: int, sizes: str) -> dict[int, float]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", STREAMER_ADAPTIVE_THREADS="0")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(threads), sizes], cwd=tree, env=env,
                          capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RATES ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"the run in {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    got = json.loads(line[len("RATES "):])
    for file in got["files"]:
        if not Path(file).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"the run in {tree} imported {file}, not its tree's")
    return {int(k): v for k, v in got["rates"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=BASELINE_REV, help="the baseline commit (default: %(default)s)")
    ap.add_argument("--sizes", default="512,4096")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if shutil.which("git") is None:
        raise SystemExit("git is not installed: this bench checks the baseline commit out")
    rev = subprocess.run(["git", "rev-parse", "--verify", f"{args.rev}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True)
    if rev.returncode != 0:
        raise SystemExit(f"{args.rev} is not a commit of {ROOT} ({rev.stderr.strip()}): run from a clone "
                         f"with its history (git fetch --unshallow in a shallow one)")
    base = Path(tempfile.mkdtemp(prefix="streamer-baseline-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(base), rev.stdout.strip()], cwd=ROOT, check=True,
                   capture_output=True)
    trees = {f"baseline {args.rev}": base, "this checkout": ROOT}
    got: dict[str, dict[int, list[float]]] = {name: {s: [] for s in sizes} for name in trees}
    try:
        for r in range(args.rounds):
            for name, tree in trees.items():
                print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
                for size, rate in run_child(tree, args.threads, args.sizes).items():
                    got[name][size].append(rate)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
        shutil.rmtree(base.parent, ignore_errors=True)
    (base_name, now_name) = trees
    print(f"\ningest tokens/s, int4, {args.threads} threads (medians of {args.rounds} alternating rounds)")
    print(f"{'context':>8} {'baseline':>9} {'now':>8} {'now/base':>9}   rounds (baseline | now)")
    result = []
    for size in sizes:
        b, n = statistics.median(got[base_name][size]), statistics.median(got[now_name][size])
        print(f"{size:>8} {b:>9.0f} {n:>8.0f} {n / b:>8.2f}x   "
              f"{' '.join(f'{x:.0f}' for x in got[base_name][size])} | {' '.join(f'{x:.0f}' for x in got[now_name][size])}")
        result += [f"ingest{size}_base_tok_s={b:.0f}", f"ingest{size}_tok_s={n:.0f}", f"ingest{size}_vs_base={n / b:.2f}"]
    print("RESULT " + " ".join(result))


if __name__ == "__main__":
    main()
