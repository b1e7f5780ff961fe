"""A Qwen2.5-VL on the engine (tiny seeded random model, fp32): frames enter a session's cache
through the job path as embeddings with the model's own M-RoPE positions, chunk by chunk, batched
across sessions; questions, flash questions and windows work on video sessions as on text ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamer.sessions import flash as flash_commands, jobs, thinking
from streamer.sessions.engine import EngineCore, EngineLimits
from streamer.sessions.errors import InvalidRequest
from streamer.sessions.multimodal import frame_input
from streamer.sessions.query import query
from streamer.sessions.runner import ModelRunner
from streamer.sessions.sampling import SamplingParams
from streamer.vision.vlm_patches import patchify
from helpers import run_unit
from videogen import picture

TOL = 1e-4
FRAME_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_vl(layers: int = 2):
    from transformers import AutoTokenizer

    from streamer.sessions.models import embedded_model_dir
    from streamer.vision.vlm import build_tiny_vl

    return build_tiny_vl(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=3, layers=layers)


@pytest.fixture(scope="module")
def vl():
    """The model under test (on the engine) and an untouched twin with stock attention."""
    return tiny_vl(), tiny_vl().model





def make_core(loaded, **limits) -> EngineCore:
    runner = ModelRunner(loaded.model, loaded.tokenizer, loaded.name)
    return EngineCore(runner, EngineLimits(kv_budget_bytes=32 << 20, **limits))


def open_session(core, window=None) -> str:
    fut = core.create_session("You watch a video.", window=window)
    core.run_until_idle()
    return (fut if isinstance(fut, dict) else fut.result())["session_id"]


def add_frame(core, sid, img, pts: float):
    runner = core.runner
    frame = frame_input(runner.vl, img, FRAME_TOKENS, runner.tokenize(f"[{pts:.1f}s] "), pts)
    return jobs.append_frame(core, sid, frame, f"[frame {pts:.1f}s]")


def stock_inputs(ref, ids: list[int], images: list[np.ndarray]) -> dict:
    cfg = ref.config
    input_ids = torch.tensor([ids])
    pixels, grids = zip(*(patchify(img, FRAME_TOKENS) for img in images))
    return {"input_ids": input_ids, "pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids),
            "mm_token_type_ids": (input_ids == cfg.image_token_id).int()}


def stock_greedy(ref, prompt: list[int], images: list[np.ndarray], n: int, stop) -> list[int]:
    """The stock model's greedy continuation of a multimodal prompt, up to a stop id."""
    inputs = stock_inputs(ref, prompt, images)
    with torch.no_grad():
        out = ref.generate(**inputs, max_new_tokens=n, do_sample=False)
    want = out[0, len(prompt):].tolist()
    return want[:next((i for i, t in enumerate(want) if t in stop), len(want))]


def test_frames_and_text_chunk_by_chunk_equal_one_forward(vl):
    """Two sessions fed at once (batched steps; a small step budget also splits each frame over
    steps): after every input, the session's logits equal one stock forward over the whole
    multimodal sequence, and its next position is the model's own (get_rope_index)."""
    loaded, ref = vl
    core = make_core(loaded, step_tokens=16)
    sids = [open_session(core, None), open_session(core, None)]
    items = [picture(1, 100, 150), "and then", picture(2, 64, 64), " more text here ", picture(3, 300, 200), "end"]
    ends = {sid: [] for sid in sids}
    steps = core.stats.steps
    for k, item in enumerate(items):
        futs = {}
        for j, sid in enumerate(sids):
            thing = item if j == 0 or isinstance(item, str) else picture(10 + k, 80, 120)
            futs[sid] = add_frame(core, sid, thing, k * 0.5) if isinstance(thing, np.ndarray) \
                else jobs.append(core, sid, thing)
        core.run_until_idle()
        for sid, fut in futs.items():
            fut.result()
            s = core.sessions[sid]
            ends[sid].append((s.cache.length, s.last_logits.clone()))
    assert core.stats.step_sequences > core.stats.steps - steps  # the sessions shared steps
    for j, sid in enumerate(sids):
        s = core.sessions[sid]
        images = [item if j == 0 else picture(10 + k, 80, 120) for k, item in enumerate(items)
                  if isinstance(item, np.ndarray)]
        inputs = stock_inputs(ref, s.context_ids(), images)
        with torch.no_grad():
            want = ref(**inputs).logits[0]
            positions, _ = ref.model.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                                    mm_token_type_ids=inputs["mm_token_type_ids"])
        assert s.cache.length == want.shape[0]
        for end, logits in ends[sid]:
            assert (logits - want[end - 1]).abs().max().item() <= TOL
        assert s.next_position == int(positions.max()) + 1
        assert s.state()["frames"] == 3


