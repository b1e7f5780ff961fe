"""Frames into Qwen2.5-VL inputs: the patch layout is the vision tower's (and transformers'
image processor's), the per-frame visual-token budget holds for any size, and the engine's
frame encoder reports what it put into the session's cache and survives bad frames. The
exactness of frames on the engine (incremental equals one forward, questions equal stateless
greedy, windows) is in tests/sessions/test_vl_engine.py."""

from __future__ import annotations

import json
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from streamer.sessions import jobs
from streamer.sessions.engine import EngineCore, EngineLimits
from streamer.sessions.runner import ModelRunner
from streamer.vision.encoder import Frame
from streamer.vision.errors import MediaTooLarge, UnsupportedMedia
from streamer.vision.vlm import EngineFrameEncoder, patchify
from videogen import picture





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
def test_visual_token_budget_per_frame_holds(shape, budget):
    pv, grid = patchify(picture(0, *shape), budget)
    tokens = grid[1] * grid[2] // 4
    assert 1 <= tokens <= budget
    assert pv.shape[0] == grid[1] * grid[2]
    if shape == (480, 640) and budget == 64:  # aspect ratio kept as far as 28-pixel steps allow
        assert abs(grid[2] / grid[1] - 640 / 480) < 0.2


class CoreEngine:
    """The media path's view of the engine (`LoggedEngine.append_frame`'s signature) over an
    EngineCore stepped on the calling thread."""

    def __init__(self, core: EngineCore) -> None:
        self.core, self.runner = core, core.runner

    def append_frame(self, sid, frame, text, frame_tokens, label=None) -> Future:
        fut = jobs.append_frame(self.core, sid, frame, text)
        self.core.run_until_idle()
        return fut


def test_engine_encoder_reports_tokens_and_survives_bad_frames():
    from streamer.app import load_tiny_vl

    loaded = load_tiny_vl()
    core = EngineCore(ModelRunner(loaded.model, loaded.tokenizer, loaded.name), EngineLimits(kv_budget_bytes=16 << 20))
    created = core.create_session(None, window=None)
    core.run_until_idle()
    sid = (created if isinstance(created, dict) else created.result())["session_id"]
    enc = EngineFrameEncoder(CoreEngine(core), sid, frame_tokens=9, max_pixels=500 * 500)
    frames = [Frame(picture(i, 120, 160), pts=i * 0.5, ts=100 + i * 0.5, index=i) for i in range(3)]
    obs = enc.encode(frames[:2])
    assert [o.frames for o in obs] == [[0], [1]]
    assert all(1 <= o.tokens <= 9 and o.text is None for o in obs)
    assert [o.appended.data_version for o in obs] == [1, 2]
    assert obs[1].ts == 100.5 and obs[1].start_s == 0.5
    s = core.sessions[sid]
    length = s.cache.length
    with pytest.raises(MediaTooLarge):
        enc.encode([Frame(np.zeros((600, 600, 3), np.uint8), pts=1.0, ts=101.0, index=3)])
    with pytest.raises(UnsupportedMedia):
        enc.encode([Frame(np.zeros((2, 900, 3), np.uint8), pts=1.0, ts=101.0, index=4)])
    with pytest.raises(UnsupportedMedia):
        enc.encode([Frame(np.zeros((20, 20), np.uint8), pts=1.0, ts=101.0, index=5)])
    assert s.cache.length == length and s.data_version == 2  # nothing half-written
    enc.encode(frames[2:])
    state = enc.state()
    json.dumps(state)
    assert state["frames"] == 3 == s.frames and s.media_s == 1.0
    assert state["visual_tokens"] == sum(o.tokens for o in obs) + s.chunks[-1].tokens.count(loaded.model.config.image_token_id)
    assert torch.isfinite(s.last_logits).all()
