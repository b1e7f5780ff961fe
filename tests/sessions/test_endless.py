"""Endless sessions: a live feed that never fills a session, and flash answers that never go
stale in silence (fair idle time, `flash.stale`, staleness numbers)."""

import os
import random

import pytest
from helpers import Sync, driven, result

from streamer.sessions.flash import next_stale_s
from streamer.sessions.models import build_tiny_model
from streamer.sessions.runner import ModelRunner

STATIONS = ["north", "harbour", "airport", "hill", "valley"]


def weather_rows(n: int, seed: int = 3):
    """A CSV feed of weather readings (time, station, temperature, wind), like a live sensor."""
    rnd = random.Random(seed)
    for i in range(n):
        yield (f"{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d},{STATIONS[i % 5]},"
               f"{rnd.uniform(-5, 30):.1f},{rnd.randint(0, 60)}\n")


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def feed(engine, sid, rows, batch: int):
    """Append rows in batches queued faster than they are read; returns every ack."""
    acks, pending = [], []
    for row in rows:
        pending.append(engine.append(sid, row))
        if len(pending) == batch:
            engine.run_until_idle()
            acks.extend(f.result(0) for f in pending)
            pending = []
            yield acks
    engine.run_until_idle()
    acks.extend(f.result(0) for f in pending)
    yield acks


def run_feed(runner, rows: int, batch: int, **limits):
    engine = driven(runner, **limits)
    sync = Sync(engine)
    sid = sync.create_session(flash=[{"question": "Which station is the warmest?", "max_tokens": 6},
                                     {"question": "Is it windy?", "max_tokens": 4}])["session_id"]
    samples = []
    acks = []
    for acks in feed(engine, sid, weather_rows(rows), batch):
        samples.append((engine.pool.used_bytes(), rss_mb()))
    return engine, sid, acks, samples


def check_endless(engine, sid, acks, samples, rows):
    state = engine.core.session_state(sid)
    assert len(acks) == rows and [a.seq for a in acks] == list(range(1, rows + 1))  # every row acked, in order
    assert state["window"]["default"] and state["window"]["slides"] > 0
    assert max(a.total_tokens for a in acks) <= state["window"]["max_tokens"]
    warm = len(samples) // 5
    pool = [p for p, _ in samples[warm:]]
    assert max(pool) <= min(pool) + engine.pool.block_bytes * 64  # the pool is flat after warm-up
    # RSS is flat after warm-up: a leak raises the peaks of the second half above the first's,
    # while the allocator handing memory back only dips single samples (a dip at the first
    # sample after warm-up once read as 68 MB of growth)
    rss = [r for _, r in samples[warm:]]
    first, second = rss[:len(rss) // 2], rss[len(rss) // 2:]
    assert max(second) - max(first) < 48, f"RSS peaks grew from {max(first):.0f} to {max(second):.0f} MB"
    # flash answers are current at the end, and say how stale they were
    for q in state["flash"]:
        assert q["data_version"] == state["data_version"] and q["staleness"]["versions"] == 0
    session = engine.sessions[sid]
    assert session.flash.staleness.count >= 2


@pytest.mark.timeout(1800)  # minutes on a quiet machine; far more when the machine is shared
def test_a_plain_session_takes_50000_rows_with_bounded_memory(tokenizer):
    # the tiny model with the embedded model's 8K positions: the default window is 4096 tokens,
    # as on the embedded model
    lm = build_tiny_model(tokenizer, seed=11, max_positions=8192)
    runner = ModelRunner(lm.model, tokenizer, lm.name)
    engine, sid, acks, samples = run_feed(runner, 50_000, 500, step_tokens=2048)
    assert engine.core.session_state(sid)["window"]["max_tokens"] == 4096
    check_endless(engine, sid, acks, samples, 50_000)


@pytest.mark.embedded
@pytest.mark.timeout(1800)
def test_the_embedded_model_takes_1200_rows_in_a_bounded_session(embedded):
    runner = ModelRunner(embedded.model, embedded.tokenizer, embedded.name)
    engine, sid, acks, samples = run_feed(runner, 1200, 100, step_tokens=2048)
    check_endless(engine, sid, acks, samples, 1200)


def test_no_flash_answers_before_any_data(tiny):
    runner, _ = tiny
    engine = driven(runner)
    sync = Sync(engine)
    events = []
    sid = sync.create_session(flash=[{"question": "What is known?"}])["session_id"]
    sync.add_listener(sid, lambda e, p: events.append(e))
    engine.run_until_idle()
    assert events == [] and engine.stats.flash_evaluations == 0
    sync.append(sid, "12:00,north,3.5,10\n")
    assert "flash.updated" in events


def test_dual_thinking_and_flash_share_idle_time(tiny):
    """A steady feed faster than the background work (input is almost always queued): reasoning
    units and flash evaluations alternate, and a question that falls `flash_stale_versions`
    behind runs beside the queued input, so every flash question is evaluated at least once per
    K = flash_stale_versions + 4 versions (what arrives during one evaluation and one unit)."""
    runner, _ = tiny
    engine = driven(runner, step_tokens=256, flash_stale_versions=3)
    sync = Sync(engine)
    sid = sync.create_session(thinking={"mode": "dual", "unit_tokens": 12, "stop": "budget"},
                              flash=[{"question": "Warmest station?", "max_tokens": 8},
                                     {"question": "Any wind?", "max_tokens": 8}])["session_id"]
    seen = {"f1": [], "f2": []}
    sync.add_listener(sid, lambda e, p: e in ("flash.updated", "flash.evaluated") and seen[p["flash_id"]].append(
        p["data_version"]))
    units = []
    sync.add_listener(sid, lambda e, p: e == "reasoning.done" and units.append(p["unit"]))
    for row in weather_rows(60):
        engine.append(sid, row)
        for _ in range(4):  # a new row every 4 steps: a unit or an evaluation is always due
            engine.step()
    engine.run_until_idle()
    K = 3 + 4
    version = engine.sessions[sid].data_version
    for fid, versions in seen.items():
        assert versions, f"{fid} was never evaluated"
        gaps = [b - a for a, b in zip([0, *versions], [*versions, version])]
        assert max(gaps) <= K, f"{fid} evaluated at versions {versions}"
    assert len(units) >= 10  # thinking was not starved either


def answered_once(runner, step_tokens: int = 32, **limits):
    """An engine, a session with one row and a flash question answered on it; the session's
    events, and for each evaluation whether input was waiting as it finished."""
    engine = driven(runner, step_tokens=step_tokens, **limits)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "00:00:00,north,1.0,5\n")
    sync.register_flash(sid, "Warmest?", max_tokens=4)
    engine.run_until_idle()
    events, waiting = [], []
    sync.add_listener(sid, lambda e, p: events.append((e, p)))
    sync.add_listener(sid, lambda e, p: e in ("flash.updated", "flash.evaluated") and waiting.append(
        engine.core.lanes.input_waiting(sid)))
    return engine, sid, events, waiting


