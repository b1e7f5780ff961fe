"""The serving process's garbage collector (streamer.heap.HeapKeeper): the survivors of a full
collection are frozen, so the next one walks only what came since; a sweep reclaims the cycles
that died frozen and adapts its interval; `streamer serve` runs it and counts it on /metrics.

The collector's state is the whole process's, so each case runs in a fresh interpreter."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
import urllib.request

from procutil import ServerProcess


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_survivors_of_a_full_collection_are_frozen_and_the_next_walks_only_what_came_since():
    out = run_python("""
        import gc
        from streamer.heap import HeapKeeper

        keeper = HeapKeeper(interval_s=600)
        started = keeper.start()
        assert started > 1000 and gc.get_freeze_count() == started
        held = [[i] for i in range(50_000)]           # long-lived objects made after the start
        walked = {id(o) for o in gc.get_objects()}
        assert id(held[0]) in walked                        # a full collection would walk them
        gc.collect()                                        # a full collection: its survivors are tenured
        assert keeper.counters["gc_tenured"] == 1, keeper.counters
        walked = {id(o) for o in gc.get_objects()}
        assert id(held) not in walked and id(held[123]) not in walked
        assert gc.get_freeze_count() >= started + 50_000
        later = [[i] for i in range(100)]
        assert id(later[0]) in {id(o) for o in gc.get_objects()}   # what came since is still walked
        keeper.stop()
        gc.collect()
        assert keeper.counters["gc_tenured"] == 1           # stopped: no more tenure
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_sweep_reclaims_cycles_that_died_frozen_and_adapts_its_interval():
    out = run_python("""
        import gc
        from streamer.heap import HeapKeeper

        class Node:
            pass

        def cycles(n):
            out = []
            for _ in range(n):
                a, b = Node(), Node()
                a.other, b.other = b, a
                out.append(a)
            return out

        counters = {}
        keeper = HeapKeeper(interval_s=600, min_interval_s=60, max_interval_s=3600, counters=counters)
        keeper.start()
        held = cycles(100_000)
        gc.collect()                                        # tenured while alive
        del held                                            # now garbage, but frozen: no collection sees it
        assert gc.collect() < 1000
        swept = keeper.sweep()
        assert swept["collected"] >= 200_000, swept         # two instances a cycle
        assert counters["gc_sweeps"] == 1 and counters["gc_swept_objects"] == swept["collected"]
        assert keeper.interval_s == 300 and swept["next_s"] == 300   # much garbage: sweep sooner
        assert keeper.sweep()["collected"] < 1000
        assert keeper.interval_s == 600                     # nothing found: later again
        for _ in range(10):
            keeper.sweep()
        assert keeper.interval_s == 3600                    # never past the longest interval
        assert HeapKeeper(interval_s=0).start() > 0         # 0: only the started heap frozen
        try:
            HeapKeeper(interval_s=30, min_interval_s=60)
        except ValueError as exc:
            assert "min_interval_s" in str(exc)
        else:
            raise AssertionError("an interval below its minimum was taken")
        print("ok")
    """)
    assert out.strip() == "ok"


def test_streamer_serve_tenures_and_sweeps_its_heap_and_counts_it_on_metrics():
    def metrics(url: str) -> dict:
        with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith("streamer_gc_")}

    async def run():
        with ServerProcess("--model", "tiny", "--limit", "gc_sweep_s=1") as server:
            deadline = time.time() + 60
            seen = metrics(server.url)
            while seen.get("streamer_gc_sweeps_total", 0) < 2 and time.time() < deadline:
                await asyncio.sleep(0.5)
                seen = metrics(server.url)
            assert seen["streamer_gc_sweeps_total"] >= 2, seen
            assert "streamer_gc_tenured_total" in seen and "streamer_gc_swept_objects_total" in seen
            assert any("garbage collector: swept" in line for line in server.output), server.output[-10:]
            assert any("survivors of each full collection are frozen too" in line for line in server.output)

    asyncio.run(run())
