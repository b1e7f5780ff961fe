"""Decode speed and time-to-answer: our weight formats side by side with llama.cpp, in one run.

For each context size (default 512 and 4096 tokens of the bundled log, framed as a session):
  - ours, per weight format (default fp32 and int4; int4 is the embedded Q4_1 GGUF's own blocks):
    the context is ingested as a session (chunked prefill, as the engine does), then a question
    is asked as a fork on the live cache: time to an 8-token and a 64-token answer, and decode
    ms/token over the 64-token answer;
  - llama.cpp (`llama-cpp-python`, optional: `pip install llama-cpp-python` builds it from
    source; never a test dependency; bench/baselines.py LlamaCpp; on a CPU with AMX its native
    build, 0.3.36, segfaulted at the first evaluation: give `CMAKE_ARGS` the flags that
    bench/build_llama_server.sh uses on such a CPU, AVX-512 on and AMX off) on the same GGUF file, the
    same token ids (framing, context, framed question), greedy: the context is evaluated once,
    then each answer reuses it (its longest common prefix, never past the context: every round
    asks the same question, which is evaluated again each time, as ours forks it) and evaluates
    the question and the answer tokens. (bench/peers.py compares the two on a live feed, through our server.)
Both use the same number of threads. Rounds alternate between engines, so machine drift hits
them alike; medians are printed. Perplexity per format on the bundled log is printed after.

GGUF types (`--gguf-types Q4_0,Q4_1,Q8_0,Q4_K,Q5_K,Q6_K,Q4_K_M,Q5_K_M,F16,BF16,F32`): the embedded model's
weights (its Q4_1 file dequantized) re-exported in each type (sessions/gguf_write.py; tensors
not a whole number of 256-weight super-blocks fall back as llama-quantize does: Q4_K -> Q5_0,
Q5_K -> Q5_1, Q6_K -> Q8_0), each loaded as `--model file.gguf --weights auto` loads it, and its
perplexity on the bundled log printed with the format it ran in and what repacking cost; then
`RESULT ppl_<type>=...` and nothing else is timed.

Run: python bench/decode.py [--sizes 512,4096] [--formats fp32,int4] [--threads 2] [--reps 3]
Last line: `RESULT decode512_vs_llama=<ours int4 ms/token / llama.cpp's> decode4k_vs_llama=<x>
answer8_llama_vs_ours=<llama.cpp time / ours, 8-token answer, largest size>
answer64_min_llama_vs_ours=<the smallest over sizes> ingest_vs_llama=<our tokens/s / llama.cpp's>
int4_vs_fp32_decode=<fp32 ms/token / int4's> decode512_of_limit=<x> decode4k_of_limit=<x>
ingest_tok_s=<x> stream_gb_s=<x>` (`n/a` where llama.cpp is not installed).

The thread governor (kernels/governor.py) reads llama.cpp's rounds, which alternate with ours,
as a neighbour's load, and gives our next decode one thread: measured on a 2-core AVX-512 Xeon,
ours decoded at 7.8 ms/token at 512 beside llama.cpp and 3.7 ms alone. For the side by side,
`STREAMER_ADAPTIVE_THREADS=0` (4.5 ms there; then `--hog` shows ours without the governor).

Where the CPU has AMX (Sapphire Rapids and later), our int4 ingest is then timed again on both
kernel paths in alternating rounds: every row on the AVX-512 VNNI vector path (the kernels
before the AMX tiles; `STREAMER_AMX=0`) and tiles of 16 rows on AMX (the default); RESULT adds
`ingest_vector_tok_s` and `ingest_amx_vs_vector`.

`--hog`: then, at the smallest size, ingest and decode tokens/s of ours (int4) and llama.cpp's
in alternating rounds, with the machine as it is and with one core taken by a busy process (a
neighbour; on a server, its own media and event-loop threads); prints what each keeps and ours /
llama.cpp's both ways, and RESULT adds `hog_<ours|llama>_<ingest|decode>_kept` and
`<ingest|decode>_vs_llama_<idle|hogged>`.

The bandwidth floor: a decode step reads at least the linear layers' weights (the head
included) and the session's K/V once; that many bytes over the bandwidth this machine streams
(torch's sum of a 1 GiB tensor with the same threads) is the fastest a step can be. A shared
machine's bandwidth moves with its neighbours (one 2-core VM read 28-64 GB/s within minutes), so
each of our timed answers is paired with probes read right before and after it (their mean), and
`decode<N>_of_limit` is the median over rounds of that round's floor over its int4 ms/token
(1.0: at the memory limit; above 1.0 part of a step's bytes came from the CPU's cache, and the
table says so with the cache's size: a 2-core Xeon VM with a 480 MB L3 keeps the 108 MB of a
512-token step there between steps); `stream_gb_s` the median probe; `ingest_tok_s` our int4 ingest, the
median over sizes.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from importlib import resources
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from streamer.kernels import cpu
from streamer.kernels.governor import GOVERNOR
from streamer.sessions.jobs import PrefillJob, drive
from streamer.sessions.models import embedded_gguf_path
from streamer.sessions.query import QueryJob
from streamer.sessions.runner import SeqStep
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session

from baselines import LlamaCpp

from streamer.app import build_runner

QUESTION = "Which boat brought the new burner for the lamp, and who was its skipper?"
STEP_TOKENS = 512  # the engine's default step budget (chunked prefill)


STREAM_BYTES = 1 << 30  # the bandwidth probe reads 1 GiB: far past any cache
PAIR_REPS = 3  # reads of the probe right before and after each timed answer


@functools.cache
def _probe_tensor() -> torch.Tensor:
    """The probe's 1 GiB, made once, its pages touched and torch's threads started."""
    x = torch.ones(STREAM_BYTES // 4)
    x.sum()
    return x


def stream_bandwidth(reps: int = 5) -> float:
    """Bytes/s this machine streams from memory with torch's threads (set by --threads): the
    median of `reps` full reads (a sum) of a 1 GiB float32 tensor, as a decode step reads its
    weights and KV once."""
    x = _probe_tensor()
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - started)
    return STREAM_BYTES / statistics.median(times)


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache of cpu0 (Linux sysfs), or None where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=None)


def step_bytes(runner, context: int) -> int:
    """What one decode step at `context` tokens must read at least: the linear layers' weights
    (the head included) once, and the session's K/V once (norms and one embedding row are
    negligible)."""
    return runner.weights.linear_bytes + context * runner.kv_shape.bytes_per_token


def log_tokens(session: Session, tokens: int) -> list[int]:
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()
    ids = session.tokenize(text)
    return (ids * (tokens // len(ids) + 1))[:tokens]


class Ours:
    """One weight format: a session per context size, questions as forks on it."""

    def __init__(self, fmt: str, model: str = "embedded") -> None:
        self.fmt = fmt
        self.runner = build_runner(model, weights=fmt)
        self.sessions: dict[int, Session] = {}
        self.contexts: dict[int, list[int]] = {}  # the ids each session's cache holds
        self.ingest: dict[int, float] = {}

    def read(self, size: int) -> tuple[Session, list[int], float]:
        """A new session that has read `size` tokens (the framing, then the log in steps of
        STEP_TOKENS): the session, the log's ids, and tokens/s over the log."""
        session = Session(f"{self.fmt}-{size}", self.runner)
        drive(self.runner, PrefillJob(session, session.prefix_ids, None), STEP_TOKENS)
        body = log_tokens(session, size - len(session.prefix_ids))
        started = time.perf_counter()
        drive(self.runner, PrefillJob(session, body, None), STEP_TOKENS)
        return session, body, len(body) / (time.perf_counter() - started)

    def prepare(self, size: int) -> list[int]:
        session, body, self.ingest[size] = self.read(size)
        self.sessions[size] = session
        # the ids in its cache (the body is read as the framing is, not logged as an input, so
        # session.context_ids() would hold the framing only): llama.cpp is given the same context
        self.contexts[size] = session.prefix_ids + body
        return self.contexts[size] + session.question_ids(QUESTION)

    def answer(self, size: int, tokens: int) -> tuple[float, float]:
        """(seconds to a `tokens`-token answer, decode seconds per token after the first)."""
        job = QueryJob(self.sessions[size], "q", QUESTION, SamplingParams(max_tokens=tokens), frozenset())
        started = time.perf_counter()
        r = drive(self.runner, job)
        total = time.perf_counter() - started
        return total, (r.total_s - r.first_token_s) / max(1, len(r.tokens) - 1)

    def perplexity(self, tokens: int = 1024) -> float:
        session = Session("ppl", self.runner)
        ids = log_tokens(session, tokens)
        cache = self.runner.new_cache(len(ids))
        nll, count = 0.0, 0
        for start in range(0, len(ids) - 1, STEP_TOKENS):
            chunk = ids[start:start + STEP_TOKENS]
            rows = self.runner.forward([SeqStep(cache, start, chunk)], logits="all")[0]
            cache.commit(start + len(chunk))
            targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
            logp = torch.log_softmax(rows[:len(targets)], dim=-1)
            nll -= float(logp.gather(1, targets[:, None]).sum())
            count += len(targets)
        return math.exp(nll / count)


