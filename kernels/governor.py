"""Fewer native-kernel threads while other work holds the cores: the thread governor.

A step's work is split evenly over the native kernels' pool threads, which meet at barriers,
so one thread that shares its core with another runnable task (a neighbour process, the
server's own event loop or media threads, the hypervisor's steal) holds up the whole step.
Measured on 2 cores with one taken by a busy process: the native stack decodes a token in
15 ms on 2 threads and 5.6 ms on 1, and reads about as fast on either; with a core 40% busy,
2 threads still read faster than 1 but decode slower (bench/decode.py --hog).

So before each step on the native stack (`tick`, from ModelRunner.forward), at most once a
`window_s`, the governor reads how busy the machine's CPUs were since its last look
(/proc/stat, steal included) and how much of that was the compute threads' own: the stepping
thread and every thread of the process that Python did not start (the pool's workers; torch's
OpenMP workers, idle here), from /proc/self/task/<id>/schedstat. The rest is *foreign* load,
in cores. A step of at most `small_rows` rows (decoding) gets floor(cores - foreign + 0.3)
threads, a larger one (reading) floor(cores - foreign + 0.75): one thread fewer once foreign
load passes 0.3 core for decode steps, 0.75 for reading ones. Never fewer than one nor more
than the pool's ceiling (`--threads`, else torch's count: `Kernels.set_threads`); fewer at
once, more only once two windows in a row agree. A look after more than two windows without
steps (the engine sat idle) counts the load of that gap only as far as it still runs (the
machine's runnable threads, /proc/stat's procs_running, less this process's; if any, the fewest
of reads over ~10 ms), and the next look comes a fifth of a window later and alone may give threads
back: load that ran meanwhile and has ended (a neighbour's burst, a benchmark's other engine)
says nothing about the steps that follow, a busy process still there does.

The native kernels' results never depend on their thread count (their splits are fixed;
tests/kernels/test_cpu.py). Torch's threads are not governed: its results do depend on its
thread count (a session replayed on 1 thread differed from the original on 2 in
tests/sessions/test_thinking.py, and a VLM's vision tower in test_vl_engine.py), and replay
must equal the original.

Off with STREAMER_ADAPTIVE_THREADS=0, and where /proc is not Linux's (then the ceilings run).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

ADAPTIVE_ENV = "STREAMER_ADAPTIVE_THREADS"  # "0": every pool runs its ceiling
UNLIMITED = 1 << 30


def no_limits() -> dict[str, int]:
    """The threads each kind of step may get before any look, or with the governor off: all."""
    return {"small": UNLIMITED, "large": UNLIMITED}


class Pool:
    """One set of compute threads the governor sizes (a build of the native kernels): how to
    read and set its count, and the most it may run (its owner's choice)."""

    def __init__(self, governor: ThreadGovernor, name: str, get: Callable[[], int], put: Callable[[int], object],
                 ceiling: int) -> None:
        self.governor, self.name = governor, name
        self.get, self.put = get, put
        self.ceiling = max(1, int(ceiling))
        self.applied = self.get()

    def set_ceiling(self, n: int) -> int:
        """At most `n` threads from now; returns the count in use (for a reading step)."""
        self.ceiling = max(1, int(n))
        return self.apply(self.governor.allowed(self.ceiling))

    def apply(self, n: int) -> int:
        now = self.get()
        if now != self.applied:  # its owner set it behind our back: a new ceiling
            self.ceiling = max(1, now)
            n = min(n, self.ceiling)
        if now != n:
            self.put(n)
        self.applied = self.get()
        return self.applied


class ThreadGovernor:
    """See the module doc. One per process (`GOVERNOR`); tests make their own."""

    small_rows = 8
    stale_after = 2.0  # windows since the last look past which it measured an idle engine's gap
    fresh_fraction = 0.2  # of a window: the next look after such a gap
    running_reads = 6  # of the runnable threads at such a look (the fewest counts), this far apart:
    running_every_s = 0.002

    def __init__(self, window_s: float = 0.5, small_slack: float = 0.3, large_slack: float = 0.75,
                 enabled: bool | None = None) -> None:
        self.window_s = window_s
        self._window = window_s  # until the next look
        self.slack = {"small": small_slack, "large": large_slack}
        self.enabled = (os.environ.get(ADAPTIVE_ENV, "1") != "0") if enabled is None else enabled
        self.allowed_threads = no_limits()
        self.pools: dict[str, Pool] = {}
        self.foreign_cores = 0.0  # the last window's
        self.changes = 0
        self._lock = threading.Lock()
        self._up_votes = {"small": 0, "large": 0}
        self._last: tuple[float, int, int, int] | None = None  # (monotonic, busy ticks, all ticks, pool ns)

    def adopt(self, name: str, get: Callable[[], int], put: Callable[[int], object], ceiling: int) -> Pool:
        """Size the pool `name` from now on (the same name again: the pool registered first)."""
        with self._lock:
            if name not in self.pools:
                self.pools[name] = Pool(self, name, get, put, ceiling)
            return self.pools[name]

    @contextmanager
    def fixed(self) -> Iterator[None]:
        """Every pool runs its ceiling while inside (what a test of an exact thread count needs)."""
        saved = self.enabled, dict(self.allowed_threads)
        self.enabled, self.allowed_threads = False, no_limits()
        try:
            yield
        finally:
            self.enabled, self.allowed_threads = saved[0], saved[1]

    def allowed(self, ceiling: int, rows: int | None = None) -> int:
        kind = "large" if rows is None or rows > self.small_rows else "small"
        return max(1, min(ceiling, self.allowed_threads[kind]))

    def state(self, pool: str | None = None) -> dict:
        """What /metrics shows: the threads a decode step and a reading step get now (of `pool`,
        default the one with the highest ceiling), the ceiling, the last foreign load."""
        chosen = self.pools.get(pool) if pool else max(self.pools.values(), key=lambda p: p.ceiling, default=None)
        ceiling = chosen.ceiling if chosen else 1
        return {"ceiling": ceiling, "adaptive": self.enabled, "decode_threads": self.allowed(ceiling, 1),
                "read_threads": self.allowed(ceiling), "foreign_cores": round(self.foreign_cores, 3),
                "changes": self.changes}

    @staticmethod
    def _cpu_ticks() -> tuple[int, int, int, int]:
        """(busy, all) ticks summed over the CPUs since boot, the number of CPUs, and the threads
        runnable right now on the machine (the caller included)."""
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        fields = [int(v) for v in lines[0].split()[1:9]]  # user nice system idle iowait irq softirq steal
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        running = next((int(line.split()[1]) for line in lines if line.startswith("procs_running ")), 1)
        return sum(fields) - fields[3] - fields[4], sum(fields), cpus, running

    @staticmethod
    def _pool_ns() -> int:
        """Run time of the calling thread and of every thread Python did not start."""
        python = {t.native_id for t in threading.enumerate()} - {threading.get_native_id()}
        total = 0
        for tid in os.listdir("/proc/self/task"):
            if int(tid) in python:
                continue
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # the thread ended
        return total

    @staticmethod
    def _own_running() -> int:
        """This process's threads runnable now (the caller, pool workers or torch's OpenMP threads
        still spinning after their last job), at least 1."""
        count = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    count += f.read().rpartition(")")[2].split()[0] == "R"
            except (OSError, IndexError):
                pass  # the thread ended
        return max(1, count)

    def tick(self, rows: int | None = None) -> None:
        """Before a step of `rows` rows: look at most once a window, and size every pool for a
        step of that size."""
        if not self.enabled or not self.pools:
            return
        now = time.monotonic()
        if (self._last is None or now - self._last[0] >= self._window) and self._lock.acquire(blocking=False):
            try:
                self._look(now)
            except (OSError, ValueError, IndexError) as exc:
                log.info("thread governor off: cannot read CPU times (%s)", exc)
                self.enabled = False
                self.allowed_threads = no_limits()
                for pool in list(self.pools.values()):
                    pool.apply(pool.ceiling)
                return
            finally:
                self._lock.release()
        for pool in list(self.pools.values()):
            want = self.allowed(pool.ceiling, rows)
            if pool.applied != want or pool.get() != want:
                pool.apply(want)

    def _look(self, now: float) -> None:
        busy, ticks, cpus, _running = self._cpu_ticks()
        pool_ns = self._pool_ns()
        last, self._last = self._last, (now, busy, ticks, pool_ns)
        if last is None or ticks <= last[2]:
            return
        busy_cores = (busy - last[1]) / (ticks - last[2]) * cpus
        pool_cores = (pool_ns - last[3]) / 1e9 / (now - last[0])
        self.foreign_cores = max(0.0, busy_cores - pool_cores)
        self._window = self.window_s
        stale = now - last[0] > self.stale_after * self.window_s
        if stale:
            # no step looked for a while (the engine sat idle): the load over the gap counts only
            # as far as it still runs now (the machine's runnable threads less this process's), and
            # the next look comes soon, over the steps themselves. A neighbour's burst that has
            # ended says nothing about the steps that follow (bench/decode.py's llama.cpp rounds
            # between ours took half the threads of our next 64-token answer: 5.5 ms a token at 512
            # where the governor off gave 3.6); a busy process still there takes its thread at once.
            self.foreign_cores = min(self.foreign_cores, float(self._running_foreign(cpus)))
            self._window = self.window_s * self.fresh_fraction
        for kind, slack in self.slack.items():
            target = max(1, min(cpus, int(cpus - self.foreign_cores + slack)))
            current = min(cpus, self.allowed_threads[kind])
            if target >= current:
                self._up_votes[kind] = self._up_votes[kind] + 1 if target > current else 0
                if self._up_votes[kind] < 2:
                    continue
                target = UNLIMITED if target >= cpus else target  # all cores free again: ceilings bind
            self._up_votes[kind] = 0
            if target != self.allowed_threads[kind]:
                self.allowed_threads[kind] = target
                self.changes += 1
                log.debug("threads for %s steps: at most %s (foreign load %.2f cores of %d)",
                          "decode" if kind == "small" else "reading", "all" if target == UNLIMITED else target,
                          self.foreign_cores, cpus)
        if stale:  # a count an instant chose: the next look alone may give threads back
            self._up_votes = {kind: 1 for kind in self.slack}

    def _running_foreign(self, cpus: int) -> int:
        """Threads of other processes runnable now, this process's counted on both sides of the
        machine's count (one of ours that stops spinning between them is still ours). None at
        the first read is the answer; else the fewest of reads over ~10 ms: a process that
        finishes its work just then (bench/decode.py's llama.cpp worker answering) is no load."""
        fewest = cpus
        for i in range(self.running_reads):
            if i:
                time.sleep(self.running_every_s)
            before = self._own_running()
            running = self._cpu_ticks()[3]
            fewest = min(fewest, running - max(before, self._own_running()))
            if fewest <= 0:
                return 0
        return fewest


GOVERNOR = ThreadGovernor()
