"""Actions for robot and VLA controllers.

Two sources:
- event-driven rules: a flash answer that changes to match a pattern emits a command once
  (per change, debounced);
- continuous policies with asynchronous inference: chunk n+1 is computed while chunk n
  executes. The policy is conditioned on the state the robot will be in when the new chunk
  starts (the current state rolled forward through the actions still queued to run before
  then), the actions that execute while inference runs stay frozen, and only the tail is
  replaced, blended at the seam.

The scheduling logic (`ChunkQueue`, `AsyncController`) takes the clock as an argument, so the
same code runs in the service (wall clock, `ActionLoop` thread) and in simulation (bench).
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from .errors import Code, EngineError, InvalidRequest, SessionNotFound
from .session import Session, json_object, normalize

if TYPE_CHECKING:
    from .engine import EngineCore

log = logging.getLogger(__name__)


# ---- envelope ------------------------------------------------------------------------------


@dataclass(slots=True)
class ActionChunk:
    session_id: str
    seq: int
    t0: float  # wall clock (or sim clock) of the first action
    dt: float  # seconds between actions
    obs_ts: float  # timestamp of the observation it was computed from
    actions: list[list[float]]
    frozen: int = 0  # leading actions kept from the previous chunk (they ran during inference)
    inference_s: float = 0.0

    def public(self) -> dict:
        return {"seq": self.seq, "t0": self.t0, "dt": self.dt, "obs_ts": self.obs_ts, "actions": self.actions,
                "frozen": self.frozen, "inference_ms": round(self.inference_s * 1000, 2)}


# ---- policies ------------------------------------------------------------------------------


class ActionPolicy(Protocol):
    """Observation features + robot state -> a chunk of `horizon` actions."""

    horizon: int
    state_dim: int
    action_dim: int

    def infer(self, observation: dict, state: np.ndarray) -> np.ndarray: ...

    def step(self, state: np.ndarray, action: np.ndarray, dt: float) -> np.ndarray:
        """The robot's dynamics, used to roll a state forward through queued actions."""
        ...


class TrackerPolicy:
    """Example policy for a planar point mass (state = position [x, y]): velocity commands that
    steer toward the observed target, with a speed limit. `latency_s` makes it as slow as a
    large VLA model (the thread sleeps; the bench uses the drawn value as simulated time)."""

    state_dim = 2
    action_dim = 2

    def __init__(self, horizon: int = 10, gain: float = 3.0, max_speed: float = 1.0, dt: float = 0.05,
                 latency_s: tuple[float, float] = (0.0, 0.0), seed: int = 0, sleep: bool = True) -> None:
        if horizon < 1 or max_speed <= 0 or dt <= 0:
            raise InvalidRequest(f"bad tracker settings: horizon {horizon}, max_speed {max_speed}, dt {dt}")
        self.horizon, self.gain, self.max_speed, self.dt = horizon, gain, max_speed, dt
        self.latency_s = latency_s
        self.rng = random.Random(seed)
        self.sleep = sleep
        self.last_latency = 0.0

    def infer(self, observation: dict, state: np.ndarray) -> np.ndarray:
        self.last_latency = self.rng.uniform(*self.latency_s)
        if self.sleep and self.last_latency:
            time.sleep(self.last_latency)
        target = np.asarray(observation.get("target", state), dtype=float)
        pos = np.array(state, dtype=float)
        out = np.zeros((self.horizon, 2))
        for k in range(self.horizon):
            v = self.gain * (target - pos)
            speed = float(np.linalg.norm(v))
            if speed > self.max_speed:
                v *= self.max_speed / speed
            out[k] = v
            pos = self.step(pos, v, self.dt)
        return out

    def step(self, state: np.ndarray, action: np.ndarray, dt: float) -> np.ndarray:
        return np.asarray(state, dtype=float) + np.asarray(action, dtype=float) * dt


POLICIES: dict[str, Callable[..., ActionPolicy]] = {"tracker": TrackerPolicy}


# ---- the action queue and asynchronous inference -------------------------------------------