def test_a_video_session_reads_bit_for_bit_the_same_alone_or_batched(vl):
    """A session's cache and logits do not depend on which other sessions share its steps
    (replay runs a session with other company than it first had): four sessions of different
    lengths read the same frames batched, and each equals itself read alone, exactly."""
    loaded, _ = vl
    leads = ["", "a note", "a longer note about the scene", ""]
    images = [picture(40 + k, 90, 120) for k in range(3)]

    def read(texts):
        core = make_core(loaded)
        sids = [open_session(core) for _ in texts]
        for sid, text in zip(sids, texts):
            if text:
                jobs.append(core, sid, text)
        core.run_until_idle()
        steps = core.stats.steps
        for k, img in enumerate(images):
            for sid in sids:
                add_frame(core, sid, img, k * 0.5)
            core.run_until_idle()
        assert len(texts) == 1 or core.stats.step_sequences > core.stats.steps - steps  # they shared steps
        return [(core.sessions[sid].cache.snapshot(), core.sessions[sid].last_logits) for sid in sids]

    batched = read(leads)
    for i, text in enumerate(leads):
        ((kv, logits),) = read([text])
        assert torch.equal(kv, batched[i][0]) and torch.equal(logits, batched[i][1]), f"session {i}"


def test_the_vision_tower_runs_on_the_engine_once_per_step_for_every_session(vl, monkeypatch):
    """Frames handed to the engine patched (`frame_patches`: no embeddings yet, as the media path
    sends them): the engine thread runs the vision tower as the first part of the frame jobs,
    one call for all sessions' frames of a step, and each session's cache and logits equal
    those of frames encoded beforehand one by one (`frame_input`), bit for bit."""
    from streamer.sessions.multimodal import frame_patches

    loaded, _ = vl
    images = [picture(50 + k, 64 + 14 * k, 96) for k in range(3)]  # a different grid per session
    tower = loaded.model.model.get_image_features
    calls = []

    def counted(pixels, grid_thw):
        calls.append(grid_thw.shape[0])
        return tower(pixels, grid_thw)

    def read(make):
        core = make_core(loaded)
        sids = [open_session(core) for _ in images]
        for k in range(2):
            futs = []
            for sid, img in zip(sids, images):
                frame = make(core.runner.vl, img, FRAME_TOKENS, core.runner.tokenize(f"[{k:.1f}s] "), float(k))
                assert (frame.embeds is None) == (make is frame_patches)
                futs.append(jobs.append_frame(core, sid, frame, "frame"))
            calls.clear()
            core.run_until_idle()
            assert all(f.result().seq for f in futs)
            if make is frame_patches:
                assert calls == [len(images)]  # one call of the tower, every session's frame in it
        return [(core.sessions[sid].cache.snapshot(), core.sessions[sid].last_logits) for sid in sids]

    monkeypatch.setattr(loaded.model.model, "get_image_features", counted)
    lazy = read(frame_patches)
    eager = read(frame_input)
    for i, ((kv, logits), (kv_e, logits_e)) in enumerate(zip(lazy, eager)):
        assert torch.equal(kv, kv_e) and torch.equal(logits, logits_e), f"session {i}"


def test_question_on_a_video_session_equals_stateless_greedy(vl):
    loaded, ref = vl
    core = make_core(loaded)
    images = [picture(4, 120, 90), picture(5, 90, 120)]
    sid = video_session(core, images)
    s = core.sessions[sid]
    before = (s.cache.length, s.next_position, s.data_version)
    question = "What changed between the frames?"
    fut = query(core, sid, question, SamplingParams(max_tokens=12))
    core.run_until_idle()
    got = fut.result()
    prompt = s.context_ids() + s.question_ids(question)
    assert got.tokens == stock_greedy(ref, prompt, images, 12, core.stop_ids)
    assert (s.cache.length, s.next_position, s.data_version) == before  # the question left no trace


