"""streamer's C kernels (kernels/cpu/streamer_cpu.c) against torch references.

- The quantized linear layer computes exactly its arithmetic (Q4_1 or Q8_0 weights, int8
  activations per block of 32), for every shape of tail, and a row's output never depends on
  the other rows or on the thread count.
- The decoder stack equals the Hugging Face model running the same linear layers with the
  torch reference attention (fp32 cache), over every kind of sequence a step holds: plain
  prefills, decode rows, a pool cache behind a shared prefix, forks over a session's reading
  (grouped), positions that start elsewhere (dual thinking). With the fp16 cache (the default)
  it equals a reference whose keys and values are rounded to fp16.
- Batch invariance: a sequence gets bit for bit the same logits and cache alone or in a step
  with others, and with one thread or two.
- Every code path (AVX-512 VNNI, AVX2, portable C: each built here with its flags) computes the
  same arithmetic and keeps these properties; a missing compiler is a clear error.
"""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from streamer.kernels import cpu as ck
from streamer.kernels.governor import GOVERNOR
from streamer.sessions.kvcache import KVCache, KVShape
from streamer.sessions.models import build_tiny_model
from streamer.sessions.native import NativeStack, QuantMatrix, quantize, quantize_q4_1, quantize_q8_0
from streamer.sessions.pool import BlockPool, PagedCache
from streamer.sessions.runner import ModelRunner, SeqStep
from streamer.sessions.weights import apply_weights

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"the C kernels do not build here: {ck.unavailable_reason()}")