class ChunkQueue:
    """Actions scheduled at absolute times `t0 + i * dt`. New chunks replace the tail only."""

    def __init__(self, dt: float, blend: int = 3) -> None:
        self.dt = dt
        self.blend = blend
        self.t0 = 0.0  # time of actions[0]
        self.actions: list[np.ndarray] = []

    def time_of(self, index: int) -> float:
        return self.t0 + index * self.dt

    def pending(self, now: float) -> list[tuple[float, np.ndarray]]:
        """Actions that have not started by `now` (an action runs over [t, t + dt))."""
        return [(self.time_of(i), a) for i, a in enumerate(self.actions) if self.time_of(i) >= now - 1e-9]

    def action_at(self, now: float) -> np.ndarray | None:
        """The action running at `now`, if any."""
        if not self.actions:
            return None
        i = math.floor((now - self.t0) / self.dt + 1e-9)
        return self.actions[i] if 0 <= i < len(self.actions) else None

    def seam(self, start: float) -> float:
        """The first action slot at or after `start` on this queue's grid (or `start` when
        the queue has run out)."""
        if not self.actions or start >= self.time_of(len(self.actions)):
            return start
        k = max(0, math.ceil((start - self.t0) / self.dt - 1e-9))
        return self.time_of(k)

    def integrate(self, chunk: np.ndarray, start: float) -> int:
        """Put `chunk` in from time `start` (on the grid): actions before it stay exactly as
        they were (they run while inference ran: frozen); queued actions from `start` on are
        replaced, the first `blend` of them blended from old to new. Returns how many old
        actions were kept."""
        start = self.seam(start)
        if self.actions and start < self.time_of(len(self.actions)):
            keep = round((start - self.t0) / self.dt)
            old_tail = self.actions[keep:]
            new = [np.array(a, dtype=float) for a in chunk]
            for j in range(min(self.blend, len(old_tail), len(new))):
                w = (j + 1) / (self.blend + 1)  # weight of the new chunk ramps up
                new[j] = (1 - w) * old_tail[j] + w * new[j]
            self.actions = self.actions[:keep] + new
            return keep
        self.t0, self.actions = start, [np.array(a, dtype=float) for a in chunk]
        return 0

    def drop_before(self, now: float) -> None:
        """Forget actions that finished before `now` (keeps the queue short)."""
        done = max(0, math.floor((now - self.t0) / self.dt + 1e-9) - 1)
        if done:
            self.actions = self.actions[done:]
            self.t0 += done * self.dt


@dataclass(slots=True)
class InferenceRequest:
    started: float
    start: float  # when the new chunk is planned to take over
    state: np.ndarray  # the state it is conditioned on
    observation: dict
    obs_ts: float


