"""Video sessions on an engine whose model is a Qwen2.5-VL (tiny-vl, fp32), over a real
websocket: frames streamed as an MP4 go into the session's own reading cache, a flash question
is re-answered after each frame (stamped with data_version and media time), `query.create` is
answered by the model that saw the frames (token for token what stateless greedy says over the
same frames), and four video sessions share the engine's steps."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import torch

pytest.importorskip("av")

from helpers import tiny_vl_engine  # noqa: E402
from videogen import encode_video  # noqa: E402
from wsutil import next_of, raw, serve  # noqa: E402

from streamer.media import MediaConfig  # noqa: E402
from streamer.protocol import media_frame  # noqa: E402

FRAME_TOKENS = 16


@pytest.fixture(scope="module")
def engine():
    engine = tiny_vl_engine()
    yield engine
    engine.stop()


def pieces_of(data: bytes, seed: int) -> list[bytes]:
    rng, i, out = random.Random(seed), 0, []
    while i < len(data):
        n = rng.randint(1000, 2500)
        out.append(data[i:i + n])
        i += n
    return out


async def stream_video(peer, sid: str, data: bytes, seed: int = 1) -> None:
    ts = time.time()
    pieces = pieces_of(data, seed)
    for k, piece in enumerate(pieces):
        header = {"session_id": sid, "kind": "video", "format": "mp4", "seq": k, "ts": ts, "live": False,
                  "end": k == len(pieces) - 1 or None}
        await peer.send(media_frame(header, piece))


def stateless_greedy(engine, sid: str, frames: dict[str, "object"], question: str, max_tokens: int) -> list[int]:
    """Stock generate() of an untouched twin over the session's logged context + the question."""
    from streamer.app import load_tiny_vl
    from streamer.vision.vlm_patches import patchify

    ref = load_tiny_vl("tiny-vl:5").model
    s = engine.sessions[sid]
    prompt = s.context_ids() + s.question_ids(question)
    images = [frames[c.digest] for c in s.chunks if c.extent is not None]
    pixels, grids = zip(*(patchify(img, FRAME_TOKENS) for img in images))
    input_ids = torch.tensor([prompt])
    with torch.no_grad():
        out = ref.generate(input_ids=input_ids, pixel_values=torch.cat(pixels), image_grid_thw=torch.tensor(grids),
                           mm_token_type_ids=(input_ids == ref.config.image_token_id).int(),
                           max_new_tokens=max_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def test_video_flash_and_query_on_the_vl_engine(engine):
    from streamer.sessions.multimodal import blob_frame

    async def test(url, server):
        peer, watcher = await raw(url), await raw(url)
        created = await peer.request({"type": "session.create"})
        sid = created["session_id"]
        subscribed = await watcher.request({"type": "subscribe", "session_id": sid,
                                            "token": created["tokens"]["subscriber"]})
        assert subscribed["type"] == "subscribed", subscribed
        reg = await peer.request({"type": "flash.register", "session_id": sid, "question": "What is on screen?",
                                  "max_tokens": 4})
        assert reg["type"] == "flash.registered", reg
        await stream_video(peer, sid, encode_video("mp4"))
        obs, flashes = [], []
        while len(obs) < 12:  # 6 s at 2 fps
            event = await peer.recv(120)
            if event["type"] == "media.observation":
                obs.append(event)
            elif event["type"] == "flash.updated":
                flashes.append(event)
            else:
                assert event["type"] == "input.ack", event
        assert all(o["encoder"] == "engine-vl" and o["visual_tokens"] <= FRAME_TOKENS for o in obs)
        versions = [o["data_version"] for o in obs]
        assert versions == sorted(versions) and len(set(versions)) == 12
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["frames"] == 12 and state["inputs"] == 12
        assert state["next_position"] < state["tokens"]  # frames take fewer positions than tokens
        if not flashes:  # the first answer is always a change
            flashes.append(await next_of(peer, "flash.updated", 120))
        media_at = {o["data_version"]: o["start_s"] for o in obs}
        assert all(f["media_s"] == media_at[f["data_version"]] for f in flashes)  # the media time it saw
        deadline = time.monotonic() + 120
        while True:  # evaluated on the last frame too (pushed only if the answer changed)
            state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
            if state["flash"][0].get("data_version") == versions[-1] or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)
        assert state["flash"][0]["data_version"] == versions[-1]
        assert state["flash"][0]["media_s"] == obs[-1]["start_s"]
        pushed = await next_of(watcher, "flash.updated", 60)  # subscribers get the same answers
        assert (pushed["data_version"], pushed["media_s"]) == (flashes[0]["data_version"], flashes[0]["media_s"])
        assert state["flash"][0]["evaluations"] >= 2
        question = "What happened in the video?"
        await peer.send({"type": "query.create", "session_id": sid, "question": question, "max_tokens": 8})
        done = (await peer.until("query.done"))[-1]
        assert done["data_version"] == versions[-1]
        frames = {c.digest: blob_frame(await server.store.get_blob(c.digest))
                  for c in engine.sessions[sid].chunks if c.extent is not None}
        want = await asyncio.to_thread(stateless_greedy, engine, sid, frames, question, 8)
        stop = engine.core.stop_ids
        cut = next((i for i, t in enumerate(want) if t in stop), len(want))
        assert done["tokens"] == cut
        assert done["text"] == engine.runner.tokenizer.decode(want[:cut], skip_special_tokens=True)
        await peer.still_serving(sid)
        return sid

    serve(engine, test, media=MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=None))