def test_flash_question_is_answered_after_each_frame(vl):
    loaded, _ = vl
    core = make_core(loaded)
    sid = open_session(core, None)
    seen = []
    core.sessions[sid].listeners.append(lambda ev, payload: seen.append((ev, payload)))
    flash_commands.register(core, sid, "What is in view?", max_tokens=4)
    versions = []
    for k in range(3):
        add_frame(core, sid, picture(20 + k, 64, 96), k * 0.5)
        core.run_until_idle()
        versions.append(core.sessions[sid].data_version)
    evaluated = [p["data_version"] for ev, p in seen if ev in ("flash.updated", "flash.evaluated")]
    assert evaluated == versions  # one evaluation per frame, on the data that frame made


@pytest.fixture(scope="module")
def one_layer():
    return tiny_vl(layers=1)


@pytest.mark.parametrize("window, notes", [
    ({"max_tokens": 120, "keep_tokens": 80, "sink_inputs": 1}, False),  # frames and text share the bound
    ({"max_tokens": 200, "sink_inputs": 1, "vision_tokens": 60}, True),  # sinks + recent frames + longer text
])
def test_a_slid_window_equals_a_fresh_prefill_of_the_kept_inputs(one_layer, window, notes):
    """One layer (the kept tokens keep the states they were read with; for one layer that is
    exactly what a fresh prefill holds): after the window evicts old frames and re-anchors the
    kept inputs by rotation, the session's logits equal a fresh session fed the kept inputs at
    their new positions. With a vision bound, old frames go and the text between them stays."""
    core = make_core(one_layer)
    sid = open_session(core, window)
    frames = [frame_input(core.runner.vl, picture(30 + k, 64, 96), FRAME_TOKENS,
                          core.runner.tokenize(f"[{k * 0.5:.1f}s] "), k * 0.5) for k in range(8)]
    inputs = [("text", "a sink note")]
    for k, f in enumerate(frames):
        inputs.append(("frame", f))
        if notes:
            inputs.append(("text", f" note {k}"))
    inputs.append(("text", " probe"))
    for kind, x in inputs:
        fut = jobs.append(core, sid, x) if kind == "text" else jobs.append_frame(core, sid, x, "frame")
        core.run_until_idle()
        fut.result()
    s = core.sessions[sid]
    assert s.window.slides >= 1 and s.window.dropped_inputs >= 2
    kept = {c.seq for c in s.chunks}
    if notes:
        held = sum(len(c.tokens) for c in s.chunks[1:] if c.extent is not None)
        assert 0 < held <= window["vision_tokens"]
        assert all(seq in kept for seq, (kind, _) in enumerate(inputs, start=1) if kind == "text")
    fresh = open_session(core, None)
    for seq, (kind, x) in enumerate(inputs, start=1):
        if seq in kept:
            (jobs.append(core, fresh, x) if kind == "text" else jobs.append_frame(core, fresh, x, "frame"))
    core.run_until_idle()
    f = core.sessions[fresh]
    assert f.context_ids() == s.context_ids()
    assert f.next_position == s.next_position
    assert (s.last_logits - f.last_logits).abs().max().item() <= TOL


def test_text_models_refuse_frames(vl, tiny):
    text_core = EngineCore(tiny[0], EngineLimits(kv_budget_bytes=8 << 20))
    sid = open_session(text_core)
    loaded, _ = vl
    core = make_core(loaded)
    frame = frame_input(core.runner.vl, picture(1, 56, 56), 4)
    with pytest.raises(InvalidRequest) as err:
        jobs.append_frame(text_core, sid, frame, "frame")
    assert err.value.code == "unsupported_media"


def test_positions_and_logits_do_not_depend_on_how_text_is_split_around_frames(vl):
    loaded, _ = vl
    core = make_core(loaded)
    img = picture(5, 120, 80)
    ends = []
    for pieces in (["a b c d"], ["a", " b", " c d"]):
        sid = open_session(core)
        for piece in pieces:
            jobs.append(core, sid, piece)
        add_frame(core, sid, img, 0.0)
        jobs.append(core, sid, " e f")
        core.run_until_idle()
        ends.append(core.sessions[sid])
    a, b = ends
    assert a.context_ids() == b.context_ids()  # the same tokens (each piece tokenized alone splits the same here)
    assert (a.next_position, a.cache.length) == (b.next_position, b.cache.length)
    assert (a.last_logits - b.last_logits).abs().max().item() <= TOL