class AsyncController:
    """When to infer, on what state, and how the result enters the queue.

    mode "sync": infer only when the queue ran out; the robot waits (the baseline).
    mode "async": infer while the queue runs, as soon as fewer than `threshold` x horizon
    actions are queued (1.0: whenever no inference is running); condition on the current state.
    mode "async_rollforward": as async, conditioned on the state predicted for the moment the
    new chunk takes over (VLASH-style roll-forward through the queued actions).

    The takeover is planned `expected` seconds ahead (a running mean of observed inference
    times) and happens when the chunk arrives; a chunk that arrives late skips the actions
    planned for the time that has passed.
    """

    MODES = ("sync", "async", "async_rollforward")

    def __init__(self, policy: ActionPolicy, dt: float, mode: str = "async_rollforward",
                 expected_latency_s: float = 0.2, blend: int = 3, threshold: float = 1.0) -> None:
        if mode not in self.MODES:
            raise InvalidRequest(f"action mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        if not 0.0 < threshold <= 1.0:
            raise InvalidRequest(f"threshold must be in (0, 1], got {threshold}")
        self.policy, self.dt, self.mode = policy, dt, mode
        self.queue = ChunkQueue(dt, blend)
        self.expected = expected_latency_s
        self.threshold = threshold
        self.seq = 0

    def should_infer(self, now: float, busy: bool) -> bool:
        if busy:
            return False
        queued = len(self.queue.pending(now))
        if self.mode == "sync":
            return queued == 0
        return queued < self.threshold * self.policy.horizon or queued == 0

    def begin(self, now: float, observation: dict, obs_ts: float, state: np.ndarray) -> InferenceRequest:
        start = self.queue.seam(now + (0.0 if self.mode == "sync" else self.expected))
        conditioned = np.array(state, dtype=float)
        if self.mode == "async_rollforward":
            for t, action in self.queue.pending(now):
                if t >= start:
                    break
                conditioned = self.policy.step(conditioned, action, self.dt)
            running = self.queue.action_at(now)
            if running is not None:  # an action already under way: the part of it still to come
                elapsed = now - self.queue.t0 - math.floor((now - self.queue.t0) / self.dt + 1e-9) * self.dt
                if elapsed > 1e-9:
                    conditioned = self.policy.step(conditioned, running, self.dt - elapsed)
        return InferenceRequest(now, start, conditioned, observation, obs_ts)

    def finish(self, request: InferenceRequest, chunk: np.ndarray, now: float, session_id: str = "") -> ActionChunk:
        """Integrate a finished inference. The chunk takes over at the planned start, or at
        the first slot after `now` if inference ran late (what ran meanwhile stays frozen)."""
        self.expected = 0.8 * self.expected + 0.2 * (now - request.started)
        # take over at arrival: waiting for the planned moment would only add latency
        start = self.queue.seam(now) if self.queue.actions else now
        late = max(0, round((start - request.start) / self.dt)) if self.mode != "sync" else 0
        chunk = np.asarray(chunk)[late:]  # actions planned for time that has passed
        self.queue.drop_before(now)
        frozen = self.queue.integrate(chunk, start) if len(chunk) else len(self.queue.actions)
        self.seq += 1
        t0 = self.queue.time_of(frozen)
        actions = [a.tolist() for a in self.queue.actions[frozen:]]
        return ActionChunk(session_id, self.seq, t0, self.dt, request.obs_ts, actions, frozen, now - request.started)


class ActionLoop:
    """Runs a policy for one session in its own thread (a policy may be slow, like a VLA
    model): watches the queue, infers on the latest observation and robot state, publishes
    each chunk. Never runs on the engine thread, so the session keeps reading meanwhile."""

    def __init__(self, session_id: str, controller: AsyncController, publish: Callable[[ActionChunk], None],
                 tick_s: float | None = None) -> None:
        self.session_id = session_id
        self.controller = controller
        self.publish = publish
        self.tick = tick_s or controller.dt / 2
        self.observation: dict = {}
        self.obs_ts = 0.0
        self.state = np.zeros(controller.policy.state_dim)
        self.state_ts = 0.0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"actions-{session_id}", daemon=True)
        self.errors = 0

    def start(self) -> "ActionLoop":
        self._thread.start()
        return self

    def stop(self, wait: bool = True) -> None:
        self._stop.set()  # the thread ends after its current inference; it publishes nothing more
        if wait and self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)

    def observe(self, observation: dict, ts: float) -> None:
        with self._lock:
            self.observation, self.obs_ts = observation, ts

    def robot_state(self, state: list[float], ts: float) -> None:
        dim = self.controller.policy.state_dim
        if len(state) != dim or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in state):
            raise InvalidRequest(f"robot state must be {dim} finite numbers, got {state!r}"[:200],
                                 code=Code.INVALID_ROBOT_STATE)
        with self._lock:
            self.state, self.state_ts = np.array(state, dtype=float), ts

    def _run(self) -> None:
        c = self.controller
        while not self._stop.is_set():
            now = time.time()
            if self.observation and c.should_infer(now, False):
                with self._lock:
                    obs, obs_ts, state = dict(self.observation), self.obs_ts, self.state.copy()
                request = c.begin(now, obs, obs_ts, state)
                try:
                    chunk = c.policy.infer(obs, request.state)
                    if self._stop.is_set():
                        break
                    self.publish(c.finish(request, np.asarray(chunk), time.time(), self.session_id))
                except Exception:
                    self.errors += 1
                    log.exception("policy failed on session %s", self.session_id)
            self._stop.wait(self.tick)


# ---- rules -----------------------------------------------------------------------------------


@dataclass(slots=True)
class FlashRule:
    """When the answer to flash question `flash_id` changes to match `pattern` (a regular
    expression, case-insensitive), emit `command` once. A change to matching within
    `debounce_s` of the last firing is swallowed (flicker does not fire twice)."""

    rule_id: str
    flash_id: str
    pattern: str
    command: dict
    debounce_s: float = 0.0
    matched: bool = False
    last_fired: float = -math.inf
    fired: int = 0
    regex: re.Pattern = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            self.regex = re.compile(self.pattern, re.IGNORECASE)
        except re.error as exc:
            raise InvalidRequest(f"rule pattern {self.pattern!r} is not a valid regular expression: {exc}") from None
        if self.debounce_s < 0:
            raise InvalidRequest(f"debounce must be >= 0, got {self.debounce_s}")

    def observe(self, answer: str, now: float) -> bool:
        """True when this answer fires the command."""
        matched = bool(self.regex.search(answer))
        fire = matched and not self.matched and now - self.last_fired >= self.debounce_s
        self.matched = matched  # a change inside the debounce window is swallowed, not deferred
        if fire:
            self.last_fired = now
            self.fired += 1
        return fire


def fire_rules(session, flash_id: str, answer) -> None:
    """A flash answer changed: each rule on that question that now matches emits its command
    (on a video session stamped with the media time of the newest frame the answer saw)."""
    now = time.monotonic()
    for rule in list(session.actions.rules.values()):
        if rule.flash_id == flash_id and rule.observe(normalize(answer.text), now):
            payload = {"rule_id": rule.rule_id, "flash_id": flash_id, "command": rule.command,
                       "answer": answer.text, "data_version": answer.data_version, "fired": rule.fired}
            if answer.media_s is not None:
                payload["media_s"] = round(answer.media_s, 3)
            session.notify("action.command", payload)


