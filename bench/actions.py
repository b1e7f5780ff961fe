"""Reaction latency and tracking error: synchronous versus asynchronous chunked inference.

A simulated target-tracking task, run in simulated time with the service's own scheduling
code (`AsyncController`, `ChunkQueue`): a planar point mass follows a target that jumps to a
new place every --jump-every seconds; a camera sees the target every control step; the
policy (`TrackerPolicy`) returns chunks of --horizon velocity commands and takes 100-300 ms
per inference (drawn per call). Compared:
  - sync: infer when the chunk ran out, the robot waits meanwhile;
  - async: infer while the robot executes, conditioned on the current state;
  - async + roll-forward: conditioned on the state predicted for when the chunk takes over.
Reaction latency: from a target jump to the first executed action computed from an
observation taken after the jump. Tracking error: mean distance to the target.

Run: python bench/actions.py [--seconds 120] [--horizon 50] [--dt 0.05]
The last line is `RESULT reaction_sync_vs_async=<x> tracking_error_async_vs_sync=<x>`.
"""

from __future__ import annotations

import argparse
import random
import statistics

import numpy as np

from streamer.sessions.actions import AsyncController, TrackerPolicy


def simulate(mode: str, seconds: float, dt: float, horizon: int, jump_every: float, seed: int) -> dict:
    rng = random.Random(seed)
    policy = TrackerPolicy(horizon=horizon, dt=dt, latency_s=(0.1, 0.3), seed=seed, sleep=False)
    controller = AsyncController(policy, dt, mode, expected_latency_s=0.2)
    position = np.zeros(2)
    target = np.zeros(2)
    jumps: list[float] = []
    origins: list[tuple[float, float]] = []  # (takeover time, obs time) of each integrated chunk
    reactions: list[float] = []
    errors: list[float] = []
    inflight = None  # (ready_at, request, chunk)
    steps = int(seconds / dt)
    for k in range(steps):
        now = k * dt
        if now >= (len(jumps) + 1) * jump_every:
            target = np.array([rng.uniform(-2, 2), rng.uniform(-2, 2)])
            jumps.append(now)
        if inflight is not None and now >= inflight[0] - 1e-9:
            _, request, chunk = inflight
            result = controller.finish(request, chunk, now)
            origins.append((result.t0, request.obs_ts))
            inflight = None
        if inflight is None and controller.should_infer(now, busy=False):
            request = controller.begin(now, {"target": target.tolist()}, now, position)
            chunk = policy.infer(request.observation, request.state)
            inflight = (now + policy.last_latency, request, chunk)
        action = controller.queue.action_at(now)
        if action is not None:
            position = position + action * dt
            obs = max((o for t0, o in origins if t0 <= now + 1e-9), default=-1.0)
            while len(reactions) < len(jumps) and obs >= jumps[len(reactions)] - 1e-9:
                reactions.append(now - jumps[len(reactions)])
        errors.append(float(np.linalg.norm(target - position)))
    return {"reaction": statistics.mean(reactions), "reaction_p90": sorted(reactions)[int(0.9 * (len(reactions) - 1))],
            "error": statistics.mean(errors), "jumps": len(jumps), "chunks": controller.seq}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--dt", type=float, default=0.05, help="control period (s)")
    parser.add_argument("--horizon", type=int, default=50, help="actions per chunk")
    parser.add_argument("--jump-every", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    rows = {}
    for mode in ("sync", "async", "async_rollforward"):
        runs = [simulate(mode, args.seconds, args.dt, args.horizon, args.jump_every, seed) for seed in range(args.seeds)]
        rows[mode] = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
    print(f"simulated {args.seconds:.0f} s x {args.seeds} seeds; control every {args.dt * 1000:.0f} ms; chunks of "
          f"{args.horizon} actions; policy inference 100-300 ms; target jumps every {args.jump_every:.0f} s")
    print("\n| inference | reaction latency mean (s) | p90 (s) | tracking error (mean distance) | chunks |")
    print("|---|---:|---:|---:|---:|")
    names = {"sync": "synchronous", "async": "asynchronous", "async_rollforward": "asynchronous + roll-forward"}
    for mode, r in rows.items():
        print(f"| {names[mode]} | {r['reaction']:.3f} | {r['reaction_p90']:.3f} | {r['error']:.3f} | {r['chunks']:.0f} |")
    best = rows["async_rollforward"]
    reaction = rows["sync"]["reaction"] / best["reaction"]
    error = best["error"] / rows["sync"]["error"]
    print(f"\nasync + roll-forward vs sync: reaction {reaction:.1f}x faster (target >= 5), tracking error "
          f"{error:.2f}x (target <= 1)")
    print(f"RESULT reaction_sync_vs_async={reaction:.2f} tracking_error_async_vs_sync={error:.2f}")


if __name__ == "__main__":
    main()