def reference_linear(x: torch.Tensor, bits: int, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' arithmetic in float64: activations quantized per 32 (d = amax / 127, codes
    round(x * (127 / amax)), as float32 computes them), weights dequantized from their blocks."""
    n, k = codes.shape
    w = codes.double().reshape(n, k // 32, 32)
    w = (w - 128) * d.double()[..., None] if bits == 8 else w * d.double()[..., None] + m.double()[..., None]
    rows = x.shape[0]
    g = x.float().reshape(rows, k // 32, 32)
    amax = g.abs().amax(-1)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(g * inv[..., None]).clamp(-127, 127)
    xq = (q.double() * (amax / 127.0).double()[..., None]).reshape(rows, k)
    out = xq @ w.reshape(n, k).T
    return (out if bias is None else out + bias.double()).float()


SHAPES = [(48, 64), (96, 576), (100, 96), (20, 160), (36, 224), (40, 32), (6, 1536), (3, 128)]
PATHS = ["native", "avx2", "portable"]  # kernels/cpu.py VARIANTS


def path_lib(name: str):
    """The library of one code path, built here (the AVX2 one only where the CPU has AVX2)."""
    try:
        lib = ck.load(name)
    except ck.KernelBuildError as exc:
        pytest.skip(f"the {name} build fails here: {exc}")
    if name == "avx2" and ck.simd(lib) != "avx2":
        pytest.skip("this CPU has no AVX2 (with FMA and F16C)")
    return lib


def linear_with(lib, matrix: QuantMatrix, x: torch.Tensor) -> torch.Tensor:
    return lib.linear(matrix.c, x.contiguous(), torch.empty(x.shape[0], matrix.n))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n,k", SHAPES)
def test_the_linear_kernel_computes_its_arithmetic(bits, n, k, path):
    lib = path_lib(path)
    torch.manual_seed(n * k + bits)
    w = torch.randn(n, k) * 0.05
    bias = torch.randn(n) if n % 2 else None
    if bits == 8:
        codes, d = quantize_q8_0(w)
        m = None
    else:
        codes, d, m = quantize_q4_1(w)
    matrix = QuantMatrix.pack(bits, codes, d, m, bias)
    x = torch.randn(40, k) * 3  # on AMX: two tiles of 16 rows and 8 rows on the vector path
    got = linear_with(lib, matrix, x)
    want = reference_linear(x, bits, codes, d, m, bias)
    assert (got - want).abs().max().item() <= 2e-6 * max(1.0, want.abs().max().item())
    exact = x @ w.T + (0 if bias is None else bias)
    assert (got - exact).norm() <= 0.15 * exact.norm()  # and it is the float layer, to 4 or 8 bits


def test_the_avx512_path_quantizes_and_multiplies_as_the_avx2_path_does():
    """AVX-512 quantizes a row's activations 16 blocks at a time (their maxima and sums reduced
    together, one division for 16 scales), AVX2 a block at a time: the same codes and scales, so
    the same bits out of the linear layer, also for a block of zeros, one huge input and a block
    of tiny ones, at widths of 18 blocks (16 together, 2 alone) and 48."""
    native, avx2 = path_lib("native"), path_lib("avx2")
    if ck.simd(native) != "avx512-vnni":
        pytest.skip("this CPU has no AVX-512 VNNI: the native path is the AVX2 one")
    for k in (576, 1536):
        torch.manual_seed(k)
        w = torch.randn(48, k) * 0.05
        x = torch.randn(40, k) * 3
        x[:, 32:64] = 0
        x[1, 100], x[2, 200:232] = 1e30, 1e-30
        for bits in (4, 8):
            codes, d, *m = quantize_q8_0(w) if bits == 8 else quantize_q4_1(w)
            matrix = QuantMatrix.pack(bits, codes, d, m[0] if m else None, None)
            assert torch.equal(linear_with(native, matrix, x), linear_with(avx2, matrix, x)), (k, bits)


@pytest.mark.parametrize("path", PATHS)
def test_a_row_never_depends_on_the_others_or_the_threads(path):
    torch.manual_seed(3)
    linear = torch.nn.Linear(576, 200, bias=False)
    x = torch.randn(300, 576)
    lib = path_lib(path)
    threads = lib.ceiling
    with GOVERNOR.fixed():  # exactly the counts set here, whatever the machine's load
        try:
            for bits in (4, 8):
                matrix = quantize([linear], bits)
                assert lib.set_threads(2) == 2
                full = linear_with(lib, matrix, x)
                for lo, hi in ((0, 1), (5, 8), (17, 81), (299, 300)):
                    assert torch.equal(linear_with(lib, matrix, x[lo:hi]), full[lo:hi])
                assert lib.set_threads(1) == 1
                assert torch.equal(linear_with(lib, matrix, x), full)
        finally:
            lib.set_threads(threads)


def test_amx_tiles_give_the_vector_path_s_bits():
    """Where the CPU has AMX, tiles of 16 rows run their block sums on the tile unit and the vector
    path's float epilogue: every row, whatever the number of rows (whole tiles, rows left over,
    several row blocks of 32), equals the vector path's bit for bit, 4- and 8-bit, partial groups
    and biases, a thread's groups in one chunk of codes or several (k = 4096: 8 groups a chunk);
    sk_set_amx(0) turns it off."""
    lib = ck.load()
    if not lib.amx():
        pytest.skip("no AMX here (a CPU before Sapphire Rapids, or the kernel refused it)")
    torch.manual_seed(5)
    try:
        for bits in (4, 8):
            for n, k, bias in ((200, 576, True), (36, 1536, False), (16, 32, True), (600, 4096, False)):
                matrix = quantize([torch.nn.Linear(k, n, bias=bias)], bits)
                for rows in (16, 17, 47, 130, 300):
                    x = torch.randn(rows, k) * 3
                    assert lib.set_amx(True) and lib.amx()
                    tiles = linear_with(lib, matrix, x)
                    assert not lib.set_amx(False) and not lib.amx()
                    assert torch.equal(tiles, linear_with(lib, matrix, x)), (bits, n, k, rows)
    finally:
        lib.set_amx(True)


def test_streamer_amx_0_keeps_every_row_on_the_vector_path():
    code = "from streamer.kernels import cpu; print(cpu.load().amx())"
    got = subprocess.run([sys.executable, "-c", code], env={**os.environ, "STREAMER_AMX": "0"}, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 0 and got.stdout.strip() == "False", got.stderr


def test_views_of_a_fused_matrix_are_its_rows():
    torch.manual_seed(4)
    a, b = torch.nn.Linear(64, 32), torch.nn.Linear(64, 8)
    fused = quantize([a, b], 4)
    x = torch.randn(3, 64)
    both = fused(x)
    assert torch.equal(fused.rows(0, 32)(x), both[:, :32]) and torch.equal(fused.rows(32, 40)(x), both[:, 32:])
    with pytest.raises(ValueError, match="whole groups of 16"):
        fused.rows(8, 32)


# ---- the decoder stack ------------------------------------------------------------------------


def tiny_runners(tokenizer, kv_dtype, seed=21, path="native", model=None, **shape):
    """The same int4 model twice: on the native stack with `kv_dtype` (its layers on the code
    path `path`), and through the Hugging Face forward (same C linear layers) with the torch
    reference attention on an fp32 cache. `model`: another tiny model than the Llama."""
    lm = build_tiny_model(tokenizer, seed=seed, **shape) if model is None else model
    info = apply_weights(lm.model, "int4", native=True)
    native = ModelRunner(lm.model, tokenizer, lm.name, info)
    native.native = NativeStack(lm.model, kv_dtype, path_lib(path))
    s = native.kv_shape
    native.kv_shape = KVShape(s.layers, s.kv_heads, s.head_dim, kv_dtype, s.device)
    ref = ModelRunner(lm.model, tokenizer, lm.name, info)
    ref.native = None
    ref.kv_shape = KVShape(s.layers, s.kv_heads, s.head_dim, torch.float32, s.device)
    return native, ref


def ids_of(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


class World:
    """Caches for one runner: a pool with a shared system prompt and a session behind it, a
    private session, and forks over the private session's reading."""

    def __init__(self, runner, prompt: list[int], reading: list[int], pool_tokens: int = 1024) -> None:
        self.runner = runner
        self.pool = BlockPool(runner.kv_shape, pool_tokens * runner.kv_shape.bytes_per_token, block_size=16)
        prefix = self.pool.prefix_for(prompt)
        runner.forward([SeqStep(prefix, 0, prompt[:prefix.length])], logits="none")
        prefix.commit(prefix.length)
        self.paged = PagedCache(self.pool, 4096, prefix)
        self.private = runner.new_cache(4096)
        self.step([SeqStep(self.paged, prefix.length, reading[:40]), SeqStep(self.private, 0, reading)])
        self.forks = [KVCache(runner.kv_shape, 256) for _ in range(3)]

    def step(self, seqs: list[SeqStep], logits: str = "all"):
        out = self.runner.forward(seqs, logits=logits)
        for s in seqs:
            if s.cache.length == s.start:
                s.cache.commit(s.start + s.n)
        return out

    def mixed_step(self, reading: list[int]) -> list[SeqStep]:
        """One step holding every kind of sequence."""
        prefixes = ((self.private, self.private.length),)
        return [
            SeqStep(self.paged, self.paged.length, reading[40:47]),  # a chunk behind a shared prefix
            SeqStep(self.private, self.private.length, [reading[3]]),  # a decode row
            SeqStep(self.forks[0], 0, reading[:12], prefixes=prefixes),  # a question, grouped with
            SeqStep(self.forks[1], 0, [reading[5]], prefixes=prefixes),  # a one-token one
            SeqStep(self.forks[2], 0, reading[:20], prefixes=prefixes, pos0=4000),  # and one placed elsewhere
        ]


