"""Checkpoints of a video session on a vision-language model (tiny-vl): replay from the last
checkpoint (its K/V from a blob, the frames after it from theirs) equals the live session, and
it still does once the retention time has passed: the frames compacted away expire, the blobs
the log names never do."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("av")

from helpers import tiny_vl_engine, until  # noqa: E402
from test_vl_engine_server import FRAME_TOKENS, stream_video  # noqa: E402
from videogen import encode_video  # noqa: E402
from wsutil import raw, serve  # noqa: E402

from streamer.media import MediaConfig  # noqa: E402
from streamer.recovery import replay  # noqa: E402
from streamer.sessions.sampling import SamplingParams  # noqa: E402
from streamer.store import FileStore  # noqa: E402


@pytest.fixture(scope="module")
def engine():
    engine = tiny_vl_engine()
    yield engine
    engine.stop()


def test_a_video_session_older_than_the_retention_replays_from_its_checkpoint(engine, tmp_path):
    question = "What did you see last?"

    async def run(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await stream_video(peer, sid, encode_video("mp4"))
        seen = 0
        while seen < 12:
            seen += (await peer.recv(120))["type"] == "media.observation"
        pipe = server.events.pipes[sid]
        await until(lambda: pipe.checkpointing is None or pipe.checkpointing.done(), 120,
                    "the checkpoint in flight to finish")
        await peer.send({"type": "query.create", "session_id": sid, "question": question, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        kv = await asyncio.wrap_future(engine.call(lambda: engine.sessions[sid].cache.snapshot()))
        context = await asyncio.wrap_future(engine.call(lambda: engine.sessions[sid].context_ids()))
        live = await asyncio.wrap_future(engine.session_state(sid))
        return sid, answer, kv, context, live, server.events.counters["checkpoints"]

    store_dir = tmp_path / "state"
    media = MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=320)
    sid, answer, kv, context, live, checkpoints = serve(engine, run, store_url=str(store_dir), media=media,
                                                        checkpoint_records=4, checkpoint_min_records=2)
    assert checkpoints >= 2
    # a day later: a store started with retention 0 drops every blob no log names
    store = asyncio.run(FileStore(store_dir, retention_s=0).start())
    records = asyncio.run(store.read_log(sid))
    kinds = [r["kind"] for r in records]
    assert kinds[0] == "create" and kinds.count("checkpoint") == 1 and kinds.count("frame") < 12, kinds
    named = {r["blob"] for r in records if "blob" in r}
    assert {p.name for p in (store_dir / "blobs").iterdir()} == named  # the rest expired
    state = asyncio.run(replay(engine, "replayed", [{**r, "session_id": "replayed"} for r in records], store))
    replayed = engine.sessions["replayed"]
    for key in ("frames", "last_seq", "data_version", "tokens", "next_position"):
        assert state[key] == live[key], key
    assert replayed.context_ids() == context
    replayed_kv = engine.call(lambda: replayed.cache.snapshot()).result(10)
    assert replayed_kv.shape == kv.shape
    assert torch.allclose(replayed_kv, kv, atol=1e-5, rtol=0), (replayed_kv - kv).abs().max()
    assert engine.query("replayed", question, SamplingParams(max_tokens=8)).future.result(60).text == answer
    engine.close_session("replayed").result(10)
