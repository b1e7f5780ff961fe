"""The Qwen2.5-VL path on a tiny seeded random-weight model (fp32): incremental frames and text
equal one forward over the whole multimodal sequence, M-RoPE positions continue chunk to chunk,
the per-frame budget holds, and a bounded stream stays bounded with positions in range."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from streamer.sessions.errors import ContextOverflow
from streamer.vision.encoder import Frame
from streamer.vision.errors import MediaTooLarge, UnsupportedMedia
from streamer.vision.vlm import (
    QwenVLEncoder,
    TinyVLMConfig,
    VLMStream,
    Window,
    build_tiny_vlm,
    patchify,
)

TOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: one thread is faster than several, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    """The model under test and an untouched twin with stock attention for reference runs."""
    cfg = TinyVLMConfig(seed=7, max_positions=1024)
    return build_tiny_vlm(cfg), build_tiny_vlm(cfg)


def picture(seed: int, height: int, width: int) -> np.ndarray:
    """A frame with structure (gradients, a block) plus noise, so patches differ."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    img = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                    np.full_like(x, 40 * seed % 256)], -1).astype(np.int16)
    img[height // 4: height // 2, width // 3: width // 2] = rng.integers(0, 256, 3)
    img += rng.integers(-20, 21, img.shape)
    return img.clip(0, 255).astype(np.uint8)


def reference_logits(ref, items, frame_tokens: int):
    """One stock forward over the whole sequence. `items`: lists of token ids or images."""
    cfg = ref.config
    ids, pixels, grids = [], [], []
    for item in items:
        if isinstance(item, np.ndarray):
            pv, grid = patchify(item, frame_tokens)
            n = grid[1] * grid[2] // 4
            ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]
            pixels.append(pv)
            grids.append(grid)
        else:
            ids += list(item)
    input_ids = torch.tensor([ids])
    kwargs = {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.tensor(grids),
              "mm_token_type_ids": (input_ids == cfg.image_token_id).int()}
    with torch.no_grad():
        logits = ref(input_ids=input_ids, **kwargs).logits[0]
        positions, _ = ref.model.get_rope_index(input_ids, image_grid_thw=kwargs["image_grid_thw"],
                                                mm_token_type_ids=kwargs["mm_token_type_ids"])
    return logits, positions[:, 0]


def test_incremental_frames_and_text_equal_one_forward(models):
    model, ref = models
    items = [[1, 5, 9, 33, 2], picture(1, 100, 150), [17, 4, 8], picture(2, 64, 64),
             picture(3, 300, 200), [60, 61, 62, 63], picture(4, 90, 40), [7]]
    stream = VLMStream(model, frame_tokens=16)
    ends, got = [], []
    for item in items:
        if isinstance(item, np.ndarray):
            stream.append_image(item, ts=0.0)
        else:
            stream.append_tokens(item)
        ends.append(stream.cache.length)
        got.append(stream.logits)
    want, positions = reference_logits(ref, items, frame_tokens=16)
    assert stream.cache.length == want.shape[0]
    for end, logits in zip(ends, got):
        assert (logits - want[end - 1]).abs().max().item() <= TOL
    assert torch.equal(stream.positions(), positions)
    assert stream.next_pos == int(positions.max()) + 1


def test_positions_continue_across_chunks_for_any_split(models):
    """Text split differently around frames gives the same positions and logits."""
    model, _ = models
    img = picture(5, 120, 80)
    a = VLMStream(model, frame_tokens=12)
    a.append_tokens([3, 4, 5, 6])
    a.append_image(img)
    a.append_tokens([7, 8, 9])
    b = VLMStream(model, frame_tokens=12)
    for t in (3, 4, 5, 6):
        b.append_tokens([t])
    b.append_image(img)
    b.append_tokens([7])
    b.append_tokens([8, 9])
    assert torch.equal(a.positions(), b.positions())
    assert (a.logits - b.logits).abs().max().item() <= TOL