def test_four_video_sessions_run_batched(engine):
    async def test(url, server):
        peers = [await raw(url) for _ in range(4)]
        sids = [await p.create() for p in peers]
        data = encode_video("mp4", seconds=4.0)
        before = engine.snapshot_stats()
        await asyncio.gather(*(stream_video(p, s, data, seed=k) for k, (p, s) in enumerate(zip(peers, sids))))

        async def observations(peer) -> list[dict]:
            got = []
            while len(got) < 8:
                event = await peer.recv(120)
                if event["type"] == "media.observation":
                    got.append(event)
            return got

        results = await asyncio.gather(*(observations(p) for p in peers))
        after = engine.snapshot_stats()
        for got in results:
            assert [o["start_s"] for o in got] == [k * 0.5 for k in range(8)]
        steps = after["steps"] - before["steps"]
        seqs = after["step_sequences"] - before["step_sequences"]
        assert seqs > steps  # frames of different sessions shared steps
        for p, s in zip(peers, sids):
            state = (await p.request({"type": "session.get", "session_id": s}))["session"]
            assert state["frames"] == 8

    serve(engine, test, media=MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=None))


def test_a_frame_whose_blob_the_store_refuses_is_neither_read_nor_logged(engine):
    """A frame's blob is stored on the event loop, in the session's log pipeline, before the
    engine reads the frame: a blob the store refuses fails that frame alone (an error event,
    store_unavailable; not in the cache, not in the log) and the stream goes on: the frames of the
    next container, once the store takes blobs again, are read and logged with their blobs."""
    from streamer.store import StoreError

    async def test(url, server):
        store = server.store
        put = store.put_blob

        async def refused(digest, data):
            raise StoreError("blobs are refused")

        async def send(pieces, seq0, ts):  # one `ts` per container: its frames' media times are exact
            for k, piece in enumerate(pieces):
                header = {"session_id": sid, "kind": "video", "format": "mp4", "seq": seq0 + k, "ts": ts,
                          "live": False, "end": k == len(pieces) - 1 or None}
                await peer.send(media_frame(header, piece))

        async def events(kind, n):
            got = []
            while len(got) < n:
                event = await peer.recv(120)
                if event["type"] == kind:
                    got.append(event)
            return got

        peer = await raw(url)
        sid = await peer.create()
        first = pieces_of(encode_video("mp4", seconds=1.0), 3)
        store.put_blob = refused
        ts = time.time()
        await send(first, 0, ts)
        errors = await events("error", 2)  # the two sampled frames (0.0 s and 0.5 s)
        assert {e["error"]["code"] for e in errors} == {"store_unavailable"}
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["frames"] == 0 and state["last_seq"] == 0
        store.put_blob = put
        await send(pieces_of(encode_video("mp4", seconds=1.0), 4), len(first), ts + 2.0)
        observed = await events("media.observation", 2)  # 2.0 s and 2.5 s
        assert [(o["seq"], o["start_s"]) for o in observed] == [(1, 2.0), (2, 2.5)]
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert state["frames"] == 2
        frames = [r for r in await store.read_log(sid) if r["kind"] == "frame"]
        assert [r["seq"] for r in frames] == [1, 2]
        for r in frames:
            assert await store.get_blob(r["blob"]) is not None

    serve(engine, test, media=MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=None))