def ingest_paths(ours: Ours, sizes: list[int], reps: int) -> dict[str, float]:
    """Where the CPU has AMX: our int4 ingest with every row on the vector path (AVX-512 VNNI, the
    kernels before the AMX tiles) and with tiles of 16 rows on AMX, in alternating rounds; prints
    both and returns RESULT entries (`ingest_vector_tok_s`, `ingest_amx_vs_vector`: medians over
    sizes)."""
    lib = cpu.load()
    if not lib.amx():
        print("\ningest kernels: no AMX here (the vector path is the only one)")
        return {}
    rates: dict[tuple[bool, int], list[float]] = {}
    # all the threads in every round: the thread governor would read llama.cpp's rounds just
    # before as a neighbour's load and give the first rounds fewer
    with GOVERNOR.fixed():
        try:
            for _ in range(reps):
                for amx in (False, True):
                    lib.set_amx(amx)
                    for size in sizes:
                        rates.setdefault((amx, size), []).append(ours.read(size)[2])
        finally:
            lib.set_amx(True)
    med = {key: statistics.median(v) for key, v in rates.items()}
    print(f"\ningest tokens/s, ours-{ours.fmt}, the same rows on both kernel paths (medians of {reps}, alternating):")
    print(f"{'context':>8} {'vector':>8} {'amx':>8} {'amx/vector':>11}")
    for size in sizes:
        print(f"{size:>8} {med[(False, size)]:>8.0f} {med[(True, size)]:>8.0f} "
              f"{med[(True, size)] / med[(False, size)]:>10.2f}x")
    return {"ingest_vector_tok_s": statistics.median(med[(False, s)] for s in sizes),
            "ingest_amx_vs_vector": statistics.median(med[(True, s)] / med[(False, s)] for s in sizes)}