def test_patch_layout_follows_the_vision_tower_layout():
    """An image already at a multiple of 28: no resize; each row is one 14x14 patch in merge
    order, channel-major, the still frame repeated over the temporal patch."""
    img = picture(6, 56, 84)
    pv, grid = patchify(img, max_tokens=64)
    assert grid == (1, 4, 6)
    assert pv.shape == (24, 3 * 2 * 14 * 14)
    mean = np.array([0.48145466, 0.4578275, 0.40821073]).reshape(3, 1, 1)
    std = np.array([0.26862954, 0.26130258, 0.27577711]).reshape(3, 1, 1)
    norm = (img.transpose(2, 0, 1) / 255.0 - mean) / std
    row = 0
    for bh in range(2):
        for bw in range(3):
            for mh in range(2):
                for mw in range(2):
                    y, x = (bh * 2 + mh) * 14, (bw * 2 + mw) * 14
                    patch = norm[:, y:y + 14, x:x + 14]
                    want = np.stack([patch, patch], 1).reshape(-1)  # (C, T, ph, pw)
                    np.testing.assert_allclose(pv[row].numpy(), want, atol=1e-5)
                    row += 1


def test_patches_match_the_transformers_image_processor():
    """Against Qwen2-VL's own (PIL-backed) image processor: identical patches when no resize is
    needed, the same grid for any size and budget, and close pixels after resizing."""
    pytest.importorskip("PIL")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
        smart_resize,
    )

    from streamer.vision.vlm import fit_size

    for h, w, budget in [(100, 150, 16), (480, 640, 256), (720, 1280, 64), (30, 500, 8), (56, 56, 4)]:
        theirs = smart_resize(h, w, 28, min(56 * 56, budget * 784), budget * 784)
        ours = fit_size(h, w, budget)
        if theirs[0] * theirs[1] <= budget * 784:
            assert ours == theirs
        else:  # a thin frame on a small budget: theirs overshoots, ours still fits
            assert (30, 500) == (h, w) and ours[0] * ours[1] <= budget * 784
    for h, w, budget in [(56, 84, 64), (480, 640, 100), (101, 77, 9)]:
        img = picture(h, h, w)
        proc = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": budget * 784})
        out = proc(images=[img], return_tensors="pt")
        pv, grid = patchify(img, budget)
        assert tuple(out["image_grid_thw"][0].tolist()) == grid
        diff = (pv - out["pixel_values"]).abs()
        if (h, w) == (56, 84):
            assert diff.max().item() < 1e-5
        else:  # torch's antialiased bicubic vs PIL's: a few 8-bit levels at edges
            assert diff.mean().item() < 0.02


@pytest.mark.parametrize("shape", [(480, 640), (1080, 1920), (50, 1000), (20, 20), (3000, 40)])
@pytest.mark.parametrize("budget", [4, 16, 64])
def test_visual_token_budget_per_frame_holds(models, shape, budget):
    pv, grid = patchify(picture(0, *shape), budget)
    tokens = grid[1] * grid[2] // 4
    assert 1 <= tokens <= budget
    assert pv.shape[0] == grid[1] * grid[2]
    if shape == (480, 640) and budget == 64:  # aspect ratio kept as far as 28-pixel steps allow
        assert abs(grid[2] / grid[1] - 640 / 480) < 0.2


def test_encoder_reports_tokens_and_survives_bad_frames(models):
    model, _ = models
    enc = QwenVLEncoder(VLMStream(model, frame_tokens=9), max_pixels=500 * 500)
    frames = [Frame(picture(i, 120, 160), pts=i * 0.5, ts=100 + i * 0.5, index=i) for i in range(3)]
    obs = enc.encode(frames[:2])
    assert [o.frames for o in obs] == [[0], [1]]
    assert all(1 <= o.tokens <= 9 and o.text is None for o in obs)
    assert obs[1].ts == 100.5 and obs[1].start_s == 0.5
    length = enc.stream.cache.length
    with pytest.raises(MediaTooLarge):
        enc.encode([Frame(np.zeros((600, 600, 3), np.uint8), pts=1.0, ts=101.0, index=3)])
    with pytest.raises(UnsupportedMedia):
        enc.encode([Frame(np.zeros((2, 900, 3), np.uint8), pts=1.0, ts=101.0, index=4)])
    with pytest.raises(UnsupportedMedia):
        enc.encode([Frame(np.zeros((20, 20), np.uint8), pts=1.0, ts=101.0, index=5)])
    assert enc.stream.cache.length == length  # nothing half-written
    enc.encode(frames[2:])
    state = enc.state()
    json.dumps(state)
    assert state["frames"] == 3 and state["cache_tokens"] > length
    assert (state["window_from_ts"], state["window_to_ts"]) == (100.0, 101.0)


