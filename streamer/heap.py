"""The garbage collector of a serving process: full collections that walk what is new, not all
that lives.

CPython's cycle collector stops every thread for a full collection, and a full collection walks
every tracked object that is not frozen: the loaded model's object graph (~370,000 objects for
the embedded model), and every open connection (~130 objects each: asyncio tasks, futures and
timers, websockets' protocol objects, this server's buckets and queues). It runs one whenever
the objects that survived into the oldest generation grew by a quarter since the last one, so a
server whose connections grow (10,000 idle websockets opening) ran full collections of 0.2-1.3 s
one after another, each a stall for every session (bench/fairness.py `idle_10k`).

`HeapKeeper` keeps that walk small:

- **At start** the heap the server holds (modules, the model, the engine) is frozen
  (`gc.freeze`: out of the generations the collector walks).
- **Tenure.** Right after each full collection, whatever survived it (everything still in the
  generations: it was just proven reachable, so nothing frozen there is garbage) is frozen too.
  The next full collection walks only what survived since; its trigger (a quarter of the last
  survivors) shrinks with it, so full collections stay small and frequent, like a young
  generation, instead of growing with the heap.
- **Sweep.** A frozen object that later dies is still freed by its reference count, but a
  frozen *cycle* (a closed connection's objects point at each other: ~90 of its ~130) is never
  collected while frozen. Every `interval_s` the keeper unfreezes, runs one full collection of
  everything and freezes again: the one pause that walks the whole heap, on a schedule instead of
  on heap growth. The interval adapts to what sweeps find: halved (down to `min_interval_s`) when
  a sweep reclaimed more than a tenth of the heap, doubled (up to `max_interval_s`) when it found
  under 1%. The memory held by garbage is thus bounded by what the server sheds in one interval.

Each sweep is logged (objects reclaimed, pause, next interval) and counted on /metrics
(`gc_sweeps_total`, `gc_swept_objects_total`, `gc_tenured_total`).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("streamer.heap")


class HeapKeeper:
    """Freeze the started heap, freeze the survivors of each full collection, and sweep the
    frozen heap on an adaptive schedule (module docstring). One per process: `start()` it once the
    server has started, `await run()` it beside the server, `stop()` it at the end. With
    `interval_s` 0 it only freezes the started heap: no tenure, no sweeps (the default collector)."""

    def __init__(self, interval_s: float = 600.0, min_interval_s: float = 60.0, max_interval_s: float = 3600.0,
                 counters: dict | None = None) -> None:
        if interval_s and not 0 < min_interval_s <= interval_s <= max_interval_s:
            raise ValueError(f"need 0 < min_interval_s <= interval_s <= max_interval_s, got "
                             f"{min_interval_s}, {interval_s}, {max_interval_s}")
        self.interval_s = interval_s
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.counters = counters if counters is not None else {}
        for key in ("gc_tenured", "gc_sweeps", "gc_swept_objects"):
            self.counters.setdefault(key, 0)
        self.last_sweep: dict | None = None
        self._sweeping = False
        self._installed = False

    @classmethod
    def serving(cls, gc_sweep_s: float, counters: dict | None = None) -> "HeapKeeper":
        """The keeper `streamer serve` runs (`ServerConfig.gc_sweep_s`): the first sweep after
        `gc_sweep_s`, then between a minute and an hour (or `gc_sweep_s` where it is outside
        them); 0: only the started heap frozen."""
        return cls(gc_sweep_s, min(60.0, gc_sweep_s), max(3600.0, gc_sweep_s), counters=counters)

    def start(self) -> int:
        """Collect, freeze what the started process holds and tenure from now on. Returns how
        many objects are frozen."""
        gc.collect()
        gc.freeze()
        if self.interval_s and not self._installed:
            gc.callbacks.append(self._after_collection)
            self._installed = True
        return gc.get_freeze_count()

    def stop(self) -> None:
        """Stop tenuring (what is frozen stays frozen)."""
        if self._installed:
            gc.callbacks.remove(self._after_collection)
            self._installed = False

    def _after_collection(self, phase: str, info: dict) -> None:
        # Runs in whichever thread the collection ran (the GIL is held): after a full collection
        # the generations hold only reachable objects, so freezing them all freezes no garbage.
        if phase == "stop" and info["generation"] == 2 and not self._sweeping:
            gc.freeze()
            self.counters["gc_tenured"] += 1

    def sweep(self) -> dict:
        """Unfreeze, collect everything, freeze again; adapt the interval to what was found."""
        self._sweeping = True
        t0 = time.perf_counter()
        try:
            gc.unfreeze()
            collected = gc.collect()
            gc.freeze()
        finally:
            self._sweeping = False
        pause_s = time.perf_counter() - t0
        frozen = gc.get_freeze_count()
        share = collected / max(frozen + collected, 1)
        if share > 0.10:
            self.interval_s = max(self.min_interval_s, self.interval_s / 2)
        elif share < 0.01:
            self.interval_s = min(self.max_interval_s, self.interval_s * 2)
        self.counters["gc_sweeps"] += 1
        self.counters["gc_swept_objects"] += collected
        self.last_sweep = {"collected": collected, "frozen": frozen, "pause_s": round(pause_s, 3),
                           "next_s": self.interval_s}
        log.info("garbage collector: swept %d objects of %d in %.0f ms; next sweep in %g s",
                 collected, frozen + collected, pause_s * 1000, self.interval_s)
        return self.last_sweep

    async def run(self) -> None:
        """Sweep every `interval_s` until cancelled (never with `interval_s` 0)."""
        while self.interval_s:
            await asyncio.sleep(self.interval_s)
            self.sweep()
