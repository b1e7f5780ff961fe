"""Backend selection, and the engine with the Triton backend (interpreted on the CPU, or compiled
on the GPU that STREAMER_KERNEL_TEST_DEVICE names: conftest.py) against the reference:
near-identical logits step by step, identical greedy answers end to end."""

import pytest
import torch
from helpers import Sync, driven
from streamer.kernels.backend import ENV_VAR, BackendUnavailable, resolve_backend
from streamer.sessions.models import build_tiny_model
from streamer.sessions.pool import BlockPool, PagedCache
from streamer.sessions.runner import ModelRunner, SeqStep
from streamer.sessions.sampling import SamplingParams
from testdevice import DEVICE

CHUNKS = ["The keeper is Ada Morrow. ", "Her cat is Pepper. ", "The boat Marigold comes on Tuesdays. ",
          "A storm broke the burner on March 16. "]
SYSTEM = "You read a lighthouse log as it arrives and answer questions about it, briefly and exactly. " * 2


@pytest.mark.skipif(DEVICE != "cpu", reason="the CPU's rules need the kernels interpreted (conftest.py)")
def test_selection_rules(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("reference", "cpu") == "reference"
    assert resolve_backend("auto", "cpu") == "reference"  # triton only on CUDA by default
    assert resolve_backend(None, "cpu") == "reference"
    assert resolve_backend("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 (conftest)
    monkeypatch.setenv(ENV_VAR, "triton")
    assert resolve_backend(None, "cpu") == "triton"
    assert resolve_backend("reference", "cpu") == "reference"  # an explicit setting wins
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_backend(None, "cpu")
    with pytest.raises(ValueError, match="one of auto, reference, triton"):
        resolve_backend("cuda", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(BackendUnavailable, match="runs on CUDA devices.*TRITON_INTERPRET=1"):
        resolve_backend("triton", "cpu")
    assert resolve_backend("auto", "cpu") == "reference"


@pytest.mark.skipif(DEVICE == "cpu", reason="the rules on a GPU (STREAMER_KERNEL_TEST_DEVICE=cuda: conftest.py)")
def test_selection_rules_on_a_gpu(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_backend("auto", DEVICE) == "triton"  # compiled kernels on CUDA by default
    assert resolve_backend("triton", DEVICE) == "triton"
    assert resolve_backend("reference", DEVICE) == "reference"
    with pytest.raises(BackendUnavailable, match="runs on CUDA devices"):
        resolve_backend("triton", "cpu")  # no interpreter: the kernels are compiled for the GPU


def runner_with(tokenizer, backend):
    lm = build_tiny_model(tokenizer, seed=1234)
    runner = ModelRunner(lm.model.to(DEVICE), tokenizer, lm.name)
    assert runner.set_attention_backend(backend) == backend
    return runner


def step_logits(runner, tokenizer):
    """Every shape the runner plans, on pool caches: a shared prefix's fill, two sessions'
    packed chunked prefill (one on the shared prefix), packed decode, three flash forks over a
    session (shared-prefix path), a dual-thinking fork over reading + thinking (fused two-range,
    short and long own part). Returns the logits of every token of every step."""
    ids = tokenizer(" ".join(CHUNKS) * 6)["input_ids"]
    pool = BlockPool(runner.kv_shape, 8 << 20, block_size=16)
    prefix = pool.prefix_for(ids[:40])
    logs = []

    def run(steps, logits="all"):
        logs.extend(runner.forward(steps, logits=logits))
        for s in steps:
            s.cache.commit(s.start + s.n)

    run([SeqStep(prefix, 0, prefix.tokens)])
    a, b = PagedCache(pool, 4096, prefix), PagedCache(pool, 4096)
    b.reserve(8)  # b's extent sits elsewhere in the pool
    run([SeqStep(a, 32, ids[32:100]), SeqStep(b, 0, ids[:50])])
    run([SeqStep(a, 100, ids[100:101]), SeqStep(b, 50, ids[50:51])])
    run([SeqStep(a, 101, ids[101:170])], logits="last")
    forks = [runner.new_cache(64) for _ in range(3)]
    questions = [ids[5:12], ids[20:21], ids[30:41]]
    run([SeqStep(f, 0, q, prefixes=((a, 170),)) for f, q in zip(forks, questions)])
    run([SeqStep(f, len(q), [ids[60 + i]], prefixes=((a, 170),)) for i, (f, q) in enumerate(zip(forks, questions))])
    thinking = runner.new_cache(400)
    run([SeqStep(thinking, 0, ids[:9], prefixes=((a, 150),), pos0=150)])
    run([SeqStep(thinking, 9, ids[9:150], prefixes=((a, 160),), pos0=151)], logits="last")
    run([SeqStep(thinking, 150, ids[150:151], prefixes=((a, 170),), pos0=152),  # own part > 128: fused
         SeqStep(b, 51, ids[51:53])])
    return logs


def test_runner_logits_match_across_backends(tokenizer):
    ref = step_logits(runner_with(tokenizer, "reference"), tokenizer)
    tri = step_logits(runner_with(tokenizer, "triton"), tokenizer)
    assert len(ref) == len(tri) == 16
    for r, t in zip(ref, tri):
        torch.testing.assert_close(t, r, atol=1e-4, rtol=1e-4)
        assert torch.equal(t.argmax(-1), r.argmax(-1))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_step_plans_are_freed_after_their_step(tokenizer, backend):
    """A step's attention plan (tables, partial buffers) lives for its step only: after many
    steps of every shape, none is left alive."""
    import gc

    from streamer.kernels.backend import ReferencePlan
    from streamer.kernels.triton_attention import AttentionPlan

    gc.collect()
    before = sum(isinstance(o, (AttentionPlan, ReferencePlan)) for o in gc.get_objects())
    logits = step_logits(runner_with(tokenizer, backend), tokenizer)
    assert len(logits) == 16
    gc.collect()
    assert sum(isinstance(o, (AttentionPlan, ReferencePlan)) for o in gc.get_objects()) == before


def variant(kernel, args, kwargs) -> tuple:
    """What Triton compiles a variant of `kernel` for, given one launch's arguments: constexprs
    and launch options by value, tensors by dtype and 16-byte alignment, integers it may
    specialize by whether they equal 1 and divide by 16 (not those it is told not to), floats
    by type."""
    names = kernel.arg_names
    unspecialized = set((kernel.kwargs if hasattr(kernel, "kwargs") else vars(kernel)).get("do_not_specialize") or [])
    values = {**dict(zip(names, args)), **kwargs}
    key = []
    for name, value in sorted(values.items()):
        if isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif name in kwargs or isinstance(value, bool):  # constexprs and launch options (passed by name)
            key.append((name, value))
        elif isinstance(value, int) and name not in unspecialized:
            key.append((name, value == 1, value % 16 == 0))
        else:
            key.append((name, type(value).__name__))
    return (kernel.arg_names[0], tuple(key))


def test_steps_launch_only_the_variants_warm_up_compiled(tokenizer):
    """Every model step's kernel launches are of a variant `warm_up` compiled when the backend
    was chosen: nothing compiles mid-serving (a variant per layer index or per token count
    would stall a live session for seconds on a GPU). On a GPU, Triton's own cache of
    compiled kernels is checked too."""
    from streamer.kernels import triton_attention as ta

    kernels = (ta._attention_kernel, ta._merge_kernel)
    launches = []

    def hook_for(kernel):
        def hook(*args, **kwargs):
            launches.append(variant(kernel, args, kwargs))
        return hook

    hooks = [(k, hook_for(k)) for k in kernels]
    for k, hook in hooks:
        k.add_pre_run_hook(hook)
    try:
        runner = runner_with(tokenizer, "triton")  # on a GPU, choosing the backend warms it up
        shape = runner.kv_shape
        ta.warm_up(runner.heads, shape.kv_heads, shape.head_dim, shape.dtype, DEVICE)  # the CPU: here
        warmed, before = set(launches), ta.compiled_variants()
        assert {name for name, _ in warmed} == {"Q", "OUT"}  # both kernels ran (their first arguments)
        launches.clear()
        assert len(step_logits(runner, tokenizer)) == 16
        assert launches and set(launches) <= warmed, set(launches) - warmed
        assert ta.compiled_variants() == before
    finally:
        for k, hook in hooks:
            k.pre_run_hooks.remove(hook)


def test_a_fork_groups_partial_slots_fit_the_compiled_merge():
    """Where few programs fill the device, a long range is cut into many items; a fork group's
    shared part and each fork's own part are cut separately, and together they must fit the
    merge variant warm_up compiled (MERGE_SLOTS): a shared prefix of 64 x 256 keys and forks of
    8K own keys each, one kv head, on a device of 1,000 programs."""
    from streamer.kernels.triton_attention import MERGE_SLOTS, AttentionPlan, KVRange

    def cache(n):
        k = torch.zeros((1, n, 16))
        return KVRange(k, k, n)

    plan = AttentionPlan(2, 1, 16, "cpu", target_programs=1000)
    plan.forks([[0], [1]], [cache(64 * 256)], [[cache(8192)], [cache(8192)]])
    plan.build()
    assert plan.n_slots == MERGE_SLOTS  # half for the shared part, half for the own: no more


def engine_answers(engine):
    """Append, query, flash questions and dual thinking through the engine; everything that
    depends on the attention: answers, flash answers, notes, and the caches."""
    out = {"answers": []}
    sync = Sync(engine)
    plain = sync.create_session(SYSTEM)["session_id"]
    dual = sync.create_session(SYSTEM, thinking={"mode": "dual", "unit_tokens": 5, "stop": "budget"})["session_id"]
    sync.register_flash(plain, "Who keeps the light?", max_tokens=5)
    sync.register_flash(plain, "What is the cat called?", max_tokens=5)
    for chunk in CHUNKS:  # both sessions' work packs into shared steps; each waits for its notes
        for sid in (plain, dual):
            engine.append(sid, chunk)
        engine.run_until_idle()
    handles = [engine.query(sid, "What broke in the storm?", SamplingParams(max_tokens=6)) for sid in (plain, dual)]
    engine.run_until_idle()
    for sid, handle in zip((plain, dual), handles):
        out["answers"].append((handle.future.result(0).tokens, engine.sessions[sid].cache.snapshot()))
    out["flash"] = [q.answer.tokens for q in engine.sessions[plain].flash.questions.values()]
    out["notes"] = [u.text for u in engine.sessions[dual].thinking.units]
    out["thinking_cache"] = engine.sessions[dual].thinking.cache.snapshot()
    out["state"] = sync.session_state(plain)
    out["metrics"] = engine.metrics()
    return out


def test_engine_answers_are_unchanged_when_the_backend_switches(tokenizer):
    from streamer.metrics import render

    results = {}
    for backend in ("reference", "triton"):
        engine = driven(runner_with(tokenizer, "reference"), attention_backend=backend)
        results[backend] = engine_answers(engine)
        assert engine.runner.attention_backend == backend
    ref, tri = results["reference"], results["triton"]
    assert len(ref["notes"]) == len(CHUNKS) and ref["notes"] == tri["notes"]
    assert ref["flash"] == tri["flash"] and all(ref["flash"])
    for (rt, rc), (tt, tc) in zip(ref["answers"], tri["answers"]):  # the plain and the dual session
        assert rt == tt and rt
        torch.testing.assert_close(tc, rc, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri["thinking_cache"], ref["thinking_cache"], atol=1e-5, rtol=1e-5)
    assert ref["state"]["shared_prefix_tokens"] > 0  # the pool's shared-prefix extent was read
    for backend, r in results.items():
        assert r["state"]["attention_backend"] == backend
        assert r["metrics"]["attention_backend"] == backend
        assert f'streamer_attention_backend{{backend="{backend}"}} 1' in render(r["metrics"], 0)


def test_engine_refuses_an_unknown_backend(tiny):
    runner, _ = tiny
    with pytest.raises(ValueError, match="attention backend must be one of"):
        driven(runner, attention_backend="fastest")
    assert runner.attention_backend == "reference"


def test_cli_flag_reaches_the_engine_limits():
    from streamer.cli import build_parser

    args = build_parser().parse_args(["serve", "--attention-backend", "triton"])
    assert args.attention_backend == "triton"
    assert build_parser().parse_args(["serve"]).attention_backend is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--attention-backend", "fast"])