def close_rows(got: torch.Tensor, want: torch.Tensor, share: float = 0.9) -> None:
    """Rows equal to float rounding, but for a few: where a ~1e-7 difference in the attention's
    float order moves an activation across an int8 rounding boundary, that row's logits move by
    one activation quantum (~1e-3). One layer keeps such a flip in its own row."""
    err = (got - want).abs().amax(dim=1) / max(1.0, want.abs().max().item())
    assert (err <= 2e-5).float().mean().item() >= share, err
    assert err.max().item() <= 0.05


@pytest.mark.parametrize("path", PATHS)
def test_the_stack_equals_the_model_with_reference_attention(tokenizer, path):
    """fp32 cache: only the order of float operations differs from the torch reference."""
    native, ref = tiny_runners(tokenizer, torch.float32, layers=1, path=path)
    prompt, reading = ids_of(37, 1), ids_of(300, 2)
    worlds = [World(r, prompt, reading) for r in (native, ref)]
    for _ in range(2):  # the second step decodes and extends every fork
        outs = [w.step(w.mixed_step(reading)) for w in worlds]
        close_rows(torch.cat(outs[0]), torch.cat(outs[1]))
    for cache in ("paged", "private"):
        a, b = (getattr(w, cache).snapshot() for w in worlds)
        assert (a - b).abs().max().item() <= 1e-5