def test_a_long_video_stays_within_its_window_and_positions_and_still_answers(vl):
    """Far more frames than the window holds (a vision bound and the whole bound): the cache
    never passes its bound, the next position stays below the cache length, the sinks stay, and
    a question is still answered."""
    loaded, _ = vl
    core = make_core(loaded)
    window = {"max_tokens": 240, "sink_inputs": 1, "vision_tokens": 120}
    sid = open_session(core, window)
    jobs.append(core, sid, "The camera looks at the door.")
    core.run_until_idle()
    s = core.sessions[sid]
    sink = s.chunks[0].seq
    peak = 0
    for k in range(40):
        add_frame(core, sid, picture(40 + k, 64, 96), k * 0.5)
        if k % 5 == 0:
            jobs.append(core, sid, f" note {k}")
        core.run_until_idle()
        peak = max(peak, s.cache.length)
        assert s.next_position <= s.cache.length
    assert peak <= window["max_tokens"] and s.window.slides > 5
    assert s.chunks[0].seq == sink and s.frames == 40
    assert sum(len(c.tokens) for c in s.chunks[1:] if c.extent is not None) <= window["vision_tokens"]
    fut = query(core, sid, "Who came in?", SamplingParams(max_tokens=6))
    core.run_until_idle()
    assert len(fut.result().tokens) >= 1 and torch.isfinite(s.last_logits).all()


def test_revising_text_after_a_frame_equals_writing_it_so_and_a_frame_cannot_be_revised(vl):
    loaded, _ = vl
    core = make_core(loaded)
    img = picture(9, 80, 120)
    a, b = open_session(core), open_session(core)
    for sid, text in ((a, " the door is shut"), (b, " the door is open")):
        add_frame(core, sid, img, 0.0)
        jobs.append(core, sid, text)
    core.run_until_idle()
    fut = jobs.revise(core, a, " the door is open")
    core.run_until_idle()
    assert fut.result().replaced_seqs == [2]
    sa, sb = core.sessions[a], core.sessions[b]
    assert sa.context_ids() == sb.context_ids() and sa.next_position == sb.next_position
    assert (sa.last_logits - sb.last_logits).abs().max().item() <= TOL
    bad = jobs.revise(core, a, "no frame", from_seq=1)
    core.run_until_idle()
    with pytest.raises(InvalidRequest, match="cannot replace a frame"):
        bad.result()
    assert sa.context_ids() == sb.context_ids()  # refused: nothing changed


@pytest.mark.parametrize("weights", ["int8", "bf16"])
def test_a_vlm_with_packed_linear_layers_reads_frames(weights):
    from streamer.app import build_runner

    runner = build_runner("tiny-vl", weights=weights)
    assert runner.weights.format == weights
    core = EngineCore(runner, EngineLimits(kv_budget_bytes=16 << 20))
    sid = open_session(core)
    add_frame(core, sid, picture(3, 64, 64), 0.0)
    fut = query(core, sid, "What is it?", SamplingParams(max_tokens=3))
    core.run_until_idle()
    assert fut.result().tokens and torch.isfinite(core.sessions[sid].last_logits).all()


def video_session(core, images) -> str:
    sid = open_session(core)
    for k, img in enumerate(images):
        add_frame(core, sid, img, k * 0.5)
        jobs.append(core, sid, f" note {k}")
    core.run_until_idle()
    return sid


def test_dual_thinking_on_a_video_session_notes_after_the_frames_and_questions_read_them(vl):
    """Dual thinking on a VLM: a unit's notes are greedy text after the frames it saw (at the
    reading's next position, below its length), the reading cache is untouched, and a question
    then equals stateless greedy over the frames, the notes and the question as one sequence."""
    loaded, ref = vl
    core = make_core(loaded)
    images = [picture(6, 120, 90), picture(7, 90, 120)]
    sid = video_session(core, images)
    s = core.sessions[sid]
    before = (s.cache.length, s.next_position, s.cache.snapshot())
    assert s.next_position < s.cache.length
    thinking.configure_command(core, sid, {"mode": "dual", "unit_tokens": 8, "stop": "budget"})
    job = run_unit(core.runner, s, core.stop_ids)
    header = s.tokenize(s.framing.question_text(job.config.instruction()))
    assert job.fed == header + job.generated and job.generated
    assert job.generated == stock_greedy(ref, s.context_ids() + header, images, 8, core.stop_ids)
    unit = s.thinking.units[-1]
    assert unit.visible_pos == before[1]
    assert unit.positions == (before[1] + len(header), before[1] + len(job.fed) - 1)
    assert (s.cache.length, s.next_position) == before[:2] and torch.equal(s.cache.snapshot(), before[2])
    question = "What is in the notes?"
    fut = query(core, sid, question, SamplingParams(max_tokens=10))
    core.run_until_idle()
    prompt = s.context_ids() + job.fed + s.question_ids(question)
    assert fut.result().tokens == stock_greedy(ref, prompt, images, 10, core.stop_ids)


