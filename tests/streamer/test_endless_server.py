"""Endless sessions over the websocket: a windowed session evicts, says so in `input.ack`, logs
it, and replays to the same cache and answers; `window: null` is unbounded and refused at the
limit; flash questions that cannot be answered say why with `flash.stale`."""

import asyncio

import torch

from streamer.recovery import replay
from streamer.sessions.sampling import SamplingParams
from streamer.store import FileStore

from wsutil import raw, serve

ROWS = [f"{i:05d},station-{i % 4},{(i * 7) % 31 - 5}.5,{i % 50}\n" for i in range(160)]
QUESTION = "Which station is the coldest?"


def test_a_slid_session_replays_to_the_same_cache_and_answers(tiny_engine, tmp_path):
    async def run(url, server):
        peer = await raw(url)
        created = await peer.request({"type": "session.create", "window": {"max_tokens": 300, "keep_tokens": 200},
                                      "flash": [{"question": QUESTION, "max_tokens": 6}]})
        sid = created["session_id"]
        assert created["session"]["window"]["max_tokens"] == 300
        acks = [await peer.request({"type": "input.text.append", "session_id": sid, "text": row, "client_seq": i + 1})
                for i, row in enumerate(ROWS)]
        assert all(a["type"] == "input.ack" for a in acks), acks[-1]
        assert max(a["total_tokens"] for a in acks) <= 300
        evicted = [s for a in acks for s in a.get("evicted_seqs") or ()]
        state = (await peer.request({"type": "session.get", "session_id": sid}))["session"]
        assert evicted == list(range(2, 2 + state["window"]["dropped_inputs"])) and evicted
        await peer.send({"type": "query.create", "session_id": sid, "question": QUESTION, "max_tokens": 8})
        answer = (await peer.until("query.done"))[-1]["text"]
        kv = await asyncio.wrap_future(tiny_engine.call(lambda: tiny_engine.sessions[sid].cache.snapshot()))
        return sid, answer, kv, evicted

    store_dir = tmp_path / "state"
    sid, answer, kv, evicted = serve(tiny_engine, run, store_url=str(store_dir))
    store = FileStore(store_dir)
    records = asyncio.run(store.read_log(sid))
    # the log starts from a checkpoint (taken after a slide): its K/V blob is in the store
    state = asyncio.run(replay(tiny_engine, "replayed", [{**r, "session_id": "replayed"} for r in records], store))
    replayed = tiny_engine.sessions["replayed"]
    # inputs are logged before they are applied; replay evicts the same inputs at the same turns
    assert state["last_seq"] == len(ROWS) and state["window"]["dropped_inputs"] == len(evicted)
    assert replayed.window.last_evicted_seq == evicted[-1]
    replayed_kv = tiny_engine.call(lambda: replayed.cache.snapshot()).result(10)
    assert replayed_kv.shape == kv.shape
    assert torch.allclose(replayed_kv, kv, atol=1e-5, rtol=0), (replayed_kv - kv).abs().max()
    assert tiny_engine.query("replayed", QUESTION, SamplingParams(max_tokens=8)).future.result(60).text == answer
    tiny_engine.close_session("replayed").result(10)


def test_default_windows_null_windows_and_stale_reasons(tiny_engine):
    async def run(url, server):
        peer = await raw(url)
        bounded = await peer.request({"type": "session.create"})
        assert bounded["session"]["window"]["default"] is True
        unbounded = await peer.request({"type": "session.create", "window": None})
        assert unbounded["session"]["window"] is None
        sid = unbounded["session_id"]
        big = "word " * 400
        for _ in range(20):
            reply = await peer.request({"type": "input.text.append", "session_id": sid, "text": big})
            if reply["type"] == "error":
                break
        assert reply["type"] == "error" and reply["error"]["code"] == "context_overflow", reply
        assert reply["error"]["recoverable"] is True
        # the session survives and can take a bound later
        updated = await peer.request({"type": "session.update", "session_id": sid, "window": {"max_tokens": 300}})
        assert updated["type"] == "session.updated" and updated["session"]["window"]["max_tokens"] == 300
        lifted = await peer.request({"type": "session.update", "session_id": sid, "window": None})
        assert lifted["session"]["window"] is None
        # an unbounded session leaves no room for a long flash question once its data fills up:
        # it says so (a windowed one evicts old input first and answers)
        ctx = bounded["session"]["context_window"]
        full = await peer.request({"type": "session.create", "window": None,
                                   "flash": [{"question": "Describe all of it. " * 30, "max_tokens": 4}]})
        fid = full["session"]["flash"][0]["flash_id"]
        for _ in range(ctx // 80 + 2):
            reply = await peer.request({"type": "input.text.append", "session_id": full["session_id"],
                                        "text": "word " * 80})
            if reply["type"] == "error":
                assert reply["error"]["code"] == "context_overflow", reply
                break
        stale = await peer.until("flash.stale")
        event = stale[-1]
        assert event["flash_id"] == fid and event["reason"] == "no_room" and "does not fit" in event["message"]
        state = (await peer.request({"type": "session.get", "session_id": full["session_id"]}))["session"]
        assert state["flash"][0]["stale"] == "no_room"

    serve(tiny_engine, run)
