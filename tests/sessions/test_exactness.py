"""Invariants 1 and 2 and revise, on a tiny seeded fp32 model against stock transformers."""

import pytest
import torch

from streamer.sessions.jobs import PrefillJob, ReviseJob, drive
from streamer.sessions.query import QueryJob
from streamer.sessions.sampling import SamplingParams
from streamer.sessions.session import Session

TEXT = ("The lighthouse keeper was named Ada Morrow. She lived on Gull Island with a grey cat called "
        "Pepper. Every evening at six she lit the lamp, and the supply boat Marigold came on Tuesdays. "
        "In March a storm broke the lens; a new one arrived from Oban on the ninth.")


def split_at(text, cuts):
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def build(runner, chunks, budget=512):
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None), budget)
    for chunk in chunks:
        drive(runner, PrefillJob(session, session.tokenize(chunk), chunk), budget)
    return session


def reference_logits(ref, ids):
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("cuts,budget", [
    ([], 512), ([40, 41, 100], 512), (list(range(10, 230, 10)), 512), ([60, 150], 7), ([1], 1)])
def test_incremental_equals_one_shot(tiny, cuts, budget):
    runner, ref = tiny
    chunks = split_at(TEXT, cuts)
    session = Session("s", runner)
    drive(runner, PrefillJob(session, session.prefix_ids, None), budget)
    ends = []
    for chunk in chunks:
        drive(runner, PrefillJob(session, session.tokenize(chunk), chunk), budget)
        ends.append((session.cache.length, session.last_logits.clone()))
    full = reference_logits(ref, session.context_ids())
    for end, logits in ends:
        assert (logits - full[end - 1]).abs().max().item() <= 1e-4
    assert session.cache.length == len(session.context_ids())


def test_chunks_are_tokenized_alone(tiny):
    runner, _ = tiny
    session = build(runner, ["The light", "house keeper"])
    # "light" + "house" tokenized apart differ from "lighthouse": the cache keeps the pieces
    assert session.chunks[1].tokens == session.tokenize("house keeper")
    assert session.context_ids()[-len(session.chunks[1].tokens):] == session.tokenize("house keeper")


@pytest.mark.parametrize("question", ["Who keeps the lighthouse?", "What broke in March?"])
def test_greedy_answer_equals_stateless_generate(tiny, question):
    runner, ref = tiny
    session = build(runner, split_at(TEXT, [50, 120]))
    before = session.cache.snapshot()
    length = session.cache.length
    job = QueryJob(session, "q", question, SamplingParams(max_tokens=16), frozenset())
    result = drive(runner, job)
    ids = session.context_ids() + session.question_ids(question)
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                eos_token_id=None, pad_token_id=0, min_new_tokens=16)[0, len(ids):].tolist()
    assert result.tokens == expected
    assert session.cache.length == length
    assert torch.equal(session.cache.snapshot(), before)


def test_query_growing_the_cache_keeps_fork_tokens(tiny):
    """A question that makes the cache reallocate mid-fork still answers like generate()."""
    runner, ref = tiny
    session = build(runner, [TEXT[:20]])
    assert session.cache.capacity == 256
    job = QueryJob(session, "q", "Tell me everything. " * 20, SamplingParams(max_tokens=40), frozenset())
    result = drive(runner, job, budget=64)
    ids = session.context_ids() + session.question_ids("Tell me everything. " * 20)
    with torch.inference_mode():
        expected = ref.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                eos_token_id=None, pad_token_id=0, min_new_tokens=40)[0, len(ids):].tolist()
    assert result.tokens == expected


@pytest.mark.parametrize("revised_chunks,from_seq", [
    (["In March a storm broke the lamp; a new one came from Leith on the tenth."], None),
    (["In March a storm broke the lens; a new one arrived from Oban on the ninth. More."], None),
    (["In March"], None),
    (["Totally different ending."], 2),
])
def test_revise_equals_session_built_from_revised_text(tiny, revised_chunks, from_seq):
    runner, ref = tiny
    head = TEXT[:150]
    original = [head[:80], head[80:], TEXT[150:]]
    session = build(runner, original)
    revised_text = "".join(revised_chunks)
    result = drive(runner, ReviseJob(session, revised_text, from_seq))
    kept_chunks = original[: (from_seq - 1 if from_seq else 2)]
    expected = build(runner, kept_chunks + [revised_text])
    assert session.context_ids() == expected.context_ids()
    assert session.cache.length == expected.cache.length
    assert (session.last_logits - expected.last_logits).abs().max().item() <= 1e-4
    assert (session.cache.snapshot() - expected.cache.snapshot()).abs().max().item() <= 1e-4
    full = reference_logits(ref, expected.context_ids())
    assert (session.last_logits - full[-1]).abs().max().item() <= 1e-4
    assert result.replaced_seqs == ([3] if from_seq is None else [2, 3])
    assert session.data_version == 4


def test_revise_reuses_the_common_prefix(tiny):
    runner, _ = tiny
    session = build(runner, ["Alpha beta gamma delta epsilon zeta."])
    result = drive(runner, ReviseJob(session, "Alpha beta gamma delta epsilon eta.", None))
    assert result.kept_tokens >= 5
    assert result.kept_tokens < result.tokens


def test_reading_input_runs_no_output_head_until_its_logits_are_read(tiny):
    """Nothing samples after input is read, so a prefill leaves its last logits deferred: the
    head (a GEMV over the whole vocabulary) runs once when they are read, and they are exact."""
    runner, ref = tiny
    head = runner.model.get_output_embeddings()
    rows = []
    hook = head.register_forward_hook(lambda module, args, out: rows.append(args[0].reshape(-1, head.in_features).shape[0]))
    try:
        session = build(runner, [TEXT[:90], TEXT[90:]], budget=32)  # several steps per input
        assert rows == []
        first = session.last_logits
        assert rows == [1] and session.last_logits is first  # computed once, then kept
    finally:
        hook.remove()
    full = reference_logits(ref, session.context_ids())
    assert (first - full[-1]).abs().max().item() <= 1e-4
