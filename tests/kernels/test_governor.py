"""The compute-thread governor (kernels/governor.py) against real load: a busy
process taking a core makes it run fewer threads, and the pool runs its ceiling again once the
core is free; a real `streamer serve` on the C kernels does the same and shows it on /metrics.
No timing is asserted: each test waits (up to a deadline) for a state to be reached."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from procutil import ServerProcess
from streamer.kernels import cpu as ck
from streamer.kernels import governor as ck_governor

pytestmark = [
    pytest.mark.skipif(not ck.available(), reason=f"the C kernels do not build here: {ck.unavailable_reason()}"),
    pytest.mark.skipif(not os.path.exists("/proc/self/schedstat") or (os.cpu_count() or 1) < 2,
                       reason="needs Linux's per-thread CPU times and at least 2 CPUs"),
]

HOG = [sys.executable, "-c", "while True: pass"]


def wait_for(condition, seconds: float = 30.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    return condition()


def test_a_busy_process_on_a_core_takes_a_thread_from_the_pools_and_leaving_gives_it_back():
    cpus = os.cpu_count()
    governor = ck_governor.ThreadGovernor(window_s=0.2, enabled=True)
    count = [cpus]
    pool = governor.adopt("counted", lambda: count[0], lambda n: count.__setitem__(0, n), cpus)
    lib = ck.load()
    native = governor.adopt("native", lib.threads, lib.cdll.sk_set_threads, cpus)
    before = lib.ceiling
    lib.set_threads(cpus)
    try:
        hog = subprocess.Popen(HOG)
        try:
            def fewer() -> bool:
                governor.tick(64)
                return count[0] < cpus and lib.threads() < cpus
            assert wait_for(fewer), governor.state()
            assert governor.foreign_cores >= 0.5 and governor.changes >= 1, governor.state()
            assert pool.ceiling == cpus and native.ceiling == cpus  # ceilings stay their owners'
            governor.tick(1)  # a decode step: fewer too (the hog is over 0.3 core)
            assert count[0] < cpus and governor.state("counted")["decode_threads"] < cpus
        finally:
            hog.kill()
            hog.wait()

        def all_back() -> bool:
            governor.tick(64)
            return count[0] == cpus and lib.threads() == cpus
        assert wait_for(all_back), governor.state()
        count[0] = 1  # the owner sets it lower behind the governor's back: a new ceiling, kept
        governor.tick(64)
        assert count[0] == 1 and pool.ceiling == 1
        assert pool.set_ceiling(cpus) == cpus
    finally:
        lib.set_threads(before)


def test_load_that_ran_while_no_step_looked_does_not_take_threads():
    """A busy process that ran and ended while the engine sat idle (no tick for more than two
    windows) is no reason to run fewer threads: the look after the gap counts its load only as
    far as it still runs, and the counts stay. (The look over the whole gap saw ~1 core of
    foreign load and halved a decode's threads for the next windows.) A process still busy after
    such a gap takes its thread at once."""
    cpus = os.cpu_count()
    governor = ck_governor.ThreadGovernor(window_s=0.2, enabled=True)
    count = [cpus]
    governor.adopt("counted", lambda: count[0], lambda n: count.__setitem__(0, n), cpus)
    governor.tick(1)  # the first look: a baseline
    hog = subprocess.Popen(HOG)
    try:
        time.sleep(1.5)  # no steps: > 2 windows
    finally:
        hog.kill()
        hog.wait()
    governor.tick(1)
    assert count[0] == cpus and governor.changes == 0, governor.state()
    assert governor._window < governor.window_s  # the next look comes sooner
    hog = subprocess.Popen(HOG)  # a gap again, and the load goes on after it
    try:
        time.sleep(1.0)

        def fewer() -> bool:
            governor.tick(64)
            return count[0] < cpus
        assert wait_for(fewer), governor.state()
    finally:
        hog.kill()
        hog.wait()


def test_inside_fixed_every_pool_runs_its_ceiling():
    governor = ck_governor.ThreadGovernor(window_s=0.05, enabled=True)
    count = [4]
    pool = governor.adopt("counted", lambda: count[0], lambda n: count.__setitem__(0, n), 4)
    governor.allowed_threads = {"small": 1, "large": 2}  # as a loaded machine leaves it
    governor.tick(64)
    assert count[0] == 2
    with governor.fixed():
        assert pool.set_ceiling(4) == 4
        governor.tick(1)
        assert count[0] == 4
    governor.tick(1)
    assert count[0] == 1 and governor.enabled


def test_the_governor_can_be_turned_off():
    governor = ck_governor.ThreadGovernor(window_s=0.05, enabled=False)
    count = [2]
    governor.adopt("counted", lambda: count[0], lambda n: count.__setitem__(0, n), 2)
    hog = subprocess.Popen(HOG)
    try:
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            governor.tick(1)
            time.sleep(0.02)
        assert count[0] == 2 and governor.changes == 0
    finally:
        hog.kill()
        hog.wait()


def test_streamer_serve_on_the_c_kernels_runs_fewer_threads_beside_a_busy_process():
    """The engine looks before each step: a session that keeps reading while a busy process
    holds a core is served by fewer threads (/metrics says so), and by all of them after."""
    from websockets.asyncio.client import connect

    def metrics(url: str) -> dict:
        with urllib.request.urlopen(url.replace("ws://", "http://") + "/metrics", timeout=10) as reply:
            text = reply.read().decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("streamer_compute_threads", "streamer_cpu_foreign_cores"))}

    read = 'streamer_compute_threads{steps="read"}'
    decode = 'streamer_compute_threads{steps="decode"}'

    async def run(url: str) -> None:
        async with connect(url) as ws:
            await ws.send(json.dumps({"type": "session.create"}))
            sid = json.loads(await ws.recv())["session_id"]

            async def read_until(condition, seconds: float = 60.0) -> dict:
                deadline = time.monotonic() + seconds
                i = 0
                while True:
                    await ws.send(json.dumps({"type": "input.text.append", "session_id": sid, "event_id": f"a{i}",
                                              "text": f"reading {i}: the pressure is {i % 7} and the wind {i % 5}.\n"}))
                    while json.loads(await ws.recv()).get("reply_to") != f"a{i}":
                        pass
                    i += 1
                    seen = await asyncio.to_thread(metrics, url)
                    if condition(seen) or time.monotonic() > deadline:
                        return seen
                    await asyncio.sleep(0.1)

            seen = await asyncio.to_thread(metrics, url)
            assert seen["streamer_compute_threads_ceiling"] == 2, seen
            hog = subprocess.Popen(HOG)
            try:
                seen = await read_until(lambda m: m[read] < 2 and m[decode] < 2)
                assert seen[read] == 1 and seen[decode] == 1 and seen["streamer_cpu_foreign_cores"] >= 0.5, seen
            finally:
                hog.kill()
                hog.wait()
            seen = await read_until(lambda m: m[read] == 2 and m[decode] == 2)
            assert seen[read] == 2 and seen[decode] == 2 and seen["streamer_compute_threads_changes_total"] >= 4, seen

    with ServerProcess("--model", "tiny", "--weights", "int4", "--threads", "2") as server:
        asyncio.run(run(server.url))
