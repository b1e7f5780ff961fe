"""The fused Triton attention kernels against torch SDPA (and flash-attn where installed).

On a CUDA machine, for each kernel over 1-64 sessions and 512-32K cached tokens (bf16, 32 query
heads, 8 kv heads of 128 by default), side by side in one run:
  - decode: one new token per session over its cache (an extent of a pool tensor, as the
    engine lays it out); versus SDPA on dense per-session caches of the same lengths;
  - two-range: a reasoning token over reading[0:L) and thinking[0:256) (dual thinking), fused
    in one pass versus two calls (one per range) and a log-sum-exp merge;
  - chunked prefill: a chunk of 256 new tokens per session over its cache, causal in the chunk;
    versus SDPA with the offset-causal mask;
  - shared prefix: S flash questions (16-token suffixes, decoding) over one session of L
    tokens, the prefix read once for all; versus SDPA over each question's own copy of
    prefix + suffix (what an engine without the shared-prefix kernel would run).
Reported per case: time, tokens/s, achieved GB/s against the bytes of KV the kernel must read,
and the speed ratio (baseline time / kernel time). Peak bandwidth comes from the device's
memory clock and bus width where torch reports them, and otherwise from a measured copy (the
copy's rate is printed beside it).

Run: python bench/kernels.py [--sessions 1,4,16,64] [--tokens 512,2048,8192,32768]
     [--dtype bfloat16] [--heads 32] [--kv-heads 8] [--head-dim 128]
The last line is `RESULT fused_vs_twocall=<x> decode_bw_fraction=<x>` (the geometric mean of
the two-range speedups over the sweep; the best decode bandwidth at the largest token count
over the peak), or `RESULT gpu=none` when no CUDA GPU is found.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

THINKING = 256
CHUNK = 256
SUFFIX = 16


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def timed(fn) -> float:
    """Median seconds of `fn` on the GPU (triton's do_bench: warm-up, L2 flushed per run)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src))
    return 2 * (1 << 31) / t


def baseline(fn) -> float | None:
    """Seconds of a baseline, or None where it does not fit in memory (SDPA's math path with
    an explicit mask materialises the scores)."""
    try:
        return timed(fn)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None


def peak_bandwidth(device: torch.device, copy: float) -> tuple[float, str]:
    """Bytes/s: from the memory clock and bus width when torch reports them, else the measured copy."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8, f"spec ({clock_khz / 1e6:.2f} GHz x {bus_bits} bit, DDR)"
    return copy, "measured copy (read + write)"


class Pool:
    """One layer of a KV pool: extents of a big tensor with gaps between them, as BlockPool
    places sessions (the kernels read them in place by address)."""

    def __init__(self, kv_heads: int, dim: int, extents: list[int], dtype, device, gap: int = 64) -> None:
        self.offsets, cursor = [], gap
        for n in extents:
            self.offsets.append(cursor)
            cursor += n + gap
        self.data = torch.randn((1, 2, kv_heads, cursor, dim), dtype=dtype, device=device)

    def range(self, i: int, length: int, causal_start: int | None = None):
        from streamer.kernels.triton_attention import KVRange

        sl = slice(self.offsets[i], self.offsets[i] + length)
        return KVRange(self.data[0, 0, :, sl], self.data[0, 1, :, sl], length, causal_start, self.data.stride(0))

    def dense(self, i: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        sl = slice(self.offsets[i], self.offsets[i] + length)
        return self.data[0, 0, :, sl], self.data[0, 1, :, sl]


def flash_attn():
    try:
        from flash_attn import flash_attn_with_kvcache
    except Exception:
        return None
    return flash_attn_with_kvcache


def report(kind: str, sessions: int, tokens: int, t: float, new_tokens: int, kv_bytes: int,
           baselines: dict[str, float | None]) -> None:
    ratios = " ".join(f"vs_{name}={tb / t:.2f}x" if tb else f"vs_{name}=oom" for name, tb in baselines.items())
    print(f"{kind:<13} sessions={sessions:<3} tokens={tokens:<6} time_us={t * 1e6:9.1f} "
          f"tokens_per_s={new_tokens / t:12.0f} GB_per_s={kv_bytes / t / 1e9:8.1f} {ratios}", flush=True)


def bench_decode(args, device, b: int, n: int, fa) -> tuple[float, int]:
    from streamer.kernels.triton_attention import AttentionPlan

    h, kvh, d, dtype = args.heads, args.kv_heads, args.head_dim, args.dtype
    pool = Pool(kvh, d, [n] * b, dtype, device)
    q = torch.randn(b, h, d, dtype=dtype, device=device)
    plan = AttentionPlan(h, kvh, d, device)
    for i in range(b):
        plan.sequence([i], [pool.range(i, n, causal_start=n - 1)])
    plan.build()
    out = torch.empty_like(q)
    t = timed(lambda: plan.run(q, out=out))
    kv_bytes = b * n * kvh * d * 2 * pool.data.element_size()
    k = torch.stack([pool.dense(i, n)[0] for i in range(b)])  # [b, kvh, n, d]
    v = torch.stack([pool.dense(i, n)[1] for i in range(b)])
    qs = q.unsqueeze(2)  # [b, h, 1, d]
    base = {"sdpa": baseline(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))}
    if fa is not None:
        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        lens = torch.full((b,), n, dtype=torch.int32, device=device)
        qf = q.unsqueeze(1)
        base["flash_attn"] = baseline(lambda: fa(qf, kf, vf, cache_seqlens=lens))
    report("decode", b, n, t, b, kv_bytes, base)
    return t, kv_bytes


def bench_two_range(args, device, b: int, n: int) -> float:
    from streamer.kernels.triton_attention import AttentionPlan

    h, kvh, d, dtype = args.heads, args.kv_heads, args.head_dim, args.dtype
    pool = Pool(kvh, d, [n, args.thinking + 1] * b, dtype, device)
    q = torch.randn(b, h, d, dtype=dtype, device=device)
    reading = [pool.range(2 * i, n) for i in range(b)]
    thinking = [pool.range(2 * i + 1, args.thinking + 1, causal_start=args.thinking) for i in range(b)]
    fused = AttentionPlan(h, kvh, d, device)
    for i in range(b):
        fused.sequence([i], [reading[i], thinking[i]])
    fused.build()
    first, second = AttentionPlan(h, kvh, d, device), None
    for i in range(b):
        first.partial([i], [reading[i]], slot=0)
    first.build()
    second = AttentionPlan(h, kvh, d, device)
    for i in range(b):
        second.partial([i], [thinking[i]], slot=first.n_slots)
    second.build()
    slots = second.n_slots
    bufs = (torch.empty((slots, b, h, d), dtype=torch.float32, device=device),
            torch.empty((slots, b, h), dtype=torch.float32, device=device))
    out = torch.empty_like(q)

    def two_calls():
        first.run(q, out=out, partials=bufs, merge=False)
        second.run(q, out=out, partials=bufs)

    t = timed(lambda: fused.run(q, out=out))
    t2 = timed(two_calls)
    kv_bytes = b * (n + args.thinking + 1) * kvh * d * 2 * pool.data.element_size()
    report("two_range", b, n, t, b, kv_bytes, {"two_calls_merge": t2})
    return t2 / t


def bench_prefill(args, device, b: int, n: int, fa) -> None:
    from streamer.kernels.triton_attention import AttentionPlan

    h, kvh, d, dtype = args.heads, args.kv_heads, args.head_dim, args.dtype
    pool = Pool(kvh, d, [n + args.chunk] * b, dtype, device)
    q = torch.randn(b * args.chunk, h, d, dtype=dtype, device=device)
    plan = AttentionPlan(h, kvh, d, device)
    for i in range(b):
        plan.sequence(range(i * args.chunk, (i + 1) * args.chunk), [pool.range(i, n + args.chunk, causal_start=n)])
    plan.build()
    out = torch.empty_like(q)
    t = timed(lambda: plan.run(q, out=out))
    kv_bytes = b * (n + args.chunk) * kvh * d * 2 * pool.data.element_size()
    k = torch.stack([pool.dense(i, n + args.chunk)[0] for i in range(b)])
    v = torch.stack([pool.dense(i, n + args.chunk)[1] for i in range(b)])
    qs = q.view(b, args.chunk, h, d).transpose(1, 2)
    rows = n + torch.arange(args.chunk, device=device)
    mask = torch.arange(n + args.chunk, device=device)[None, :] <= rows[:, None]
    base = {"sdpa": baseline(lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True))}
    if fa is not None:
        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        lens = torch.full((b,), n, dtype=torch.int32, device=device)  # cached before the chunk
        qf = q.view(b, args.chunk, h, d)
        kc, vc = kf[:, n:].contiguous(), vf[:, n:].contiguous()
        base["flash_attn"] = baseline(lambda: fa(qf, kf, vf, kc, vc, cache_seqlens=lens, causal=True))
    report("prefill", b, n, t, b * args.chunk, kv_bytes, base)


def bench_shared_prefix(args, device, forks: int, n: int) -> None:
    from streamer.kernels.triton_attention import AttentionPlan

    h, kvh, d, dtype = args.heads, args.kv_heads, args.head_dim, args.dtype
    pool = Pool(kvh, d, [n] + [SUFFIX] * forks, dtype, device)
    q = torch.randn(forks, h, d, dtype=dtype, device=device)
    plan = AttentionPlan(h, kvh, d, device)
    plan.forks([[i] for i in range(forks)], [pool.range(0, n)],
               [[pool.range(1 + i, SUFFIX, causal_start=SUFFIX - 1)] for i in range(forks)])
    plan.build()
    out = torch.empty_like(q)
    t = timed(lambda: plan.run(q, out=out))
    elem = pool.data.element_size()
    kv_bytes = (n + forks * SUFFIX) * kvh * d * 2 * elem
    pk, pv = pool.dense(0, n)
    k = torch.stack([torch.cat([pk, pool.dense(1 + i, SUFFIX)[0]], 1) for i in range(forks)])
    v = torch.stack([torch.cat([pv, pool.dense(1 + i, SUFFIX)[1]], 1) for i in range(forks)])
    qs = q.unsqueeze(2)
    base = {"sdpa_per_question": baseline(lambda: F.scaled_dot_product_attention(qs, k, v, enable_gqa=True))}
    report("shared_prefix", forks, n, t, forks, kv_bytes, base)


def check(args, device) -> None:
    """Before timing: the kernels on this GPU against the reference, on a small case of each."""
    from streamer.kernels.reference import cache_attention, forked_attention, ranges_attention
    from streamer.kernels.triton_attention import AttentionPlan

    h, kvh, d, dtype = args.heads, args.kv_heads, args.head_dim, args.dtype
    lengths = [1000, 300, 700] + [SUFFIX] * 3
    pool = Pool(kvh, d, lengths, dtype, device)
    q = torch.randn(40, h, d, dtype=dtype, device=device)
    plan = AttentionPlan(h, kvh, d, device)
    plan.sequence([0], [pool.range(0, 1000, causal_start=999)])  # decode
    plan.sequence(range(1, 34), [pool.range(1, 300), pool.range(2, 600, causal_start=567)])  # two ranges, a chunk
    fork_tokens = [[34], [35, 36], [37, 38, 39]]  # three questions over 900 shared tokens
    plan.forks(fork_tokens, [pool.range(0, 900)],
               [[pool.range(3 + i, SUFFIX, causal_start=SUFFIX - len(t))] for i, t in enumerate(fork_tokens)])
    out = plan.run(q).float()
    qf = q.float().transpose(0, 1)
    dense = [tuple(x.float() for x in pool.dense(i, n)) for i, n in enumerate(lengths)]
    expected = [cache_attention(qf[:, 0:1], *dense[0], 999),
                ranges_attention(qf[:, 1:34], [(*dense[1], 300)], *dense[2], 567)]
    expected += forked_attention([qf[:, t[0]:t[-1] + 1] for t in fork_tokens], [(*dense[0], 900)],
                                 [(*dense[3 + i], SUFFIX - len(t)) for i, t in enumerate(fork_tokens)])
    got = [out[0:1], out[1:34]] + [out[t[0]:t[-1] + 1] for t in fork_tokens]
    worst = max(float((g - e).abs().max()) for g, e in zip(got, expected))
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3 if dtype == torch.float16 else 1e-4
    print(f"check: largest difference from the reference {worst:.2e} (tolerance {tol:.0e})", flush=True)
    if not worst <= tol:
        raise SystemExit("the kernels disagree with the reference on this GPU")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=ints, default=[1, 4, 16, 64])
    parser.add_argument("--tokens", type=ints, default=[512, 2048, 8192, 32768])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kernels", default="decode,two_range,prefill,shared_prefix")
    parser.add_argument("--chunk", type=int, default=CHUNK, help="new tokens per session in prefill")
    parser.add_argument("--thinking", type=int, default=THINKING, help="thinking-range tokens in two-range")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    if not torch.cuda.is_available():
        print("no CUDA GPU found: the Triton kernels are benchmarked only on a CUDA device "
              "(their correctness runs on the CPU in tests/kernels under TRITON_INTERPRET=1)")
        print("RESULT gpu=none")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: pip install 'streamer[triton]'", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device)
    copy = copy_bandwidth(device)
    peak, source = peak_bandwidth(device, copy)
    fa = flash_attn()
    print(f"device {name}; peak bandwidth {peak / 1e9:.0f} GB/s from {source}; measured copy "
          f"{copy / 1e9:.0f} GB/s; dtype {args.dtype}; "
          f"{args.heads} heads, {args.kv_heads} kv heads of {args.head_dim}; "
          f"flash-attn {'found' if fa else 'not installed'}", flush=True)
    check(args, device)
    kinds = set(args.kernels.split(","))
    fused_ratios, decode_bw = [], {}
    for n in args.tokens:
        for b in args.sessions:
            if "decode" in kinds:
                t, kv_bytes = bench_decode(args, device, b, n, fa)
                decode_bw[n] = max(decode_bw.get(n, 0.0), kv_bytes / t)
            if "two_range" in kinds:
                fused_ratios.append(bench_two_range(args, device, b, n))
            if "prefill" in kinds:
                bench_prefill(args, device, b, n, fa)
            if "shared_prefix" in kinds:
                bench_shared_prefix(args, device, b, n)
            torch.cuda.empty_cache()
    fused = math.exp(sum(math.log(r) for r in fused_ratios) / len(fused_ratios)) if fused_ratios else float("nan")
    top = max(decode_bw) if decode_bw else None
    fraction = decode_bw[top] / peak if top else float("nan")
    if top:
        print(f"decode at {top} tokens: best {decode_bw[top] / 1e9:.0f} GB/s = {decode_bw[top] / peak:.2f} of the "
              f"{peak / 1e9:.0f} GB/s peak, {decode_bw[top] / copy:.2f} of the measured copy")
    print(f"RESULT fused_vs_twocall={fused:.2f} decode_bw_fraction={fraction:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