# ---- commands (run on the engine thread; `core` is the EngineCore) -----------------------------


def add_rule(core: EngineCore, session_id: str, flash_id: str, pattern: str, command: dict, debounce_s: float = 0.0,
             rule_id: str | None = None) -> dict:
    """When flash question `flash_id`'s answer changes to match `pattern`, the session's
    listeners get an `action.command` event with `command`, once per change."""
    session = core.live(session_id)
    if flash_id not in session.flash.questions:
        raise EngineError(f"no flash question {flash_id!r} on session {session_id}", code=Code.FLASH_NOT_FOUND)
    session.actions.next_rule_id += 1
    rid = rule_id or f"r{session.actions.next_rule_id}"
    if rid in session.actions.rules:
        raise InvalidRequest(f"rule id {rid!r} is already in use")
    if len(session.actions.rules) >= core.limits.max_flash_per_session:
        raise EngineError(f"session {session_id} already has {len(session.actions.rules)} rules (the limit)",
                          code=Code.RULE_LIMIT)
    rule = FlashRule(rid, flash_id, pattern, command, debounce_s)
    answer = session.flash.questions[flash_id].answer
    if answer is not None:  # a rule starts from the present answer: only changes fire
        rule.matched = bool(rule.regex.search(normalize(answer.text)))
    session.actions.rules[rid] = rule
    return {"rule_id": rid, "flash_id": flash_id, "pattern": pattern, "matched": rule.matched}


def remove_rule(core: EngineCore, session_id: str, rule_id: str) -> dict:
    session = core.live(session_id)
    if session.actions.rules.pop(rule_id, None) is None:
        raise EngineError(f"no rule {rule_id!r} on session {session_id}", code=Code.RULE_NOT_FOUND)
    return {"rule_id": rule_id}


def start_actions(core: EngineCore, session_id: str, policy: str = "tracker", mode: str = "async_rollforward",
                  dt: float = 0.05, **options) -> dict:
    """Run an action policy for the session in its own thread; chunks go to the session's
    listeners as `action.chunk`. JSON inputs are its observations; robot state comes through
    `robot_state`."""
    session = core.live(session_id)
    if session.actions.loop is not None:
        raise InvalidRequest(f"session {session_id} already runs an action policy")
    factory = POLICIES.get(policy)
    if factory is None:
        raise InvalidRequest(f"unknown policy {policy!r}; known: {', '.join(sorted(POLICIES))}")
    if not 0.001 <= dt <= 10:
        raise InvalidRequest(f"dt must be in [0.001, 10] seconds, got {dt}")
    try:
        instance = factory(dt=dt, **options)
    except TypeError as exc:
        raise InvalidRequest(f"bad options for policy {policy!r}: {exc}") from None
    latency = getattr(instance, "latency_s", (0.0, 0.0))
    controller = AsyncController(instance, dt, mode, expected_latency_s=sum(latency) / 2 or dt)
    loop = ActionLoop(session_id, controller, lambda chunk: session.notify("action.chunk", chunk.public()))
    for chunk in reversed(session.chunks):  # the newest observation already in the log
        observation = json_object(chunk.text)
        if observation is not None:
            loop.observe(observation, chunk.ts)
            break
    session.actions.loop = loop.start()
    return session.state()["actions"]


def halt(session: Session) -> None:
    """The session closed: its policy stops (without waiting for a slow one)."""
    if session.actions.loop is not None:
        session.actions.loop.stop(wait=False)
        session.actions.loop = None


def stop_actions(core: EngineCore, session_id: str) -> dict:
    session = core.live(session_id)
    if session.actions.loop is None:
        raise InvalidRequest(f"session {session_id} runs no action policy")
    loop, session.actions.loop = session.actions.loop, None
    loop.stop(wait=False)  # a slow policy must not hold up the engine thread
    return {"last_seq": loop.controller.seq}


def robot_state(sessions: dict, session_id: str, state: list[float], ts: float | None = None) -> None:
    """Thread-safe and immediate (robot state arrives at control rate): raises SessionNotFound,
    InvalidRequest (no policy running, or a malformed state)."""
    session = sessions.get(session_id)
    if session is None:
        raise SessionNotFound(f"no session {session_id!r}")
    loop = session.actions.loop
    if loop is None:
        raise InvalidRequest(f"session {session_id} runs no action policy", code=Code.INVALID_ROBOT_STATE)
    loop.robot_state(state, time.time() if ts is None else ts)
