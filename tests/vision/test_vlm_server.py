"""The Qwen2.5-VL path behind a real websocket server: a video streamed as binary media frames
and a still image after it go into the session's VLM stream cache (visual tokens, no text
appended to the session), and the session state shows the stream."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

pytest.importorskip("av")

from videogen import encode_image, encode_video  # noqa: E402
from wsutil import raw, serve  # noqa: E402

from streamer.media import MediaConfig  # noqa: E402
from streamer.protocol import media_frame  # noqa: E402
from streamer.vision.vlm import vlm_factory_from_spec  # noqa: E402


@pytest.fixture(scope="module")
def engine(tokenizer):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=21)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name), EngineLimits(max_context_tokens=1024)).start()
    yield engine
    engine.stop()


def test_video_over_the_websocket_reaches_the_vlm_cache(engine):
    make = vlm_factory_from_spec("tiny", frame_tokens=9)
    encoders = []

    def factory():
        encoders.append(make())
        return encoders[-1]

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        before = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        data, rng, i, pieces = encode_video("mp4"), random.Random(3), 0, []
        while i < len(data):
            n = rng.randint(1000, 2500)  # pieces: the video pipeline's own tests cover tiny ones
            pieces.append(data[i:i + n])
            i += n
        ts = time.time()
        for k, piece in enumerate(pieces):
            header = {"session_id": sid, "kind": "video", "format": "mp4", "seq": k, "ts": ts, "live": False,
                      "end": k == len(pieces) - 1 or None}
            await peer.send(media_frame(header, piece))
        obs = []
        while len(obs) < 12:  # 6 s of video sampled at 2 fps
            event = await peer.recv(60)
            assert event["type"] in ("input.ack", "media.observation"), event
            if event["type"] == "media.observation":
                obs.append(event)
        assert all(o["encoder"] == "qwen2.5-vl" and o.get("text") is None and 1 <= o["visual_tokens"] <= 9
                   for o in obs)
        assert [o["start_s"] for o in obs] == sorted(o["start_s"] for o in obs)
        # a still image joins the same stream after the video
        img = np.zeros((120, 160, 3), np.uint8)
        img[:, 80:] = (30, 200, 90)
        await peer.send(media_frame({"session_id": sid, "kind": "image", "format": "png", "seq": len(pieces),
                                     "ts": ts + 7}, encode_image("png", img)))
        event = await peer.recv(60)
        while event["type"] == "input.ack":
            event = await peer.recv(60)
        assert event["type"] == "media.observation" and event["visual_tokens"] >= 1, event
        obs.append(event)
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        video = state["media"]["video"]
        assert video["encoder"] == "qwen2.5-vl" and video["frames"] == 13 == video["observations"]
        assert video["visual_tokens"] == sum(o["visual_tokens"] for o in obs) == video["tokens"]
        assert video["cache_tokens"] <= video["cache_bound"]
        assert (state["tokens"], state["inputs"]) == (before["tokens"], before["inputs"])  # no text appended
        await peer.still_serving(sid)

    serve(engine, test, media=MediaConfig(video_encoder=factory))
    assert len(encoders) == 1 and encoders[0].stream.stats.frames == 13
