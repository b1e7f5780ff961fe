"""Weight formats: the packed kernels compute what their format says, the embedded Q4_1 GGUF
loads into int4 as the same weights, `auto` follows its rule, and the exactness invariants hold
within each format (against the same model in the same format run statelessly).

int8 and int4 run on streamer's C kernels (the native stack, sessions/native.py) where they
build, else on ATen's packed kernels; both families are tested. The native stack computes every
row by the same operations whatever shares its step, so within a format it is its own oracle
and the invariants hold bit for bit: incremental equals one-shot, a question's greedy answer
equals a stateless run (a fresh cache, the context and question in one step, then greedy
decoding), replay equals the original."""

from itertools import pairwise

import pytest
import torch
from helpers import require_native
from streamer.sessions.jobs import PrefillJob, ReviseJob, drive
from streamer.sessions.models import build_tiny_model
from streamer.sessions.query import QueryJob
from streamer.sessions.runner import ModelRunner, SeqStep
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session
from streamer.sessions.weights import (
    GROUP,
    Bf16Linear,
    Int4Linear,
    Int8Linear,
    RowStableLinear,
    WeightFormatError,
    apply_weights,
    describe_weights,
    quantize_q4_1,
    resolve_format,
)
from torch import nn

TEXT = ("The lighthouse keeper was named Ada Morrow. She lived on Gull Island with a grey cat called "
        "Pepper. Every evening at six she lit the lamp, and the supply boat Marigold came on Tuesdays.")
# (format, native): bf16 on torch, int8/int4 on ATen's packed kernels, int8/int4 on the C kernels
FORMATS = [("bf16", None), ("int8", False), ("int4", False), ("int8", True), ("int4", True)]
# The packed kernels compute each row alone (test_outputs_do_not_depend_on_how_many_rows_run_together),
# so within a format the bound is fp32's (measured: 0.0; formats differ from fp32 by 3e-3 .. 7e-2).
# The native stack is held to bit-for-bit equality.
TOL = 1e-4


@pytest.fixture(scope="module", params=FORMATS, ids=lambda p: p[0] + ("-native" if p[1] else "-aten" if p[1] is False else ""))
def tiny_format(request, tokenizer):
    """A tiny seeded model in one format, and its stateless twin in the same format (None for the
    native stack: the runner itself, on a fresh cache, is its stateless twin)."""
    fmt, native = request.param
    if native:
        require_native()
    lm = build_tiny_model(tokenizer, seed=99)
    info = apply_weights(lm.model, fmt, native=native)
    runner = ModelRunner(lm.model, tokenizer, lm.name, info)
    assert (runner.native is not None) == bool(native)
    if native:
        return fmt, runner, None
    ref = build_tiny_model(tokenizer, seed=99).model
    apply_weights(ref, fmt, native=native)
    ref.set_attn_implementation("sdpa")
    return fmt, runner, ref