@pytest.mark.parametrize("path", ["native", "avx2"])
def test_a_sequence_reads_the_same_alone_or_batched(tokenizer, path):
    """Logits and caches bit for bit: each sequence of a mixed step, run alone on a copy of the
    world, equals itself in the batch; and one thread equals two."""
    native, _ = tiny_runners(tokenizer, torch.float16, seed=22, path=path, hidden=256, heads=4, kv_heads=2)
    prompt, reading = ids_of(37, 3), ids_of(300, 4)
    lib = native.native.lib
    threads = lib.ceiling
    with GOVERNOR.fixed():  # two threads for the batch, one alone, whatever the machine's load
        try:
            assert lib.set_threads(2) == 2
            batched = World(native, prompt, reading)
            together = batched.step(batched.mixed_step(reading))
            for i in range(5):
                alone = World(native, prompt, reading)
                seqs = alone.mixed_step(reading)
                (out,) = alone.step([seqs[i]])
                assert torch.equal(out, together[i]), i
            lib.set_threads(1)
            single = World(native, prompt, reading)
            for a, b in zip(single.step(single.mixed_step(reading)), together):
                assert torch.equal(a, b)
            assert torch.equal(single.private.snapshot(), batched.private.snapshot())
        finally:
            lib.set_threads(threads)


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize("heads", [4, 3])
def test_a_sequence_reads_the_same_in_one_step_or_row_by_row(tokenizer, path, heads):
    """Logits and cache bit for bit, head_dim 64 on the fp16 cache (the SIMD attention): the rows
    of a long step are computed in tiles of 16 that merge their chunks inline, a row read alone
    as a short sequence whose chunks (a whole 1,024 and a tail) are separate tasks; the same
    operations either way, so replay in other step sizes equals the original. Three query heads
    a kv head (the embedded model's grouping): a tile's 48 queries take the AVX-512 scores four
    queries at a time (reduce16), a row alone its 3 one at a time (reduce4): the same sums."""
    native, _ = tiny_runners(tokenizer, torch.float16, seed=24, path=path, hidden=64 * heads, heads=heads,
                             kv_heads=1)
    ids = ids_of(1100, 6)
    whole = native.new_cache(1200)
    one_step = native.forward([SeqStep(whole, 0, ids)], logits="all")[0]
    whole.commit(len(ids))
    rows = native.new_cache(1200)
    native.forward([SeqStep(rows, 0, ids[:1060])], logits="none")
    rows.commit(1060)
    for i in range(1060, len(ids)):  # one row a step: few queries a task, keys past a whole chunk
        got = native.forward([SeqStep(rows, i, [ids[i]])], logits="all")[0]
        rows.commit(i + 1)
        assert torch.equal(got[0], one_step[i]), i
    assert torch.equal(rows.snapshot(), whole.snapshot())


