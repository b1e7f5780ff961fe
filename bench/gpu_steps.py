"""Where a model step's time goes on a CUDA GPU, attention backend by backend, side by side.

For each backend (reference, triton) on the same model (default: the embedded SmolLM2-135M):
the bundled lighthouse log read into one session cache in chunks of --chunk tokens, then
--decode tokens decoded one at a time over it. Printed per backend: the first chunk and first
decode step (a backend that compiles pays it there), the median of the rest, and the Triton
kernels' compiled variants afterwards (none should be added after the backend was chosen:
kernels/triton_attention.py `warm_up`). Then one chunk and one decode step of each backend
under torch.profiler: the top CUDA kernels and CPU operations by their own time, so a gap
between the backends can be read off.

Run: python bench/gpu_steps.py [--model embedded] [--chunk 150] [--decode 32] [--dtype float32]
Last line: `RESULT chunk_ms_reference=<x> chunk_ms_triton=<x> decode_ms_reference=<x>
decode_ms_triton=<x> triton_vs_reference_chunk=<x> variants_added=<n>`, or `RESULT gpu=none`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from importlib import resources

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000


def run_backend(runner, ids: list[int], chunk: int, decode: int) -> dict:
    from streamer.sessions.runner import SeqStep

    cache = runner.new_cache(len(ids) + decode + chunk + 16)  # room for the profiled steps
    chunks, pos = [], 0

    def step(tokens):
        nonlocal pos
        runner.forward([SeqStep(cache, pos, tokens)], logits="last")
        cache.commit(pos + len(tokens))
        pos += len(tokens)

    for lo in range(0, len(ids), chunk):
        chunks.append(timed(lambda: step(ids[lo:lo + chunk])))
    decodes = [timed(lambda: step([ids[i % len(ids)]])) for i in range(decode)]
    return {"chunk_first": chunks[0], "chunk": statistics.median(chunks[1:] or chunks), "decode_first": decodes[0],
            "decode": statistics.median(decodes[1:] or decodes), "tokens": pos, "step": step}


def profile(step, ids: list[int], chunk: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(ids[:chunk])
        step(ids[:1])
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--chunk", type=int, default=150, help="tokens per prefill chunk (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=32, help="decode steps after the document (default: %(default)s)")
    parser.add_argument("--no-profile", action="store_true", help="skip the torch.profiler tables")
    args = parser.parse_args(argv)
    if args.chunk < 1 or args.decode < 1:
        parser.error("--chunk and --decode must be at least 1")
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure here")
        print("RESULT gpu=none")
        return 0
    from streamer.kernels.backend import triton_kernels
    from streamer.sessions.models import load_model
    from streamer.sessions.runner import ModelRunner

    compiled_variants = triton_kernels().compiled_variants

    lm = load_model(args.model, args.dtype, "cuda")
    runner = ModelRunner(lm.model, lm.tokenizer, lm.name)
    text = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text(encoding="utf-8")
    ids = runner.tokenize(text)
    print(f"GPU: {torch.cuda.get_device_name()}; {lm.name} {args.dtype}; {len(ids)} tokens in chunks of {args.chunk}")
    results, added = {}, 0
    for backend in ("reference", "triton"):
        started = time.perf_counter()
        runner.set_attention_backend(backend)
        chosen_ms = (time.perf_counter() - started) * 1000
        before = compiled_variants() if backend == "triton" else 0
        r = results[backend] = run_backend(runner, ids, args.chunk, args.decode)
        if backend == "triton":
            added = compiled_variants() - before
        print(f"{backend:9}  backend chosen in {chosen_ms:7.0f} ms  chunk: first {r['chunk_first']:7.1f} ms, "
              f"median {r['chunk']:6.1f} ms   decode over {r['tokens']} tokens: first {r['decode_first']:7.1f} ms, "
              f"median {r['decode']:5.2f} ms" + (f"   variants compiled {before}, added while stepping {added}"
                                                   if backend == "triton" else ""), flush=True)
    if not args.no_profile:
        for backend in ("reference", "triton"):
            runner.set_attention_backend(backend)
            print(f"\n--- profile: one chunk of {args.chunk} and one decode step, {backend} ---")
            profile(results[backend]["step"], ids, args.chunk)
    ref, tri = results["reference"], results["triton"]
    print(f"RESULT chunk_ms_reference={ref['chunk']:.1f} chunk_ms_triton={tri['chunk']:.1f} "
          f"decode_ms_reference={ref['decode']:.2f} decode_ms_triton={tri['decode']:.2f} "
          f"triton_vs_reference_chunk={ref['chunk'] / tri['chunk']:.2f} variants_added={added}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