def one_shot_logits(runner, ref, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids` read in one forward, statelessly."""
    with torch.inference_mode():
        if ref is not None:
            return ref(torch.tensor([ids])).logits[0].float()
        return runner.forward([SeqStep(runner.new_cache(len(ids) + 8), 0, ids)], logits="all")[0]


def stateless_greedy(runner, ref, ids: list[int], tokens: int) -> list[int]:
    """Greedy continuation of `ids` with no state kept between requests: stock `generate()`, or
    for the native stack a fresh cache, the whole prompt in one step, then one token a step."""
    if ref is not None:
        with torch.inference_mode():
            return ref.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False, eos_token_id=None,
                                pad_token_id=0, min_new_tokens=tokens)[0, len(ids):].tolist()
    cache = runner.new_cache(len(ids) + tokens + 8)
    logits = runner.forward([SeqStep(cache, 0, ids)])[0]
    out = []
    for i in range(tokens):
        out.append(int(logits.argmax()))
        logits = runner.forward([SeqStep(cache, len(ids) + i, [out[-1]])])[0]
    return out


def _dequant_int4(layer: Int4Linear, n: int, k: int) -> torch.Tensor:
    codes = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), layer.packed, GROUP,
                                                       layer.scales_zeros)
    return codes.float().T  # the identity picks out each dequantized weight: [n, k]


@pytest.mark.parametrize("cls", [Bf16Linear, Int8Linear, Int4Linear])
def test_packed_layers_compute_their_format(cls):
    torch.manual_seed(0)
    linear = nn.Linear(128, 48, bias=True)
    layer = cls(linear)
    x = torch.randn(5, 3, 128)
    w = linear.weight.detach()
    if cls is Int8Linear:
        w = layer.qweight.float() * layer.scales.float()[:, None]
    elif cls is Int4Linear:
        w = _dequant_int4(layer, 48, 128)
    expected = x.bfloat16().float() @ w.bfloat16().float().T + linear.bias.detach()
    got = layer(x)
    assert got.shape == (5, 3, 48) and got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= 0.05 * expected.abs().max().item()
    error = (got - linear(x)).abs().max().item() / linear(x).abs().max().item()
    assert error < {Bf16Linear: 0.02, Int8Linear: 0.03, Int4Linear: 0.2}[cls]


def test_int4_weights_are_q4_1_blocks():
    """scale * code + minimum per group of 32 is what the int4 kernel multiplies by."""
    torch.manual_seed(1)
    linear = nn.Linear(64, 32, bias=False)
    codes, scale, minimum = quantize_q4_1(linear.weight.detach())
    groups = codes.reshape(32, 2, GROUP)
    assert (groups.amin(-1) == 0).all() and (groups.amax(-1) == 15).all()  # each group's min and max: 0 and 15
    q41 = (codes.float().reshape(32, 2, GROUP) * scale[..., None] + minimum[..., None]).reshape(32, 64)
    assert (q41 - linear.weight).abs().max() <= scale.max() / 2 + 1e-6
    dequant = _dequant_int4(Int4Linear(linear), 32, 64)
    assert (dequant - q41).abs().max().item() <= 0.01 * q41.abs().max().item()  # bf16 scales and zeros


def test_fp32_rows_do_not_depend_on_how_many_run_together():
    """Below 4 rows torch's fp32 GEMM rounds another way; the runner's fp32 layers pad to 4, so on
    one thread a token's output is the same in a step of 1, 3 or 300."""
    torch.manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = nn.Linear(576, 192)
        x = torch.randn(300, 576)
        layer.__class__ = RowStableLinear
        full = layer(x)
        for m in (1, 2, 3, 4, 7, 64):
            assert torch.equal(layer(x[3:3 + m]), full[3:3 + m])
    finally:
        torch.set_num_threads(threads)


def test_outputs_do_not_depend_on_how_many_rows_run_together():
    """Each packed kernel computes a row alone: a token gets the same output in a step of 1 or 300."""
    from streamer.sessions.native import NativeLinear, quantize

    require_native()
    torch.manual_seed(2)
    linear = nn.Linear(576, 192, bias=False)
    x = torch.randn(300, 576)
    native = [NativeLinear(quantize([linear], bits), f"int{bits}") for bits in (4, 8)]
    for layer in (Bf16Linear(linear), Int8Linear(linear), Int4Linear(linear), *native):
        full = layer(x)
        for m in (1, 7, 64):
            assert torch.equal(layer(x[3:3 + m]), full[3:3 + m])


def test_the_embedded_gguf_loads_its_q4_1_blocks_as_the_same_weights(embedded):
    """The GGUF's Q4_1 blocks (q/k rows put back in the checkpoint's order) are the weights the
    checkpoint holds; int4 from the GGUF runs exactly them, scales in bf16."""
    from streamer.sessions.models import embedded_gguf_path
    from streamer.sessions.weights import gguf_q4_1_linears

    blocks = gguf_q4_1_linears(embedded.model, embedded_gguf_path())
    assert len(blocks) == 7 * embedded.model.config.num_hidden_layers
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.29.self_attn.k_proj", "model.layers.7.mlp.down_proj"):
        codes, d, m = blocks[name]
        n, k = codes.shape
        weight = embedded.model.get_submodule(name).weight
        q41 = (codes.float().reshape(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).reshape(n, k)
        assert torch.equal(q41, weight)
        layer = Int4Linear(nn.Linear(k, n, bias=False), codes, d, m)
        assert (_dequant_int4(layer, n, k) - weight).abs().max().item() <= 0.01 * weight.abs().max().item()


def test_auto_follows_its_rule_and_bad_combinations_are_refused(tokenizer, tmp_path):
    tiny = build_tiny_model(tokenizer).model
    assert resolve_format("auto", tiny, "cpu") == "fp32"  # small: overhead-bound, and the oracle
    from streamer.sessions.models import embedded_gguf_path

    assert resolve_format("auto", tiny, "cpu", gguf_path=embedded_gguf_path()) == "int4"  # a Q4_1 GGUF
    big = nn.Sequential(nn.Linear(4096, 4096, bias=False))
    assert resolve_format("auto", big, "cpu") == "int8"
    assert resolve_format("auto", tiny, "cuda") == "fp32"
    assert resolve_format("int4", tiny, "cpu") == "int4"
    with pytest.raises(WeightFormatError, match="int4 runs on ATen's CPU kernels"):
        resolve_format("int4", tiny, "cuda")
    with pytest.raises(WeightFormatError, match="unknown weight format 'int3'"):
        resolve_format("int3", tiny, "cpu")
    with pytest.raises(WeightFormatError, match="--dtype float32"):
        resolve_format("fp32", tiny.to(torch.bfloat16), "cpu")


def test_fp32_leaves_the_model_untouched(tokenizer):
    lm = build_tiny_model(tokenizer, seed=3)
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    info = apply_weights(lm.model, "fp32")
    assert info.format == "fp32" and info.source == "checkpoint"
    assert not any(isinstance(m, (Bf16Linear, Int8Linear, Int4Linear)) for m in lm.model.modules())
    assert all(torch.equal(v, lm.model.state_dict()[k]) for k, v in before.items())


@pytest.mark.parametrize("native", [False, True])
def test_formats_read_fewer_bytes(tokenizer, native):
    from streamer.sessions.native import NativeLinear

    if native:
        require_native()
    sizes = {}
    for fmt in ("fp32", "bf16", "int8", "int4"):
        lm = build_tiny_model(tokenizer, seed=4)
        info = apply_weights(lm.model, fmt, native=native)
        described = describe_weights(lm.model)
        assert described.format == fmt == info.format
        assert info.linear_bytes == described.linear_bytes
        if fmt == "int4":  # the output head stays 8-bit (llama.cpp: Q8_0)
            head = lm.model.lm_head
            assert isinstance(head, Int8Linear) or (isinstance(head, NativeLinear) and head.format == "int8")
        if fmt in ("int8", "int4"):
            assert info.kernels.startswith("native") if native else info.kernels == "aten"
        sizes[fmt] = info.linear_bytes
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["int4"]
    assert sizes["int4"] < sizes["fp32"] / 3  # the tiny model is mostly its (int8) output head


def _build(runner, chunks, budget=512):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None), budget)
    for chunk in chunks:
        drive(runner, PrefillJob(session, session.tokenize(chunk), chunk), budget)
    return session


@pytest.mark.parametrize("cuts,budget", [([], 512), ([40, 41, 100], 512), ([60, 130], 7)])
def test_incremental_equals_one_shot_within_a_format(tiny_format, cuts, budget):
    fmt, runner, ref = tiny_format
    bounds = [0, *cuts, len(TEXT)]
    session = _build(runner, [TEXT[a:b] for a, b in pairwise(bounds)], budget)
    full = one_shot_logits(runner, ref, session.context_ids())
    if ref is None:  # the native stack: bit for bit
        assert torch.equal(session.last_logits, full[-1]), fmt
    assert (session.last_logits - full[-1]).abs().max().item() <= TOL, fmt
    assert int(session.last_logits.argmax()) == int(full[-1].argmax())


@pytest.mark.parametrize("question", ["Who keeps the lighthouse?", "When does the boat come?"])
def test_greedy_answer_equals_stateless_generate_within_a_format(tiny_format, question):
    fmt, runner, ref = tiny_format
    session = _build(runner, [TEXT[:50], TEXT[50:]])
    before = session.cache.snapshot()
    result = drive(runner, QueryJob(session, "q", question, SamplingParams(max_tokens=12), frozenset()))
    ids = session.context_ids() + session.question_ids(question)
    assert result.tokens == stateless_greedy(runner, ref, ids, 12), fmt
    assert torch.equal(session.cache.snapshot(), before)


def test_replay_equals_the_original_within_a_format(tiny_format):
    """The same inputs (appends, a revise) in a fresh session, packed differently, give the same
    cache and the same answer: what replaying an event log relies on."""
    fmt, runner, _ = tiny_format
    original = _build(runner, [TEXT[:30], TEXT[30:90], TEXT[90:]], budget=16)
    drive(runner, ReviseJob(original, "The boat came on Fridays.", None))
    replayed = _build(runner, [TEXT[:30], TEXT[30:90]], budget=512)
    drive(runner, PrefillJob(replayed, replayed.tokenize("The boat came on Fridays."), "The boat came on Fridays."))
    assert original.context_ids() == replayed.context_ids()
    if runner.native is not None:
        assert torch.equal(original.cache.snapshot(), replayed.cache.snapshot()), fmt
    assert (original.cache.snapshot().float() - replayed.cache.snapshot().float()).abs().max().item() <= 1e-5, fmt
    answers = [drive(runner, QueryJob(s, "q", "Which day?", SamplingParams(max_tokens=8), frozenset())).tokens
               for s in (original, replayed)]
    assert answers[0] == answers[1]


def test_decode_rows_of_all_sessions_go_through_each_linear_as_one_gemm(tokenizer):
    """A step that decodes for three sessions calls every linear layer once, with three rows."""
    from streamer.sessions.runner import SeqStep

    lm = build_tiny_model(tokenizer, seed=5)
    runner = ModelRunner(lm.model, tokenizer, lm.name, apply_weights(lm.model, "int4", native=False))
    sessions = [_build(runner, [TEXT[:20 * (i + 1)]]) for i in range(3)]
    calls = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: calls.append(args[0].reshape(-1, mod.in_features).shape[0]))
             for m in lm.model.modules() if isinstance(m, Int4Linear)]
    runner.forward([SeqStep(s.cache, s.cache.length, [7]) for s in sessions])
    for h in hooks:
        h.remove()
    layers = sum(1 for m in lm.model.modules() if isinstance(m, Int4Linear))
    assert len(calls) == layers and set(calls) == {3}


def test_a_native_step_is_one_call_with_every_row(tokenizer):
    """On the native stack a step that decodes for three sessions is one call into C with three
    rows: every layer's linear layers see all of them together."""
    require_native()
    lm = build_tiny_model(tokenizer, seed=5)
    runner = ModelRunner(lm.model, tokenizer, lm.name, apply_weights(lm.model, "int4", native=True))
    sessions = [_build(runner, [TEXT[:20 * (i + 1)]]) for i in range(3)]
    calls = []

    class Counting:
        def __init__(self, lib):
            self.lib = lib

        def __getattr__(self, name):
            fn = getattr(self.lib, name)
            if name != "forward":
                return fn
            return lambda model, plan, h, *rest: calls.append(len(h)) or fn(model, plan, h, *rest)

    runner.native.lib = Counting(runner.native.lib)
    runner.forward([SeqStep(s.cache, s.cache.length, [7]) for s in sessions])
    assert calls == [3]


def test_native_weights_are_the_q4_1_blocks_of_the_gguf(embedded):
    """The native int4 matrices hold the GGUF's own Q4_1 blocks: fed one-hot rows, a layer returns
    its checkpoint weights (the activation 1.0 is exact in int8 up to its scale's rounding)."""
    from streamer.sessions.models import embedded_gguf_path
    from streamer.sessions.native import quantize
    from streamer.sessions.weights import gguf_q4_1_linears

    require_native()
    name = "model.layers.3.mlp.down_proj"
    codes, d, m = gguf_q4_1_linears(embedded.model, embedded_gguf_path())[name]
    linear = embedded.model.get_submodule(name)
    matrix = quantize([linear], 4, [(codes, d, m)])
    eye = torch.eye(linear.in_features)[:64]
    got = matrix(eye).T  # [out, 64]: columns of the weight
    assert (got - linear.weight[:, :64]).abs().max().item() <= 1e-6 * 1000 * linear.weight.abs().max().item()
