"""The VLM encoder behind the video pipeline: a generated video streamed in pieces reaches the
Qwen2.5-VL stream cache frame by frame, exactly as appending the same frames directly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from streamer.vision.ingest import VideoConfig, VideoIngest  # noqa: E402
from streamer.vision.vlm import (  # noqa: E402
    QwenVLEncoder,
    TinyVLMConfig,
    VLMStream,
    Window,
    build_tiny_vlm,
    vlm_encoder_factory,
)

from videogen import encode_video  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class RecordingEncoder(QwenVLEncoder):
    """The real encoder, keeping a copy of each frame it was given (to replay them directly)."""

    def __init__(self, inner: QwenVLEncoder) -> None:
        super().__init__(inner.stream, inner.max_pixels)
        self.seen: list[np.ndarray] = []

    def encode(self, frames):
        self.seen += [f.image.copy() for f in frames]
        return super().encode(frames)


def test_streamed_video_reaches_the_vlm_cache_as_direct_appends():
    model = build_tiny_vlm(TinyVLMConfig(seed=11, max_positions=2048))
    make = vlm_encoder_factory(model, frame_tokens=12, window=Window(sink_tokens=4, vision_tokens=400,
                                                                      text_tokens=64), prompt=[5, 6, 7, 8])
    encoder = RecordingEncoder(make())
    events: list[tuple[str, dict]] = []
    ingest = VideoIngest(None, "s1", encoder, lambda t, p: events.append((t, p)), VideoConfig(sample_fps=2.0))
    data = encode_video("mp4", seconds=6.0)
    rng = np.random.default_rng(0)
    cuts = sorted(rng.choice(np.arange(1, len(data)), 12, replace=False).tolist())
    pieces = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    for seq, piece in enumerate(pieces):
        ingest.feed("video", "mp4", piece, seq, ts=1000.0, end=seq == len(pieces) - 1, live=False)
    assert ingest.wait_idle(timeout=120)
    observations = [p for t, p in events if t == "media.observation"]
    assert not [p for t, p in events if t == "error"]
    assert 10 <= len(observations) <= 13  # 6 s sampled at 2 fps
    assert all(1 <= p["visual_tokens"] <= 12 and p["text"] is None for p in observations)
    state = ingest.state()
    assert state["frames"] == len(encoder.seen) == len(observations)
    assert state["tokens"] == state["visual_tokens"] == sum(p["visual_tokens"] for p in observations)

    direct = VLMStream(model, frame_tokens=12, window=Window(sink_tokens=4, vision_tokens=400, text_tokens=64))
    direct.append_tokens([5, 6, 7, 8])
    for image in encoder.seen:
        direct.append_image(image)
    assert torch.equal(direct.positions(), encoder.stream.positions())
    assert (direct.logits - encoder.stream.logits).abs().max().item() <= 1e-5
    ingest.close()