def test_replay_of_a_video_session_rebuilds_the_cache_and_answers(engine, tmp_path):
    """Frames are logged as blobs before their records; replaying the log (frames read back from
    the store, evictions of the vision window repeated) gives the same context, the same KV
    values and the same greedy answer."""
    from streamer.recovery import replay
    from streamer.sessions.sampling import SamplingParams
    from streamer.store import FileStore

    question = "What did you see last?"

    async def run(url, server):
        peer = await raw(url)
        sid = await peer.create()
        await stream_video(peer, sid, encode_video("mp4"))
        obs = []
        while len(obs) < 12:
            event = await peer.recv(120)
            if event["type"] == "media.observation":
                obs.append(event)
        assert any("evicted" in (o.get("events") or []) for o in obs)  # the vision window slid
        await peer.send({"type": "query.create", "session_id": sid, "question": question, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        kv = await asyncio.wrap_future(engine.call(lambda: engine.sessions[sid].cache.snapshot()))
        context = await asyncio.wrap_future(engine.call(lambda: engine.sessions[sid].context_ids()))
        return sid, answer, kv, context

    store_dir = tmp_path / "state"
    media = MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=320)
    sid, answer, kv, context = serve(engine, run, store_url=str(store_dir), media=media)
    store = FileStore(store_dir)
    records = asyncio.run(store.read_log(sid))
    kinds = [r["kind"] for r in records]
    assert kinds.count("frame") == 12 and any(r.get("evicted") for r in records if r["kind"] == "frame")
    assert len(list((store_dir / "blobs").iterdir())) == 12
    state = asyncio.run(replay(engine, "replayed", [{**r, "session_id": "replayed"} for r in records], store))
    replayed = engine.sessions["replayed"]
    assert state["frames"] == 12 and state["last_seq"] == 12
    assert replayed.context_ids() == context
    replayed_kv = engine.call(lambda: replayed.cache.snapshot()).result(10)
    assert torch.allclose(replayed_kv, kv, atol=1e-5, rtol=0), (replayed_kv - kv).abs().max()
    assert engine.query("replayed", question, SamplingParams(max_tokens=8)).future.result(60).text == answer
    engine.close_session("replayed").result(10)


def test_a_text_model_worker_refuses_to_replay_frames(tmp_path, tiny):
    from streamer.records import Frame, ReplayError
    from streamer.sessions.engine import Engine

    eng = Engine(tiny[0])
    with pytest.raises(ReplayError, match="reads no images"):
        Frame(text="frame", blob="0" * 64, frame_tokens=16).apply(eng, "s")


def test_a_restarted_server_resumes_a_video_session_with_the_same_answer(engine, tmp_path):
    """session.resume on a second server over the same store directory replays the frames from
    their blobs and answers the same question the same way."""
    store = str(tmp_path / "state")
    question = "Which colour came last?"
    media = MediaConfig(frame_tokens=FRAME_TOKENS, window_tokens=None)

    async def first(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create"})
        sid = created["session_id"]
        await stream_video(peer, sid, encode_video("mp4", seconds=2.0), seed=5)
        seen = 0
        while seen < 4:
            seen += (await peer.recv(120))["type"] == "media.observation"
        await peer.send({"type": "query.create", "session_id": sid, "question": question, "max_tokens": 8})
        return created, (await peer.until("query.done"))[-1]

    created, answer = serve(engine, first, store_url=store, media=media)
    sid = created["session_id"]
    assert sid not in engine.sessions

    async def second(url, server):
        peer = await raw(url)
        resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                      "token": created["tokens"]["producer"]})
        assert resumed["type"] == "session.resumed", resumed
        assert resumed["session"]["frames"] == 4 and resumed["replayed_records"] >= 4
        await peer.send({"type": "query.create", "session_id": sid, "question": question, "max_tokens": 8})
        again = (await peer.until("query.done"))[-1]
        assert (again["text"], again["data_version"]) == (answer["text"], answer["data_version"])
        await peer.request({"type": "session.close", "session_id": sid})

    serve(engine, second, store_url=store, media=media)