def test_generate_is_a_fork_and_matches_stock_greedy(models):
    model, ref = models
    items = [[11, 12, 13], picture(8, 84, 112), [14, 15]]
    stream = VLMStream(model, frame_tokens=12)
    stream.append_tokens(items[0])
    stream.append_image(items[1])
    stream.append_tokens(items[2])
    before = stream.cache.snapshot()
    pos = stream.next_pos
    answer = stream.generate([20, 21], max_new_tokens=5)
    assert torch.equal(stream.cache.snapshot(), before) and stream.next_pos == pos
    seq = [items[0], items[1], items[2] + [20, 21]]
    want = []
    for _ in range(5):  # stateless greedy: one full forward per token
        logits, _ = reference_logits(ref, seq, frame_tokens=12)
        want.append(int(logits[-1].argmax()))
        seq[-1] = seq[-1] + [want[-1]]
    assert answer == want


def layer0_matches(bounded: VLMStream, fresh: VLMStream) -> None:
    """Positions packed as the fresh stream numbers them; first-layer K/V equal (they depend only
    on each token and its position, not on what was evicted)."""
    assert torch.equal(bounded.positions(), fresh.positions())
    assert bounded.next_pos == fresh.next_pos
    n = fresh.cache.length
    assert bounded.cache.length == n
    for got, want in zip(bounded.cache.layer(0), fresh.cache.layer(0)):
        assert (got[:, :n] - want[:, :n]).abs().max().item() <= 1e-5


def test_reanchored_keys_equal_keys_computed_at_the_new_positions(models):
    """Evicting a frame and re-anchoring: the kept tokens' first-layer keys and values equal a
    fresh stream over just the kept inputs."""
    model, _ = models
    imgs = [picture(10 + i, 84, 84) for i in range(3)]  # 9 visual tokens each at budget 9
    window = Window(sink_tokens=4, vision_tokens=2 * 11, text_tokens=64)
    bounded = VLMStream(model, frame_tokens=9, window=window)
    bounded.append_tokens([1, 2, 3, 4])
    for img in imgs:
        bounded.append_image(img)
    bounded.append_tokens([5, 6])
    assert bounded.stats.evicted_frames == 1 and bounded.stats.reanchors == 1
    fresh = VLMStream(model, frame_tokens=9)
    fresh.append_tokens([1, 2, 3, 4])
    for img in imgs[1:]:
        fresh.append_image(img)
    fresh.append_tokens([5, 6])
    layer0_matches(bounded, fresh)


def test_text_evicted_from_its_oldest_token_and_sinks_split_at_their_budget(models):
    """Text beyond the text window goes from its oldest token (a span can be cut in the middle);
    a text chunk crossing the sink budget is pinned only up to it."""
    model, _ = models
    img = picture(13, 84, 84)
    bounded = VLMStream(model, frame_tokens=9, window=Window(sink_tokens=4, vision_tokens=11, text_tokens=6))
    bounded.append_tokens([1, 2, 3, 4, 10, 11, 12])  # 4 pinned + 3 in the text window
    assert [(s.pinned, s.length) for s in bounded.spans] == [(True, 4), (False, 3)]
    bounded.append_tokens([13, 14, 15])
    bounded.append_image(img)
    bounded.append_tokens([16, 17, 18])  # 9 text tokens for a window of 6: 10, 11, 12 go
    assert bounded.stats.evicted_text_tokens == 3
    fresh = VLMStream(model, frame_tokens=9)
    fresh.append_tokens([1, 2, 3, 4])
    fresh.append_tokens([13, 14, 15])
    fresh.append_image(img)
    fresh.append_tokens([16, 17, 18])
    layer0_matches(bounded, fresh)
    bounded.append_tokens([19, 20, 21, 22, 23])  # now 13..15 and 16, 17 go: a span cut in two
    fresh = VLMStream(model, frame_tokens=9)
    fresh.append_tokens([1, 2, 3, 4])
    fresh.append_image(img)
    fresh.append_tokens([18, 19, 20, 21, 22, 23])
    layer0_matches(bounded, fresh)