def test_a_question_far_behind_is_pushed_stale_then_caught_up(tiny):
    runner, _ = tiny
    engine, sid, events, waiting = answered_once(runner, flash_stale_versions=3)
    for row in list(weather_rows(40))[1:]:  # queued faster than read: input is always waiting
        engine.append(sid, row)
    for _ in range(30):
        engine.step()
    stale = [p for e, p in events if e == "flash.stale"]
    assert stale and stale[0]["reason"] == "behind" and stale[0]["versions_behind"] > 3
    assert stale[0]["answer"] is not None and stale[0]["answer_version"] == 1
    assert engine.core.session_state(sid)["flash"][0]["stale"] == "behind"
    engine.run_until_idle()
    state = engine.core.session_state(sid)["flash"][0]
    assert state["stale"] is None and state["data_version"] == engine.sessions[sid].data_version
    assert waiting[0] is True  # once stale it did not wait for the input queue to drain


def test_a_question_behind_in_time_is_pushed_stale(tiny):
    """Past `flash_stale_s` (or 4x what an evaluation of the question takes, if longer) behind
    its data, a question is pushed stale once; the engine wakes up for that limit."""
    import time

    runner, _ = tiny
    engine = driven(runner, flash_stale_s=0.2)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "a\n")
    sync.register_flash(sid, "What?", max_tokens=3)
    engine.run_until_idle()
    q = engine.sessions[sid].flash.questions["f1"]
    assert q.evaluations == 1 and q.cost_s > 0
    events = []
    sync.add_listener(sid, lambda e, p: events.append((e, p)))
    engine.append(sid, "b\n")
    engine.step()  # the input is read; the evaluation it makes due is not run (no step after it)
    assert engine.sessions[sid].data_version == 2 and q.evaluated_version == 1
    wait = next_stale_s(engine.sessions[sid], 0.2)  # what the engine's next_wakeup includes
    assert wait is not None and wait <= max(0.2, 4 * q.cost_s)
    time.sleep(wait + 0.05)
    engine.run_until_idle()
    stale = [p for e, p in events if e == "flash.stale"]
    assert len(stale) == 1 and stale[0]["reason"] == "behind" and stale[0]["seconds_behind"] >= 0.2
    assert q.evaluated_version == 2 and q.stale is None  # evaluated right after, which clears it
    engine.run_until_idle()
    assert len([e for e, _ in events if e == "flash.stale"]) == 1  # once per episode