def test_interleaved_thinking_on_a_video_session_keeps_the_model_positions(vl):
    """Interleaved notes go into the reading cache as text at the reading's next position: a
    frame after them still continues the model's own positions, and the logits and a question
    equal the stock model over the whole sequence."""
    loaded, ref = vl
    core = make_core(loaded)
    images = [picture(8, 100, 100), picture(9, 64, 120)]
    sid = video_session(core, images[:1])
    s = core.sessions[sid]
    thinking.configure_command(core, sid, {"mode": "interleaved", "unit_tokens": 6, "stop": "budget"})
    job = run_unit(core.runner, s, core.stop_ids)
    assert s.chunks[-1].seq == 0 and s.chunks[-1].tokens == job.fed
    thinking.configure_command(core, sid, {"mode": "off"})  # no further units: the oracle is one sequence
    add_frame(core, sid, images[1], 1.0)
    jobs.append(core, sid, " end")
    core.run_until_idle()
    inputs = stock_inputs(ref, s.context_ids(), images)
    with torch.no_grad():
        want = ref(**inputs).logits[0, -1]
        positions, _ = ref.model.get_rope_index(inputs["input_ids"], image_grid_thw=inputs["image_grid_thw"],
                                                mm_token_type_ids=inputs["mm_token_type_ids"])
    assert s.next_position == int(positions.max()) + 1
    assert (s.last_logits - want).abs().max().item() <= TOL
    question = "What came last?"
    fut = query(core, sid, question, SamplingParams(max_tokens=8))
    core.run_until_idle()
    assert fut.result().tokens == stock_greedy(ref, s.context_ids() + s.question_ids(question), images, 8,
                                               core.stop_ids)


def test_dual_thinking_in_a_sliding_video_window_moves_notes_with_the_frames_they_saw(vl):
    """Many frames through a window with a vision bound while dual units run after each input:
    when old frames go, each unit's notes move down by the positions it saw of them (a frame
    takes fewer positions than tokens), so a unit's notes keep their place after the reading it
    saw, and thinking positions stay bounded; questions still answer."""
    loaded, _ = vl
    core = make_core(loaded)
    window = {"max_tokens": 240, "sink_inputs": 1, "vision_tokens": 120}
    fut = core.create_session("You watch a video.", window=window,
                              thinking={"mode": "dual", "unit_tokens": 4, "stop": "budget", "max_tokens": 64})
    core.run_until_idle()
    sid = fut.result()["session_id"]
    s = core.sessions[sid]
    offsets = {}  # unit index -> its first note's position - the reading position it saw - its slot, when written

    def offset(unit):  # eviction moves the first two together, dropping older notes the first and the third
        return unit.positions[0] - unit.visible_pos - unit.start

    s.listeners.append(lambda ev, p: ev == "reasoning.done" and offsets.setdefault(p["unit"], offset(s.thinking.units[-1])))
    jobs.append(core, sid, "The camera looks at the door.")
    for k in range(24):
        add_frame(core, sid, picture(60 + k, 64, 96), k * 0.5)
        if k % 4 == 0:
            jobs.append(core, sid, f" note {k}")
        core.run_until_idle()
    state = s.thinking
    assert s.window.slides > 3 and len(offsets) > 10 and state.dropped_units > 0
    shifted = 0
    for unit in state.units:
        # the reading it saw is whole inputs: its next position is the prefix's plus their spans
        saw = [c for c in s.chunks if c.end <= unit.visible]
        assert unit.visible == s.cache.prefix_len + sum(len(c.tokens) for c in saw)
        assert unit.visible_pos == s.cache.prefix_len + sum(c.span for c in saw)
        assert offset(unit) == offsets[unit.index]
        shifted += unit.visible < s.cache.length
    assert shifted
    assert state.last_position < window["max_tokens"] + 64 + 64
    fut = query(core, sid, "Who came in?", SamplingParams(max_tokens=4))
    core.run_until_idle()
    assert fut.result().tokens and torch.isfinite(s.last_logits).all()
