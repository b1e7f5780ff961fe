"""Fair share over a real websocket: one client (its own API key) runs 96 long flash questions
and long questions of its own on six sessions fed all the time; another client's questions keep
the bound the scheduler states (docs/protocol.md, *Scheduling and the fair share*).

The bound is checked in engine steps and tokens, which do not depend on how busy the machine is:
a bystander's question waits for no step beyond the one running when it arrives (one more at
most, for input aged past the question class), runs in as many steps as it does on an idle
server (one more at most), and no step it runs in carries more than max(`query_step_tokens`, its
question's tokens) tokens of anyone's work. The wall-clock ratio of its latency under load to its
idle latency is printed (bench/fairness.py --flash measures it properly)."""

import asyncio
import statistics
import time

import pytest

from streamer.auth import ApiKeys
from streamer.sessions.engine import Engine, EngineLimits
from streamer.sessions.models import build_tiny_model
from streamer.sessions.runner import ModelRunner
from wsutil import raw, serve

LOADER, BYSTANDER = "k-loader-0123456789", "k-bystander-0123456789"
QUERY_STEP = 64
LONG = " ".join(f"Row {i} of the ledger lists cargo, weather and the crew on watch." for i in range(56))


@pytest.fixture()
def engine(tokenizer):
    lm = build_tiny_model(tokenizer, seed=11, max_positions=4096)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name),
                    EngineLimits(max_context_tokens=4096, query_step_tokens=QUERY_STEP, step_tokens=512)).start()
    yield engine
    engine.stop()


async def ask(peer, sid, question):
    done = await peer.request({"type": "query.create", "session_id": sid, "question": question,
                               "max_tokens": 8, "stream": False})
    assert done["type"] == "query.done", done
    return done


def test_a_bystanders_questions_keep_their_bound_beside_96_long_flash_questions(engine, tokenizer):
    question = "What did the keeper log last?"

    async def test(url, server):
        bystander = await raw(url, BYSTANDER)
        mine = await bystander.create()
        await bystander.request({"type": "input.text.append", "session_id": mine,
                                 "text": "The keeper logged a storm at dawn and a calm sea by noon."})
        idle = [await ask(bystander, mine, question) for _ in range(5)]

        loader = await raw(url, LOADER)
        sids = [await loader.create() for _ in range(6)]
        for sid in sids:
            await loader.request({"type": "input.text.append", "session_id": sid, "text": "Row 0: calm."})
            for i in range(16):  # 96 flash questions of ~960 tokens
                reg = await loader.request({"type": "flash.register", "session_id": sid, "max_tokens": 4,
                                            "question": f"Question {i}: {LONG} What changed?"})
                assert reg["type"] == "flash.registered", reg
        stop = asyncio.Event()
        pushed = {"flash.updated": 0, "query.done": 0}

        async def feed() -> None:  # rows into every session, and long questions of its own
            row = 0
            while not stop.is_set():
                row += 1
                for sid in sids:
                    await loader.send({"type": "input.text.append", "session_id": sid, "text": f" Row {row}: wind."})
                    await loader.send({"type": "query.create", "session_id": sid, "max_tokens": 16,
                                       "question": f"{LONG[:1200]} Summarize row {row}."})
                await asyncio.sleep(0.2)

        async def drain() -> None:
            while not stop.is_set():
                try:
                    event = await loader.recv(timeout=0.5)
                except asyncio.TimeoutError:
                    continue
                assert event["type"] != "error" or event["error"]["code"] in ("rate_limited",), event
                if event["type"] in pushed:
                    pushed[event["type"]] += 1

        tasks = [asyncio.create_task(feed()), asyncio.create_task(drain())]
        try:
            started = time.monotonic()
            while pushed["flash.updated"] < 1:  # the flash load is running
                await asyncio.sleep(0.1)
            print(f"first flash answer after {time.monotonic() - started:.1f} s")
            loaded = [await ask(bystander, mine, question) for _ in range(8)]
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        await loader.ws.close()
        await bystander.ws.close()
        return idle, loaded, dict(pushed)

    idle, loaded, pushed = serve(engine, test, api_keys=ApiKeys({"loader": LOADER, "bystander": BYSTANDER}))
    assert all(q["text"] == idle[0]["text"] for q in idle + loaded)  # the same data: the same answer
    own = idle[0]["question_tokens"]
    idle_steps = max(q["timing"]["steps"] for q in idle)
    for q in loaded:
        t = q["timing"]
        assert t["steps_waited"] <= 1, t
        assert t["steps"] <= idle_steps + 1, (t, idle_steps)
        assert t["max_step_tokens"] <= max(QUERY_STEP, own), (t, own)
    # the load really shared its steps: other work rode along in them, flash answers kept coming
    assert max(q["timing"]["max_step_tokens"] for q in loaded) > max(q["timing"]["max_step_tokens"] for q in idle)
    assert pushed["flash.updated"] >= 1 and pushed["query.done"] > 0
    p50_idle = statistics.median(q["timing"]["total_ms"] for q in idle)
    p99_loaded = max(q["timing"]["total_ms"] for q in loaded)
    print(f"bystander total_ms: idle p50 {p50_idle:.1f}, loaded max {p99_loaded:.1f} "
          f"({p99_loaded / max(p50_idle, 1e-3):.2f}x); loader pushes {pushed}")