def contention(ours: Ours, llama, size: int, reps: int) -> dict[str, float]:
    """`--hog`: ingest tokens/s and decode tokens/s at `size`, ours and llama.cpp's (when
    installed) in alternating rounds, with the machine as it is and then with one core taken by a
    busy process (a neighbour, or the server's own media and event-loop threads); prints both and
    returns RESULT entries: what each keeps of its idle rates, and ours / llama.cpp idle and hogged."""
    import subprocess
    import sys

    def measure() -> dict[str, float]:
        got: dict[str, list[float]] = {}
        for _ in range(reps):
            ids = ours.prepare(size)
            got.setdefault("ours_ingest", []).append(ours.ingest[size])
            got.setdefault("ours_decode", []).append(1 / ours.answer(size, 64)[1])
            if llama is not None:
                question = len(ids) - len(ours.contexts[size])
                got.setdefault("llama_ingest", []).append(llama.prefill_rate(ids[:-question]))
                got.setdefault("llama_decode", []).append(1 / llama.decode_rate(ids, 64))
        return {k: statistics.median(v) for k, v in got.items()}

    idle = measure()
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        hogged = measure()
    finally:
        hog.kill()
        hog.wait()
    print(f"\none core taken by a busy process, context {size} (medians of {reps} rounds):")
    print(f"{'engine':>12} {'ingest tok/s':>13} {'hogged':>8} {'kept':>6} {'decode tok/s':>13} {'hogged':>8} {'kept':>6}")
    out = {}
    for who, name in (("ours", f"ours-{ours.fmt}"), ("llama", "llama.cpp")):
        if f"{who}_ingest" not in idle:
            continue
        kept = {part: hogged[f"{who}_{part}"] / idle[f"{who}_{part}"] for part in ("ingest", "decode")}
        print(f"{name:>12} {idle[f'{who}_ingest']:>13.0f} {hogged[f'{who}_ingest']:>8.0f} {kept['ingest']:>6.2f} "
              f"{idle[f'{who}_decode']:>13.1f} {hogged[f'{who}_decode']:>8.1f} {kept['decode']:>6.2f}")
        out.update({f"hog_{who}_{part}_kept": v for part, v in kept.items()})
    if llama is not None:
        for part in ("ingest", "decode"):
            out[f"{part}_vs_llama_idle"] = idle[f"ours_{part}"] / idle[f"llama_{part}"]
            out[f"{part}_vs_llama_hogged"] = hogged[f"ours_{part}"] / hogged[f"llama_{part}"]
        print(f"ours / llama.cpp: ingest {out['ingest_vs_llama_idle']:.2f}x idle, {out['ingest_vs_llama_hogged']:.2f}x "
              f"hogged; decode {out['decode_vs_llama_idle']:.2f}x idle, {out['decode_vs_llama_hogged']:.2f}x hogged")
    return out