def test_an_interval_or_a_slow_evaluation_is_not_reported_stale(tiny):
    """The time limit counts the question's own cost: a question asked to run at most every
    30 s, or whose evaluations take long, is not stale for being behind by that much."""
    import time

    runner, _ = tiny
    engine = driven(runner, flash_stale_s=0.2)
    sync = Sync(engine)
    sid = sync.create_session()["session_id"]
    sync.append(sid, "a\n")
    sync.register_flash(sid, "What?", max_tokens=3, min_interval_s=30)  # cannot re-run for 30 s
    events = []
    sync.add_listener(sid, lambda e, p: events.append((e, p)))
    sync.append(sid, "b\n")
    time.sleep(0.3)
    engine.run_until_idle()
    assert not [p for e, p in events if e == "flash.stale"]
    assert engine.core.next_wakeup() > 25  # the next thing due: the interval, ~30 s away


def test_an_overdue_question_runs_beside_a_feed_that_never_pauses(tiny):
    """With no version limit (the default), a feed whose every step starts with input queued
    (a row queued before each step, 20 steps a second) still gets its question evaluated,
    beside the input, once it is overdue in time (0.25 s, or its cost); its answers keep up, so
    none is pushed stale, however many versions pass between evaluations."""
    import time

    runner, _ = tiny
    engine, sid, events, waiting = answered_once(runner, step_tokens=256)
    evaluations = len([e for e, _ in events if e in ("flash.updated", "flash.evaluated")])
    rows = list(weather_rows(400))[1:]
    until = time.monotonic() + 3.0
    while time.monotonic() < until:
        engine.append(sid, rows.pop(0))  # queued before every step: input is waiting as each step starts
        engine.step()
        time.sleep(0.05)
    evaluated = len([e for e, _ in events if e in ("flash.updated", "flash.evaluated")]) - evaluations
    assert evaluated >= 2, "the question waited for a pause in the feed that never came"
    assert not [p for e, p in events if e == "flash.stale"]  # overdue is not stale: nothing pushed


def test_an_evaluation_that_cannot_run_says_why(tiny):
    """An unbounded session (`window: null`) cannot make room: a flash question that does not fit
    beside its data is marked no_room at once. A windowed one (here as large as the model's
    window) evicts old input first, as for a question asked, and answers."""
    from streamer.sessions.errors import ContextOverflow

    runner, _ = tiny
    ctx = 300
    engine = driven(runner, max_context_tokens=ctx, step_tokens=256)
    sync = Sync(engine)
    question = "Summarise every station and reading seen so far in detail, please?"
    sid = sync.create_session(window=None)["session_id"]
    events = []
    sync.add_listener(sid, lambda e, p: events.append((e, p)))
    for row in weather_rows(40):
        try:
            sync.append(sid, row)
        except ContextOverflow:
            break
    sync.register_flash(sid, question, max_tokens=4)
    engine.run_until_idle()
    no_room = [p for e, p in events if e == "flash.stale" and p["reason"] == "no_room"]
    assert no_room and "does not fit" in no_room[0]["message"]  # (after `behind`: it came late)

    sid = sync.create_session(window={"max_tokens": ctx, "keep_tokens": ctx})["session_id"]
    events.clear()
    sync.add_listener(sid, lambda e, p: events.append((e, p)))
    sync.register_flash(sid, question, max_tokens=4)
    for row in weather_rows(40):
        sync.append(sid, row)
    assert not [p for e, p in events if e == "flash.stale"]
    (q,) = engine.sessions[sid].flash.questions.values()
    assert q.answer is not None and q.answer.data_version == engine.sessions[sid].data_version
    answer = result(engine, engine.query(sid, question))
    assert answer.tokens


def test_staleness_is_measured_per_session(tiny):
    from streamer.metrics import render

    runner, _ = tiny
    engine = driven(runner)
    sync = Sync(engine)
    sid = sync.create_session(flash=[{"question": "Warmest?", "max_tokens": 3}])["session_id"]
    updates = []
    sync.add_listener(sid, lambda e, p: e == "flash.updated" and updates.append(p))
    for row in weather_rows(5):
        sync.append(sid, row)
    assert updates and all(u["staleness_ms"] > 0 and u["staleness_ms"] >= u["eval_ms"] - 0.1 for u in updates)
    metrics = engine.metrics()
    buckets, count, total = metrics["flash_staleness"][sid]
    assert count == engine.sessions[sid].flash.staleness.count >= 5 and buckets[-1] == ("+Inf", count)
    text = render(metrics, 0)
    assert f'streamer_flash_staleness_seconds_hist_count{{session="{sid}"}} {count}' in text
    assert f'streamer_flash_staleness_seconds_hist_bucket{{session="{sid}",le="+Inf"}} {count}' in text