def _fp16_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    group = query.shape[1] // key.shape[1]
    k = key.half().float().repeat_interleave(group, 1)
    v = value.half().float().repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(query, k, v, is_causal=query.shape[2] > 1, scale=scaling)
    return out.transpose(1, 2), None


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_the_fp16_cache_equals_a_reference_with_fp16_keys_and_values(tokenizer, head_dim, path):
    """One layer (so a rounding flip in one row's int8 activations cannot reach the others),
    head_dim 64 (the SIMD path) and 16 (the generic one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("streamer_test_fp16kv", _fp16_attention)
    AttentionMaskInterface.register("streamer_test_fp16kv", lambda *a, **k: None)
    native, _ = tiny_runners(tokenizer, torch.float16, seed=23, path=path, layers=1, hidden=4 * head_dim, heads=4,
                             kv_heads=2)
    ids = ids_of(600, 5)
    cache = native.new_cache(1024)
    got = native.forward([SeqStep(cache, 0, ids)], logits="all")[0]
    model = native.model
    model.set_attn_implementation("streamer_test_fp16kv")
    try:
        with torch.inference_mode():
            want = model(torch.tensor([ids])).logits[0].float()
    finally:
        model.set_attn_implementation("streamer_cache")
    close_rows(got, want, 0.85)


def test_a_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMER_CACHE", str(tmp_path))
    monkeypatch.setattr(ck, "compiler", lambda: None)
    with pytest.raises(ck.KernelBuildError, match="no C compiler found"):
        ck.build()
    monkeypatch.setattr(ck, "compiler", lambda: "false")
    with pytest.raises(ck.KernelBuildError, match="false failed to compile"):
        ck.build()


def test_engines_in_one_process_may_call_at_once(tokenizer):
    """Two runners stepping from two threads at once (two engines in one process) get what each
    gets alone: calls into the C library take turns."""
    import threading

    runners = [tiny_runners(tokenizer, torch.float16, seed=30 + i)[0] for i in range(2)]
    ids = ids_of(200, 7)

    def run(runner, out):
        cache = runner.new_cache(256)
        out.append(runner.forward([SeqStep(cache, 0, ids)], logits="all")[0])
        for i in range(20):
            out.append(runner.forward([SeqStep(cache, 200 + i, [ids[i]])])[0])

    alone = [[], []]
    for runner, out in zip(runners, alone):
        run(runner, out)
    together = [[], []]
    threads = [threading.Thread(target=run, args=(r, o)) for r, o in zip(runners, together)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for a, b in zip(alone, together):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_forked_child_runs_the_kernels_on_its_own_threads():
    """After fork() the child has none of the parent's worker threads; the pool starts over."""
    import os

    torch.manual_seed(8)
    matrix = quantize([torch.nn.Linear(64, 32)], 4)
    x = torch.randn(3, 64)
    want = matrix(x)  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the kernels run and agree
        try:
            ck.set_threads(2)
            os._exit(0 if torch.equal(matrix(x), want) else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    pytest.fail("the forked child hung in the C kernels")


@pytest.mark.parametrize("path", ["native", "avx2"])
@pytest.mark.parametrize("hidden", [64, 256])  # head_dim 16 (the generic attention path) and 64 (SIMD)
def test_a_row_reads_the_same_however_its_keys_are_split_into_ranges(tokenizer, hidden, path):
    """Chunks are cut by position in a row's whole key sequence, so a question read as a fork
    over a session behind a shared prefix (flash), written past the session's length (asked),
    and read statelessly with everything in one cache gives the same logits, bit for bit, and
    the same greedy continuation. The session's 1,132 keys span two chunks of 1,024."""
    native, _ = tiny_runners(tokenizer, torch.float16, seed=24, path=path, hidden=hidden, heads=4, kv_heads=2)
    prompt, reading, question = ids_of(37, 9), ids_of(1100, 10), ids_of(21, 11)
    world = World(native, prompt, reading[:40], pool_tokens=2048)
    world.step([SeqStep(world.paged, world.paged.length, reading[40:])], logits="none")
    length = world.paged.length  # the pool prefix (the prompt's 32 tokens in full blocks), then the reading
    assert length == 32 + len(reading)

    def answer(first_logits, step):
        """Four greedy tokens after the question, each step built by `step(position, token)`."""
        tokens, logits = [], first_logits[-1]
        for i in range(4):
            tokens.append(int(logits.argmax()))
            logits = native.forward([step(len(question) + i, tokens[-1])])[0]
        return tokens, logits

    fork = KVCache(native.kv_shape, 64)
    reads = ((world.paged, length),)
    as_fork = native.forward([SeqStep(fork, 0, question, prefixes=reads)], logits="all")[0]
    fork_answer = answer(as_fork, lambda at, t: SeqStep(fork, at, [t], prefixes=reads))
    asked = native.forward([SeqStep(world.paged, length, question)], logits="all")[0]
    asked_answer = answer(asked, lambda at, t: SeqStep(world.paged, length + at, [t]))
    fresh = native.new_cache(length + 64)
    stateless = native.forward([SeqStep(fresh, 0, prompt[:32] + reading + question)], logits="all")[0]
    stateless_answer = answer(stateless[-len(question):], lambda at, t: SeqStep(fresh, length + at, [t]))
    assert torch.equal(as_fork, asked) and torch.equal(as_fork, stateless[-len(question):])
    assert fork_answer[0] == asked_answer[0] == stateless_answer[0]
    assert torch.equal(fork_answer[1], asked_answer[1]) and torch.equal(fork_answer[1], stateless_answer[1])


def tiny_family(tokenizer, kind: str):
    """A seeded one-layer model of another family the native stack runs: Qwen2 (q/k/v biases),
    Qwen3 (per-head q/k norms), Mistral."""
    import transformers

    from streamer.sessions.models import LoadedModel

    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)
    if kind == "qwen3":
        common["head_dim"] = 16
    if kind == "mistral":
        common["sliding_window"] = None
    config = getattr(transformers, {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[kind])(**common)
    torch.manual_seed(40)
    cls = getattr(transformers, {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                 "mistral": "MistralForCausalLM"}[kind])
    model = cls(config).eval()
    if kind == "qwen2":  # random biases, so a dropped one would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    if kind == "qwen3":
        for layer in model.model.layers:
            torch.nn.init.normal_(layer.self_attn.q_norm.weight, mean=1.0, std=0.3)
            torch.nn.init.normal_(layer.self_attn.k_norm.weight, mean=1.0, std=0.3)
    return LoadedModel(model, tokenizer, f"tiny-{kind}")


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral"])
def test_the_stack_runs_the_other_families(tokenizer, kind):
    """Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Mistral on the native stack equal
    their Hugging Face forward over the same linear layers (fp32 cache), prefill and decode."""
    native, ref = tiny_runners(tokenizer, torch.float32, model=tiny_family(tokenizer, kind))
    ids = ids_of(120, 12)
    outs = []
    for runner in (native, ref):
        cache = runner.new_cache(256)
        rows = [runner.forward([SeqStep(cache, 0, ids[:100])], logits="all")[0]]
        for i in range(100, 120):
            rows.append(runner.forward([SeqStep(cache, i, [ids[i]])], logits="all")[0])
        outs.append(torch.cat(rows))
    close_rows(outs[0], outs[1])


def test_the_rotary_table_gives_the_module_s_values(tokenizer):
    """A step's cos/sin come from a table the stack grows a block of 1,024 positions at a time
    from the model's own rotary module: bit for bit the module's values for positions in any
    order and across blocks. A model whose frequencies move with a call's positions (dynamic
    RoPE) keeps no table."""
    native, _ = tiny_runners(tokenizer, torch.float32)
    stack = native.native
    for positions in (torch.tensor([5, 6, 7]), torch.tensor([2500, 17, 1023, 1024]), torch.arange(1000, 1100)):
        h = torch.zeros(len(positions), 64)
        cos, sin = stack._cos_sin(h, positions)
        want_cos, want_sin = stack.rotary(h[None], positions[None])
        assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
        assert cos.is_contiguous() and sin.is_contiguous()
    assert stack._rope[0].shape[0] == 3 * 1024  # grown to cover position 2,500
    lm = build_tiny_model(tokenizer, seed=3)
    apply_weights(lm.model, "int4", native=True)
    lm.model.model.rotary_emb.rope_type = "dynamic"
    assert NativeStack(lm.model, torch.float32)._rope is None


# ---- the C boundary: the ABI checked at load, sizes from C, one exception per error code ------


def test_the_library_states_its_abi_and_the_sizes_python_uses():
    lib = ck.load()
    ck.check_abi(lib.cdll)  # this build agrees with the declarations
    assert lib.block_bytes == {4: 256 + 64, 8: 512 + 32}  # 16 columns' codes, then their scales (and offsets)
    assert (lib.quant_block, lib.matrix_cols, lib.max_ranges, lib.max_group) == (32, 16, 16, 32)
    assert lib.group_bytes(8, 64) == 2 * lib.block_bytes[8] and lib.matrix_bytes(4, 17, 32) == 2 * lib.block_bytes[4]
    matrix = quantize([torch.nn.Linear(64, 32)], 4)
    assert matrix.group_bytes == 2 * lib.block_bytes[4]


def test_the_abi_check_bites():
    import ctypes

    lib = ck.load()
    with pytest.raises(ck.KernelAbiError, match=r"sk_qmat is 40 bytes in C, 48 in cpu.py"):
        ck.check_abi(lib.cdll, sizes={"qmat": 48})
    with pytest.raises(ck.KernelAbiError, match=f"ABI is version {ck.ABI_VERSION}, kernels/cpu.py declares"):
        ck.check_abi(lib.cdll, version=ck.ABI_VERSION + 1)

    class Wider(ctypes.Structure):  # a range declared with a field C does not have
        _fields_ = [*ck.Range._fields_, ("extra", ctypes.c_int64)]

    ck.STRUCTS["range"] = Wider
    try:
        with pytest.raises(ck.KernelAbiError, match="sk_range is 40 bytes in C, 48"):
            ck.Kernels(ctypes.CDLL(str(ck.build())))  # what load() does: it refuses the library
    finally:
        ck.STRUCTS["range"] = ck.Range


def _struct(c):
    """A model or plan structure as the kernels' typed objects carry it."""
    return type("Held", (), {"c": c})()


def test_each_error_code_is_its_own_exception():
    lib = ck.load()
    ctx = lib.context()  # its own buffers: the failed allocation below frees nothing of another caller's
    # SK_ENOMEM: 2^30 rows of 2^20 inputs need a 1 PiB activation buffer (rows alias one row: nothing is read)
    k = 1 << 20
    data = torch.zeros(lib.matrix_bytes(8, 16, k), dtype=torch.uint8)
    big = ck.QMat(8, 16, k, 0, lib.group_bytes(8, k), data.data_ptr(), None)
    x = torch.zeros(k).as_strided((1 << 30, k), (0, 1))
    y = torch.zeros(16).as_strided((1 << 30, 16), (0, 1))
    with pytest.raises(ck.KernelOutOfMemory, match=r"sk_linear failed \(-1\): out of memory") as oom:
        lib.linear(big, x, y, ctx)
    assert isinstance(oom.value, MemoryError) and oom.value.code == -1
    # SK_EINVAL: a width that is not whole blocks of 32
    odd = ck.QMat(4, 16, 40, 0, 0, data.data_ptr(), None)
    with pytest.raises(ck.KernelBadArgument, match=r"sk_linear failed \(-2\): a bad argument"):
        lib.linear(odd, torch.zeros(1, 40), torch.zeros(1, 16), ctx)
    # ... and query heads that are not a multiple of the kv heads
    h = torch.zeros(1, 64)
    empty = _struct(ck.Plan(0, 0, None, None, None, None, None))
    with pytest.raises(ck.KernelBadArgument, match=r"sk_forward failed \(-2\)"):
        lib.forward(_struct(ck.Model(1, 64, 4, 3, 16, 128, 1, 0, 1e-5, 0.25, None, None)), empty, h, h, ctx)
    # SK_EUNSUPPORTED: more query heads per kv head than the kernels take, or more read-only ranges
    with pytest.raises(ck.KernelUnsupported, match=r"sk_forward failed \(-3\): beyond what the kernels take"):
        lib.forward(_struct(ck.Model(1, 64, 2 * lib.max_group, 1, 16, 128, 1, 0, 1e-5, 0.25, None, None)),
                    empty, h, h, ctx)
    model = _struct(ck.Model(1, 64, 4, 2, 16, 128, 1, 0, 1e-5, 0.25, None, None))
    groups = (ck.Group * 1)(ck.Group(0, lib.max_ranges + 1))
    with pytest.raises(ck.KernelUnsupported, match=r"\(-3\)"):
        lib.forward(model, _struct(ck.Plan(0, 1, None, groups, None, None, None)), h, h, ctx)
    # SK_EPLAN: a sequence whose rows run past the step's
    seqs = (ck.Seq * 1)(ck.Seq(0, 5, 0, -1, ck.Range()))
    with pytest.raises(ck.KernelPlanError, match=r"sk_forward failed \(-4\): an inconsistent plan"):
        lib.forward(model, _struct(ck.Plan(1, 0, seqs, None, None, None, None)), h, h, ctx)
    with pytest.raises(ck.KernelError, match="an unknown error code"):
        ck.check("sk_forward", -99)
    matrix = quantize([torch.nn.Linear(64, 32)], 4)  # and the context whose allocation failed still runs
    assert torch.equal(lib.linear(matrix.c, h, torch.empty(1, 32), ctx), matrix(h))


def test_a_context_times_its_own_calls():
    """Step timings live in the caller's context (sk_ctx), not in the library: profiling one
    context times its calls and leaves another's counters alone."""
    lib = ck.load()
    mine, other = lib.context(), lib.context()
    matrix = quantize([torch.nn.Linear(256, 64)], 8)
    x = torch.randn(64, 256)
    mine.profile(True)
    for _ in range(3):
        lib.linear(matrix.c, x, torch.empty(64, 64), mine)
        lib.linear(matrix.c, x, torch.empty(64, 64), other)
    head = ck.PROFILE_PARTS.index("head")
    assert mine.profile(False)[0][head] > 0
    assert other.profile(False)[0][head] == 0