def gguf_types(types: list[str], tokens: int) -> None:
    """Perplexity of the embedded model re-exported in each GGUF type (see the module doc)."""
    import tempfile
    from pathlib import Path

    from streamer.sessions.gguf_write import export_gguf
    from streamer.sessions.models import load_model

    source = load_model("embedded").model
    results = {}
    print(f"perplexity on {tokens} tokens of the bundled log, the embedded model re-exported per GGUF type:")
    baseline = Ours("fp32").perplexity(tokens)
    print(f"  {'fp32':>6} {baseline:8.3f}  (the embedded Q4_1 file dequantized, run as fp32: the reference)")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in types:
            path = Path(tmp) / f"SmolLM2-135M-Instruct.{kind}.gguf"
            written = export_gguf(source, path, kind, embedded_gguf_path())
            o = Ours("auto", str(path))
            results[kind] = ppl = o.perplexity(tokens)
            w = o.runner.weights
            repack = f"; repacked at load: {w.repack}" if w.repack else ""
            print(f"  {kind:>6} {ppl:8.3f}  (ran as {w.format} from {w.source}; tensors written {written}; "
                  f"{path.stat().st_size / 1e6:.0f} MB file{repack})")
            path.unlink()
    print("RESULT ppl_fp32=%.3f " % baseline + " ".join(f"ppl_{k}={v:.3f}" for k, v in results.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="512,4096")
    ap.add_argument("--formats", default="fp32,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ppl-tokens", type=int, default=1024, help="0 skips perplexity")
    ap.add_argument("--gguf-types", default="", help="perplexity per GGUF type only (see above)")
    ap.add_argument("--hog", action="store_true",
                    help="also ingest and decode at the smallest size with one core taken by a busy process")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.gguf_types:
        gguf_types(args.gguf_types.split(","), args.ppl_tokens or 1024)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    formats = args.formats.split(",")
    ours = {fmt: Ours(fmt) for fmt in formats}
    try:
        llama = LlamaCpp(args.threads, max(sizes) + 256, n_batch=STEP_TOKENS)
    except ImportError:
        llama = None
        print("llama-cpp-python is not installed: ours only (pip install llama-cpp-python)")
    print(f"threads={args.threads}  load average {os.getloadavg()[0]:.1f} at start")
    bandwidth = [stream_bandwidth()]
    llama_ingest: dict[int, float] = {}
    paired: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (format, size) -> (bytes/s near, s/token) a round
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    for size in sizes:
        ids = next(iter(ours.values())).prepare(size)
        for fmt in formats[1:]:
            ours[fmt].prepare(size)
        question = len(ids) - len(next(iter(ours.values())).contexts[size])
        if llama is not None:
            llama_ingest[size] = llama.prefill_rate(ids[:-question])
        engines = {f"ours-{fmt}": (lambda t, s=size, o=ours[fmt]: o.answer(s, t)) for fmt in formats}
        if llama is not None:  # each answer reuses the evaluated context: the question, then the answer
            # the context is reused, the question evaluated each time, as ours forks it each time
            # (reusing everything cached, a repeated question would cost llama.cpp one token)
            engines["llama.cpp"] = lambda t, i=ids, c=len(ids) - question: (llama.answer(i, t, c),
                                                                           llama.decode_rate(i, t))
        for _ in range(args.reps):
            for name, run in engines.items():
                r = results.setdefault((name, size), {"a8": [], "a64": [], "decode": []})
                r["a8"].append(run(8)[0])
                fmt = name.removeprefix("ours-") if name.startswith("ours-") else None
                before = stream_bandwidth(PAIR_REPS) if fmt else 0.0  # the bandwidth right before and after
                total, per_token = run(64)
                if fmt:
                    near = (before + stream_bandwidth(PAIR_REPS)) / 2
                    bandwidth.append(near)
                    paired.setdefault((fmt, size), []).append((near, per_token))
                r["a64"].append(total)
                r["decode"].append(per_token)
    bandwidth.append(stream_bandwidth())  # before and after the timed rounds
    med = {k: {m: statistics.median(v) for m, v in r.items()} for k, r in results.items()}
    names = [f"ours-{f}" for f in formats] + (["llama.cpp"] if llama is not None else [])
    print(f"\n{'context':>8} {'engine':>12} {'decode ms/tok':>14} {'8-tok answer ms':>16} {'64-tok answer ms':>17} "
          f"{'ingest tok/s':>13}")
    for size in sizes:
        for name in names:
            m = med[(name, size)]
            ingest = (llama_ingest if name == "llama.cpp" else ours[name[5:]].ingest)[size]
            print(f"{size:>8} {name:>12} {m['decode'] * 1000:>14.1f} {m['a8'] * 1000:>16.0f} {m['a64'] * 1000:>17.0f} "
                  f"{ingest:>13.0f}")
    best = "int4" if "int4" in formats else formats[-1]
    ratios = {}
    print(f"\nbandwidth floor: a decode step reads the linear weights once and the K/V once; the stream bandwidth "
          f"is probed right before and after each of our 64-token answers ({PAIR_REPS} reads each), and each answer "
          f"is held to the floor of its own probes (this machine's bandwidth moves with its neighbours: "
          f"{min(bandwidth) / 1e9:.1f}-{max(bandwidth) / 1e9:.1f} GB/s in this run, {args.threads} threads)")
    print(f"{'context':>8} {'engine':>12} {'MB a step':>10} {'GB/s near':>10} {'floor ms':>9} {'ms/tok':>7} "
          f"{'of limit':>9}  (medians over rounds; of limit: each round's floor / its ms/tok)")
    of_limit: dict[tuple[str, int], float] = {}  # (format, size) -> the median over rounds of floor / ms a token
    for size in sizes:
        for fmt in formats:
            nbytes = step_bytes(ours[fmt].runner, size)
            rounds = paired[(fmt, size)]
            of_limit[(fmt, size)] = statistics.median(nbytes / near / took for near, took in rounds)
            near, took = statistics.median(b for b, _ in rounds), statistics.median(t for _, t in rounds)
            print(f"{size:>8} {'ours-' + fmt:>12} {nbytes / 1e6:>10.1f} {near / 1e9:>10.1f} "
                  f"{nbytes / near * 1000:>9.2f} {took * 1000:>7.2f} {of_limit[(fmt, size)]:>9.2f}")
    over = [(fmt, size) for (fmt, size), x in of_limit.items() if x > 1.0]
    if over:
        llc = last_level_cache_bytes()
        where = f"this CPU's last-level cache holds {llc / 1e6:.0f} MB" if llc else "this CPU's cache size is unknown"
        print(f"above 1.0 ({', '.join(f'{f} at {s}' for f, s in over)}): part of a step's bytes came from the CPU's "
              f"cache, not memory ({where}; the floor counts every byte from memory, as on a machine whose cache "
              f"the weights and K/V do not fit)")
    small, large = min(sizes), max(sizes)
    ratios["decode512_of_limit"], ratios["decode4k_of_limit"] = of_limit[(best, small)], of_limit[(best, large)]
    ratios["ingest_tok_s"] = statistics.median(ours[best].ingest[s] for s in sizes)
    ratios["stream_gb_s"] = statistics.median(bandwidth) / 1e9
    if llama is not None:
        print(f"\nours-{best} / llama.cpp (decode: lower is better; answers: llama.cpp time / ours, higher is better)")
        for size in sizes:
            o, ll = med[(f"ours-{best}", size)], med[("llama.cpp", size)]
            print(f"{size:>8}  decode {o['decode'] / ll['decode']:.2f}x   answer8 {ll['a8'] / o['a8']:.2f}x   "
                  f"answer64 {ll['a64'] / o['a64']:.2f}x   ingest {ours[best].ingest[size] / llama_ingest[size]:.2f}x")
        ratios["decode512_vs_llama"] = med[(f"ours-{best}", small)]["decode"] / med[("llama.cpp", small)]["decode"]
        ratios["decode4k_vs_llama"] = med[(f"ours-{best}", large)]["decode"] / med[("llama.cpp", large)]["decode"]
        ratios["answer8_llama_vs_ours"] = med[("llama.cpp", large)]["a8"] / med[(f"ours-{best}", large)]["a8"]
        ratios["answer64_min_llama_vs_ours"] = min(med[("llama.cpp", s)]["a64"] / med[(f"ours-{best}", s)]["a64"]
                                                   for s in sizes)
        ratios["ingest_vs_llama"] = statistics.median(ours[best].ingest[s] / llama_ingest[s] for s in sizes)
    if "fp32" in formats and best != "fp32":
        ratios["int4_vs_fp32_decode"] = statistics.median(
            med[("ours-fp32", s)]["decode"] / med[(f"ours-{best}", s)]["decode"] for s in sizes)
    if best == "int4":
        ratios.update(ingest_paths(ours[best], sizes, args.reps))
    if args.hog:
        ratios.update(contention(ours[best], llama, small, args.reps))
    if args.ppl_tokens:
        print(f"\nperplexity on {args.ppl_tokens} tokens of the bundled log:")
        for fmt, o in ours.items():
            print(f"  {fmt:>5} {o.perplexity(args.ppl_tokens):8.3f}  ({o.runner.weights.source}, "
                  f"{o.runner.weights.linear_bytes / 1e6:.0f} MB of linear weights)")
    if llama is not None:
        llama.close()
    keys = ["decode512_vs_llama", "decode4k_vs_llama", "answer8_llama_vs_ours", "answer64_min_llama_vs_ours",
            "ingest_vs_llama", "int4_vs_fp32_decode", "decode512_of_limit", "decode4k_of_limit", "ingest_tok_s",
            "stream_gb_s"]
    keys += [k for k in ratios if k not in keys]  # the kernel paths' and --hog's
    print("RESULT " + " ".join(f"{k}={ratios[k]:.2f}" if k in ratios else f"{k}=n/a" for k in keys))


if __name__ == "__main__":
    main()