def test_long_stream_stays_within_its_bound_and_position_range():
    """Hundreds of frames with text between them, on a model with only 512 positions: the cache
    stays within the window's bound, positions stay in range, logits stay finite."""
    model = build_tiny_vlm(TinyVLMConfig(seed=3, max_positions=512))
    window = Window(sink_tokens=8, vision_tokens=4 * 18, text_tokens=200, query_tokens=64)
    stream = VLMStream(model, frame_tokens=16, window=window)
    bound = window.bound(16)
    assert stream.bound == bound and bound + window.query_tokens <= 512
    assert bound > stream.cache.capacity  # the buffer grows while the stream runs
    stream.append_tokens(list(range(10, 20)))
    rng = np.random.default_rng(0)
    appended = 0
    for i in range(240):
        h, w = rng.integers(40, 400, 2)
        appended += stream.append_image(picture(i, int(h), int(w)), ts=i * 0.5) + 2
        if i % 3 == 0:
            ids = rng.integers(0, 200, rng.integers(1, 40)).tolist()
            stream.append_tokens(ids)
            appended += len(ids)
        assert stream.cache.length <= bound
        assert int(stream.positions().max()) < stream.next_pos <= stream.cache.length
        assert torch.isfinite(stream.logits).all()
    assert appended > 8 * 512  # ran far past the position range
    assert stream.stats.max_position < 512
    assert stream.stats.evicted_frames > 200 and stream.stats.evicted_text_tokens > 0
    frames = [s for s in stream.spans if s.kind == "frame" and not s.pinned]
    assert sum(s.length for s in frames) <= window.vision_tokens
    assert sum(s.length for s in stream.spans if s.kind == "text" and not s.pinned) <= window.text_tokens
    assert [s.start for s in stream.spans] == sorted(s.start for s in stream.spans)
    sinks = [s for s in stream.spans if s.pinned]
    assert sum(s.length for s in sinks) == 8 and sinks[0].base == 0  # sinks never move
    length = stream.cache.length
    answer = stream.generate(list(range(30, 60)), max_new_tokens=20)  # a question still fits
    assert len(answer) == 20 and stream.cache.length == length
    with pytest.raises(ContextOverflow):
        stream.generate(list(range(300)), max_new_tokens=20)


def test_window_settings_are_checked(models):
    model, _ = models
    with pytest.raises(ValueError, match="cannot hold one frame"):
        VLMStream(model, frame_tokens=64, window=Window(vision_tokens=32))
    with pytest.raises(ValueError, match="exceeds the model"):
        VLMStream(model, frame_tokens=16, window=Window(text_tokens=5000))
    with pytest.raises(ValueError):
        VLMStream(model, frame_tokens=0)
    with pytest.raises(ValueError, match="exceeds the model"):
        VLMStream(model, frame_tokens=16, max_tokens=5000)
    with pytest.raises(ValueError, match="must be >= 0"):
        Window(sink_tokens=-1)
    unbounded = VLMStream(model, frame_tokens=16, max_tokens=40)
    unbounded.append_tokens(list(range(30)))
    with pytest.raises(ContextOverflow):
        unbounded.append_image(picture(1, 200, 200))
    assert unbounded.cache.length == 30


