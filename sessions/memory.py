"""KV memory: the block pool, admission of new sessions and parking of idle ones.

The engine asks before it commits: a new session is admitted only if its framing fits the KV
budget (after parking idle sessions, if that makes room), otherwise it is refused or waits in
the admission queue; every planned step's cache slots are reserved here before the forward, so
a full pool fails that one job, not the step. Only the engine thread uses it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from .futures import chain, settle
from .pool import BlockPool, OutOfBlocks, default_budget_bytes
from .session import Session


class Memory:
    def __init__(self, shape, limits, stats, idle_sessions: Callable[[], Iterable[Session]]) -> None:
        self.limits = limits
        self.stats = stats  # EngineStats: parked, restored, admissions_queued, admissions_refused
        budget = limits.kv_budget_bytes or default_budget_bytes(shape.device)
        self.pool = BlockPool(shape, budget, limits.block_size)
        self.idle_sessions = idle_sessions  # sessions with nothing queued or running
        self.admission: deque[tuple[float, Callable[[], object], Future]] = deque()  # waiting for memory

    def admit(self, open_session: Callable[[], object]) -> object:
        """Open the session if its blocks fit the KV budget (parking idle sessions if that makes
        room); otherwise refuse (OutOfBlocks) or return a future that resolves once it opens."""
        try:
            return self.with_room(open_session)
        except OutOfBlocks as exc:
            if self.limits.admission == "refuse":
                self.stats.admissions_refused += 1
                raise OutOfBlocks(f"no room for a new session: {exc}") from None
        out: Future = Future()
        self.admission.append((time.monotonic() + self.limits.admission_timeout_s, open_session, out))
        self.stats.admissions_queued += 1
        return out

    def retry_admissions(self) -> None:
        now = time.monotonic()
        while self.admission:
            deadline, open_session, out = self.admission[0]
            try:
                result = self.with_room(open_session)
            except OutOfBlocks as exc:
                if now < deadline:
                    return  # FIFO: later arrivals wait behind the first
                self.admission.popleft()
                self.stats.admissions_refused += 1
                settle(out, exc=OutOfBlocks(f"no room for a new session after waiting "
                                            f"{self.limits.admission_timeout_s:.0f} s: {exc}"))
                continue
            except Exception as exc:
                self.admission.popleft()
                settle(out, exc=exc)
                continue
            self.admission.popleft()
            chain(result, out)

    def next_deadline(self) -> float | None:
        """Seconds until the first queued admission times out (None: none waits)."""
        if not self.admission:
            return None
        return max(0.0, self.admission[0][0] - time.monotonic()) + 0.001

    def with_room(self, action: Callable[[], object], keep: Session | None = None):
        """Run `action`; if it runs out of blocks, park idle sessions and try once more."""
        try:
            return action()
        except OutOfBlocks:
            if not self.park_idle(keep):
                raise
            return action()

    def park_idle(self, keep: Session | None = None) -> int:
        """Park idle sessions, least recently used first, to free pool blocks; returns how
        many were parked."""
        now = time.monotonic()
        idle = [s for s in self.idle_sessions() if s is not keep and s.cache.parked is None
                and now - s.last_active >= self.limits.park_idle_s]
        parked = 0
        for session in sorted(idle, key=lambda s: s.last_active):
            if session.cache.park(self.limits.park_to_disk, session.id):
                parked += 1
                self.stats.parked += 1
                session.log.info("parked to %s", "disk" if self.limits.park_to_disk else "host memory")
        return parked

    def resident(self, session: Session) -> None:
        """Bring a parked session back into the pool before its work runs."""
        cache = session.cache
        if cache.parked is not None:
            self.with_room(cache.restore, session)
            self.stats.restored += 1
            session.log.info("restored from parking")

    def reserve(self, step, session: Session) -> None:
        """Take the blocks a planned step writes, now: a full pool fails this job, not the step."""
        self.with_room(lambda: step.cache.reserve(step.start + step.n), session)

    def fail_waiting(self, exc: BaseException) -> None:
        while self.admission:
            settle(self.admission.popleft()[2], exc=exc)
