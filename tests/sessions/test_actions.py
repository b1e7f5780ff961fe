"""Action chunks: stitching, roll-forward, asynchronous scheduling, rules."""

import math

import numpy as np
import pytest

from streamer.sessions.actions import AsyncController, ChunkQueue, FlashRule, TrackerPolicy
from streamer.sessions.errors import InvalidRequest


def test_new_chunk_keeps_the_executing_prefix_and_blends_at_the_seam():
    q = ChunkQueue(dt=0.1, blend=3)
    old = np.array([[float(i), 0.0] for i in range(10)])
    q.integrate(old, 1.0)
    frozen_before = [a.copy() for a in q.actions[:4]]
    new = np.full((10, 2), 100.0)
    kept = q.integrate(new, 1.35)  # between slots: the seam moves to the next slot, 1.4
    assert kept == 4
    assert all(np.array_equal(a, b) for a, b in zip(q.actions[:4], frozen_before))  # never changed
    seam = [q.actions[i][0] for i in range(4, 8)]
    assert seam[0] > old[4][0] and seam[-1] == 100.0
    assert all(b > a for a, b in zip(seam, seam[1:]))  # the blend ramps monotonically old -> new
    assert max(abs(b - a) for a, b in zip(seam, seam[1:])) < 100.0 - old[4][0]  # no jump of the full gap
    assert q.time_of(4) == pytest.approx(1.4)


def test_chunk_after_the_queue_ran_out_starts_fresh():
    q = ChunkQueue(dt=0.1)
    q.integrate(np.ones((3, 2)), 0.0)
    assert q.integrate(np.zeros((4, 2)), 5.0) == 0 and q.t0 == 5.0 and len(q.actions) == 4
    assert q.action_at(5.05).tolist() == [0.0, 0.0] and q.action_at(4.0) is None


def test_roll_forward_conditions_on_the_state_at_the_seam():
    policy = TrackerPolicy(horizon=5, dt=0.1, sleep=False)
    c = AsyncController(policy, dt=0.1, mode="async_rollforward", expected_latency_s=0.3)
    c.queue.integrate(np.array([[1.0, 0.0]] * 10), 0.0)
    request = c.begin(now=0.0, observation={"target": [5.0, 0.0]}, obs_ts=0.0, state=np.zeros(2))
    assert request.start == pytest.approx(0.3)
    # three queued actions of 1.0 * 0.1 run before the seam
    np.testing.assert_allclose(request.state, [0.3, 0.0])
    plain = AsyncController(policy, dt=0.1, mode="async", expected_latency_s=0.3)
    plain.queue.integrate(np.array([[1.0, 0.0]] * 10), 0.0)
    np.testing.assert_allclose(plain.begin(0.0, {}, 0.0, np.zeros(2)).state, [0.0, 0.0])


def test_late_inference_freezes_what_ran_meanwhile():
    policy = TrackerPolicy(horizon=6, dt=0.1, sleep=False)
    c = AsyncController(policy, dt=0.1, mode="async", expected_latency_s=0.2)
    first = c.finish(c.begin(0.0, {"target": [1, 0]}, 0.0, np.zeros(2)), np.ones((6, 2)), 0.0, "s")
    assert (first.seq, first.t0, first.frozen) == (1, 0.0, 0)
    request = c.begin(0.2, {"target": [1, 0]}, 0.2, np.zeros(2))
    assert c.should_infer(0.35, busy=False)
    chunk = c.finish(request, np.full((6, 2), 2.0), now=0.5, session_id="s")  # planned 0.4, ready at 0.5
    assert chunk.seq == 2 and chunk.t0 == pytest.approx(0.5) and chunk.frozen >= 1
    assert all(a == [1.0, 1.0] for a in [x.tolist() for x in c.queue.actions[:chunk.frozen]])


def test_sync_mode_waits_for_an_empty_queue():
    c = AsyncController(TrackerPolicy(sleep=False), dt=0.1, mode="sync")
    c.queue.integrate(np.ones((5, 2)), 0.0)
    assert not c.should_infer(0.2, busy=False) and c.should_infer(0.5, busy=False)
    assert not c.should_infer(0.5, busy=True)


def test_tracker_policy_moves_toward_the_target_within_its_speed():
    policy = TrackerPolicy(horizon=8, dt=0.1, max_speed=1.0, sleep=False)
    chunk = policy.infer({"target": [3.0, 4.0]}, np.zeros(2))
    assert chunk.shape == (8, 2)
    assert all(np.linalg.norm(a) <= 1.0 + 1e-9 for a in chunk)
    np.testing.assert_allclose(chunk[0] / np.linalg.norm(chunk[0]), [0.6, 0.8])


def test_rule_fires_once_per_change_with_debounce():
    rule = FlashRule("r", "f", r"^yes", {"cmd": "stop"}, debounce_s=1.0)
    assert rule.observe("yes, a person", 0.0)  # change to matching: fires
    assert not rule.observe("yes, still", 0.5)  # still matching: no new change
    assert not rule.observe("no", 0.6)
    assert not rule.observe("yes", 0.8)  # flicker inside the debounce window: swallowed
    assert not rule.observe("no", 1.5)
    assert rule.observe("yes", 2.0) and rule.fired == 2
    with pytest.raises(InvalidRequest, match="not a valid regular expression"):
        FlashRule("r", "f", "(", {})


def test_bad_settings():
    with pytest.raises(InvalidRequest, match="mode must be one of"):
        AsyncController(TrackerPolicy(sleep=False), dt=0.1, mode="eventually")
    with pytest.raises(InvalidRequest, match="bad tracker settings"):
        TrackerPolicy(horizon=0)
    assert math.isclose(ChunkQueue(0.1).seam(3.0), 3.0)