def test_streams_sharing_one_model_on_threads_equal_sequential_runs(models):
    """vlm_encoder_factory shares one model between sessions' encoder threads: concurrent
    streams give exactly what each gives alone."""
    import threading

    model, _ = models
    inputs = {k: [picture(20 * k + i, 70 + 10 * i, 90) for i in range(6)] for k in range(2)}

    def run(k: int, out: dict) -> None:
        stream = VLMStream(model, frame_tokens=9, window=Window(sink_tokens=2, vision_tokens=33, text_tokens=16))
        stream.append_tokens([k + 1, k + 2])
        for img in inputs[k]:
            stream.append_image(img)
            stream.append_tokens([k + 3])
        out[k] = (stream.positions(), stream.logits, stream.cache.snapshot())

    alone: dict = {}
    for k in inputs:
        run(k, alone)
    together: dict = {}
    threads = [threading.Thread(target=run, args=(k, together)) for k in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in inputs:
        assert torch.equal(alone[k][0], together[k][0])
        assert torch.equal(alone[k][1], together[k][1])
        assert torch.equal(alone[k][2], together[k][2])


@pytest.mark.embedded
def test_ask_frames_the_question_and_matches_stock_greedy(tokenizer):
    """With a real chat tokenizer (the embedded model's): the stream opens with the chat
    template's system prompt and data turn, `ask` closes it with the question, and the answer
    equals stateless greedy decoding over the same tokens; the stream is untouched."""
    from streamer.sessions.sampling import stop_token_ids
    from streamer.vision.vlm import vlm_encoder_factory

    cfg = TinyVLMConfig(seed=5, vocab=len(tokenizer), max_positions=1024)
    model, ref = build_tiny_vlm(cfg), build_tiny_vlm(cfg)
    encoder = vlm_encoder_factory(model, tokenizer, frame_tokens=9, window=None)()
    stream = encoder.stream
    prompt = stream.data_prompt()
    assert "<|im_start|>" in prompt and stream.system_prompt in prompt
    img = picture(9, 84, 84)
    encoder.encode([Frame(img, pts=0.0, ts=0.0, index=0)])  # after its media time as text
    stream.append_text("a red square")
    assert [sp.kind for sp in stream.spans] == ["text", "text", "frame", "text"]
    before, pos = stream.cache.snapshot(), stream.next_pos
    answer = stream.ask("What is in the picture?", max_new_tokens=6)
    assert torch.equal(stream.cache.snapshot(), before) and stream.next_pos == pos

    from streamer.sessions.framing import Framing

    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    question = enc(Framing.for_tokenizer(tokenizer, stream.system_prompt).question_text("What is in the picture?"))
    seq = [enc(prompt) + enc("[0.0s] "), img, enc("a red square") + question]
    stop = stop_token_ids(tokenizer, ref)
    want: list[int] = []
    while len(want) < 6 and not (want and want[-1] in stop):
        logits, _ = reference_logits(ref, seq, frame_tokens=9)
        want.append(int(logits[-1].argmax()))
        seq[-1] = seq[-1] + [want[-1]]
    assert answer == tokenizer.decode(want, skip_special_tokens=True).strip()

    full = VLMStream(model, tokenizer, frame_tokens=9, max_tokens=stream.cache.length + 9)  # no room for a frame
    full.append_tokens(list(range(100, 100 + stream.cache.length)))
    with pytest.raises(ContextOverflow):  # label and frame are checked together: neither goes in
        QwenVLEncoder(full).encode([Frame(img, pts=1.0, ts=1.0, index=1)])
    assert full.cache.length == stream.cache.length and full.stats.text_tokens == stream.cache.length


def test_factory_from_spec(tmp_path):
    from streamer.sessions.models import ModelLoadError
    from streamer.vision.vlm import vlm_factory_from_spec

    make = vlm_factory_from_spec("tiny", frame_tokens=9)
    a, b = make(), make()
    assert a.stream.model is b.stream.model and a.stream.cache is not b.stream.cache
    assert a.stream.bound <= a.stream.max_positions and not a.timestamps
    obs = a.encode([Frame(picture(1, 60, 80), pts=0.0, ts=0.0, index=0)])
    assert obs[0].tokens >= 1 and b.stream.cache.length == 0
    with pytest.raises(ModelLoadError, match="cannot load"):
        vlm_factory_from_spec(str(tmp_path / "missing"))
