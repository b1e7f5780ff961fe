"""The engine's hand-overs to the event loop (streamer.loopbridge): in order, one wake-up per
batch, held for the length of a round of engine commands, and counted on /metrics."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request
from concurrent.futures import Future

import pytest

from streamer.loopbridge import LoopBridge, bridge
from streamer.sessions.futures import hold_wake, wakes_held


def test_posts_from_another_thread_run_in_order_with_fewer_wakeups_while_the_loop_is_busy():
    async def main():
        loop = asyncio.get_running_loop()
        b = LoopBridge(loop)
        seen: list[int] = []
        done = asyncio.Event()

        def producer():
            for i in range(2000):
                b.post(seen.append, i)
            b.post(done.set)

        t = threading.Thread(target=producer)
        t.start()
        time.sleep(0.05)  # the loop is busy (blocked) while the thread posts: one wake-up carries many
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        return seen, b

    seen, b = asyncio.run(main())
    assert seen == list(range(2000))
    assert b.posted == 2001
    assert 1 <= b.wakeups < 100


def engine_round(body) -> tuple[list[int], list[int], LoopBridge]:
    """Run `body(bridge, seen, during)` on another thread, as the engine runs a round, while the
    loop stays free; then let the loop run what was handed to it. `seen`: what ran on the loop;
    `during`: what the body noted of it."""
    async def main():
        b = LoopBridge(asyncio.get_running_loop())
        seen: list[int] = []
        during: list[int] = []
        t = threading.Thread(target=body, args=(b, seen, during))
        t.start()
        while t.is_alive():
            await asyncio.sleep(0.001)
        for _ in range(100):
            if len(seen) == b.posted:
                break
            await asyncio.sleep(0.01)
        return seen, during, b

    return asyncio.run(main())


def test_a_held_round_wakes_the_loop_once_at_its_end():
    def body(b, seen, during):
        with wakes_held(max_hold_s=5.0):
            for i in range(50):
                b.post(seen.append, i)
                time.sleep(0.001)  # the loop is free meanwhile, but was not woken
            during.append(len(seen))

    seen, during, b = engine_round(body)
    assert during == [0]
    assert seen == list(range(50))
    assert b.wakeups == 1


def test_a_round_held_too_long_wakes_the_loop_on_the_way():
    def body(b, seen, during):
        with wakes_held(max_hold_s=0.005):
            b.post(seen.append, 0)
            time.sleep(0.05)
            b.post(seen.append, 1)  # the block is older than max_hold_s: wakes now
            time.sleep(0.05)
            during.append(len(seen))

    seen, during, _ = engine_round(body)
    assert during == [2]
    assert seen == [0, 1]


def test_outside_a_round_nothing_is_held_and_nested_rounds_wake_at_the_outer_end():
    assert hold_wake("k", lambda: None) is False
    woken: list[str] = []
    with wakes_held(max_hold_s=5.0):
        with wakes_held(max_hold_s=5.0):
            assert hold_wake("a", lambda: woken.append("a"))
            assert hold_wake("a", lambda: woken.append("a again"))  # one per key
        assert woken == []
        assert hold_wake("b", lambda: woken.append("b"))
    assert woken == ["a", "b"]
    assert hold_wake("k", lambda: None) is False


def test_wrap_carries_results_errors_and_cancellation():
    async def main():
        b = bridge(asyncio.get_running_loop())
        assert b is bridge(asyncio.get_running_loop())
        ok, bad, gone, early = Future(), Future(), Future(), Future()
        early.set_result("already")
        waiters = [b.wrap(f) for f in (ok, bad, gone)]
        assert await b.wrap(early) == "already"
        threading.Thread(target=lambda: (ok.set_result(7), bad.set_exception(ValueError("no")),
                                         gone.cancel())).start()
        assert await waiters[0] == 7
        with pytest.raises(ValueError):
            await waiters[1]
        with pytest.raises(asyncio.CancelledError):
            await waiters[2]
        source = Future()
        given_up = b.wrap(source)
        given_up.cancel()  # the waiter gives up: so does the source (asyncio.wrap_future's rule)
        await asyncio.sleep(0)
        assert source.cancelled()

    asyncio.run(main())


def test_a_post_after_the_loop_closed_is_dropped_and_the_bridge_keeps_no_loop_alive():
    import gc
    import weakref

    loop = asyncio.new_event_loop()
    b = bridge(loop)
    b.post(print, "never")  # a wake-up is pending when the loop closes
    loop.close()
    b.post(print, "never")  # no error, and nothing stays queued
    b.post(print, "never")
    assert b.posted == 3 and not b._queue
    gone = weakref.ref(loop)
    del loop
    gc.collect()
    assert gone() is None


def test_a_flood_of_session_gets_on_a_real_server_shares_wakeups(tmp_path):
    """Twenty connections asking session.get at once: every reply comes, in order per
    connection, and /metrics shows fewer loop wake-ups than hand-overs."""
    from transformers import AutoTokenizer
    from websockets.asyncio.client import connect

    from streamer.server import ServerConfig, StreamerServer
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model, embedded_model_dir
    from streamer.sessions.runner import ModelRunner

    async def main():
        lm = build_tiny_model(AutoTokenizer.from_pretrained(embedded_model_dir()), seed=3, max_positions=256)
        engine = Engine(ModelRunner(lm.model, lm.tokenizer, lm.name), EngineLimits(max_context_tokens=256)).start()
        server = await StreamerServer(engine, ServerConfig(port=0)).start()
        try:
            url = f"ws://127.0.0.1:{server.port}"

            async def client(n: int) -> list[int]:
                async with connect(url) as ws:
                    await ws.send(json.dumps({"type": "session.create", "event_id": "c"}))
                    created = json.loads(await ws.recv())
                    sid = created["session_id"]
                    for i in range(40):
                        await ws.send(json.dumps({"type": "session.get", "session_id": sid, "event_id": f"g{i}"}))
                    got = []
                    while len(got) < 40:
                        msg = json.loads(await ws.recv())
                        if msg.get("type") == "state":
                            got.append(int(msg["reply_to"][1:]))
                    return got

            results = await asyncio.gather(*(client(n) for n in range(20)))
            assert all(r == list(range(40)) for r in results)
            with await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.port}/metrics") as r:
                text = r.read().decode()
            return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                    if line.startswith("streamer_loop_")}
        finally:
            await server.stop()
            engine.stop()

    metrics = asyncio.run(main())
    assert metrics["streamer_loop_handovers_total"] >= 20 * 41
    assert metrics["streamer_loop_wakeups_total"] < metrics["streamer_loop_handovers_total"]
