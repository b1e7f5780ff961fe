"""`streamer serve` refuses a configuration it cannot run at start: one line on stderr, exit 2,
no traceback and no server that fails every request later. Each case runs the real command as
a subprocess (as tests/streamer/test_cli_errors.py does), against a real Redis where it needs
one; a budget the error names as the smallest that works is started and used.

Cases: a --dtype the engine has no name for; a --device this torch cannot use (checked with
torch before the model loads); a malformed --store Redis URL (a db that is not a non-negative
integer was read as db 0); a keys file with one key under two names or one name twice; a KV
budget that cannot hold one session (every session.create failed on the server it started).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch
from helpers import wait_until
from procutil import ServerProcess
from redisutil import redis_server  # noqa: F401  (fixture)
from wsutil import raw

KEY = "serve-test-key-0123456789"
NO_MODEL = ("--model", "/nonexistent/model")  # a check that passes would fail next on the model


@dataclass(frozen=True, slots=True)
class Case:
    argv: tuple[str, ...]
    says: tuple[str, ...]  # substrings of the one line, in order
    skip: str | None = None  # why this machine cannot show the case


def _no_cuda() -> str | None:
    return "this torch can use CUDA" if torch.cuda.is_available() else None


def _no_mps() -> str | None:
    return "MPS is available here" if torch.backends.mps.is_available() else None


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


CASES = {
    # 1. --dtype: refused as the arguments are parsed (it was a 25-line traceback from the load)
    "dtype-float8": Case(("--dtype", "float8"), ("argument --dtype", "unknown dtype 'float8'",
                                                 "float32, bfloat16 or float16")),
    # 2. --device: checked with torch before the model loads (it was a 41-line traceback)
    "device-cuda": Case(("--device", "cuda", "--model", "tiny"), ("--device cuda", "use --device cpu"),
                        skip=_no_cuda()),
    "device-mps": Case(("--device", "mps", "--model", "tiny"), ("--device mps", "not available", "--device cpu"),
                       skip=_no_mps()),
    "device-meta": Case(("--device", "meta", "--model", "tiny"), ("--device meta", "cannot run a model")),
    "device-unknown": Case(("--device", "gpu", "--model", "tiny"), ("--device 'gpu' is not a torch device",
                                                                     "cuda:N")),
    "device-cuda-index": Case(("--device", f"cuda:{_cuda_count()}", "--weights", "fp32", "--model", "tiny"),
                              (f"--device cuda:{_cuda_count()}", "pick one of them"),
                              skip=None if _cuda_count() else "no CUDA GPU here"),
    # 3. --store: a malformed Redis URL (the client read /notadb as db 0, and a bad port or option
    #    was reported as "cannot reach Redis")
    "redis-db-not-a-number": Case(("--store", "redis://{redis}/notadb", *NO_MODEL),
                                  ("--store redis://{redis}/notadb", "the db 'notadb'",
                                   "not a non-negative integer", "redis://host:port/N")),
    "redis-db-negative": Case(("--store", "redis://{redis}/-1", *NO_MODEL), ("the db '-1'", "non-negative")),
    "redis-db-query": Case(("--store", "redis://{redis}?db=two", *NO_MODEL), ("the db 'two'",)),
    "redis-db-path-and-query": Case(("--store", "redis://{redis}/1?db=2", *NO_MODEL), ("two dbs (1, 2)",)),
    "redis-db-trailing": Case(("--store", "redis://{redis}/0/extra", *NO_MODEL), ("the db '0/extra'",)),
    "redis-port": Case(("--store", "redis://user:s3cret@127.0.0.1:63x9/0", *NO_MODEL),
                       ("redis://user:***@127.0.0.1:63x9/0", "the port in '127.0.0.1:63x9'", "1..65535")),
    "redis-option": Case(("--store", "redis://{redis}/0?socket_timeout=soon", *NO_MODEL),
                         ("--store", "socket_timeout", "fix the URL")),
    "redis-unknown-option": Case(("--store", "redis://{redis}/0?colour=blue", *NO_MODEL),
                                 ("--store", "'colour'", "fix the URL")),
    "redis-empty-prefix": Case(("--store", "redis://{redis}/0?prefix=", *NO_MODEL), ("?prefix= is empty",)),
    "redis-no-such-db": Case(("--store", "redis://{redis}/4096", *NO_MODEL),
                             ("Redis at redis://{redis}/4096 refused", "DB index is out of range",
                              "'databases' setting")),
    "unix-no-path": Case(("--store", "unix://", *NO_MODEL), ("no socket path", "unix:///path/to/redis.sock")),
    # 4. the keys file: one key under two names, one name twice (never the key in the line)
    "keys-one-key-two-names": Case(("--api-keys-file", "{tmp}/shared-key.txt", *NO_MODEL),
                                   ("shared-key.txt:4", "the key of 'robot'", "the key of 'ops' (line 1)")),
    "keys-one-name-twice": Case(("--api-keys-file", "{tmp}/twice.txt", *NO_MODEL),
                                ("twice.txt:3", "key name 'ops' appears twice", "first on line 1")),
    # 5. a KV budget that cannot hold one session (0 blocks was a traceback; 3 blocks started a
    #    server on which no session could take input)
    "kv-budget-no-block": Case(("--store", "memory:", "--model", "tiny", "--limit", "kv_budget_bytes=4096"),
                               ("kv_budget_bytes=4096 cannot hold one session", "512 bytes a token",
                                "the smallest budget that works is --limit kv_budget_bytes=")),
    "kv-budget-one-short": Case(("--store", "memory:", "--model", "tiny", "--limit", "kv_budget_bytes={tiny_floor_1}"),
                                ("kv_budget_bytes={tiny_floor_1} cannot hold one session",
                                 "the smallest budget that works is --limit kv_budget_bytes={tiny_floor}")),
}


def tiny_floor() -> int:
    """The tiny model's smallest budget, from its shape and the framing (what the error names)."""
    from streamer.app import load_tiny
    from streamer.cli import kv_budget_floor
    from streamer.sessions.runner import ModelRunner

    loaded = load_tiny("tiny")
    return kv_budget_floor(ModelRunner(loaded.model, loaded.tokenizer, loaded.name), 16)[2]


def serve(argv: list[str], cwd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`streamer serve --port 0 ARGV`; one that is still serving after `timeout` seconds (it took
    the configuration) is stopped and reported with returncode None."""
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_API_KEYS_FILE"}
    env.update(HF_HUB_OFFLINE="1", STREAMER_STORE="memory:")
    command = [sys.executable, "-m", "streamer", "serve", "--port", "0", "--threads", "1", *argv]
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout, env=env,
                              cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        out = exc.stderr.decode() if isinstance(exc.stderr, bytes) else exc.stderr or ""
        return subprocess.CompletedProcess(command, None, "", out + f"\n(still serving after {timeout:g} s)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, redis_server):  # noqa: F811
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "shared-key.txt").write_text(f"ops:{KEY} role=operator\n# the robots\n\nrobot:{KEY}\n")
    (tmp / "twice.txt").write_text(f"ops:{KEY}\nci:{KEY}-ci\nops:{KEY}-2\n")
    floor = tiny_floor()
    values = {"tmp": str(tmp), "redis": redis_server, "tiny_floor": floor, "tiny_floor_1": floor - 1}
    todo = {name: case for name, case in CASES.items() if case.skip is None}
    with ThreadPoolExecutor(2) as pool:
        done = dict(zip(todo, pool.map(lambda c: serve([a.format(**values) for a in c.argv], str(tmp)),
                                       todo.values())))
    return done, values


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_and_exit_2(runs, name):
    case = CASES[name]
    if case.skip:
        pytest.skip(case.skip)
    done, values = runs
    run = done[name]
    lines = run.stderr.splitlines()
    assert run.returncode == 2, (run.returncode, run.stderr[-3000:])
    assert len(lines) == 1, run.stderr[-3000:]
    line = lines[0]
    assert line.startswith("streamer serve: error: ") and "Traceback" not in line, line
    at = 0
    for part in case.says:
        found = line.find(part.format(**values), at)
        assert found >= 0, f"{part.format(**values)!r} not in {line!r} (after column {at})"
        at = found
    assert KEY not in line and "s3cret" not in line, line
    assert run.stdout == "", run.stdout


def test_the_dtype_names_are_the_engines():
    """The CLI lists the dtype names instead of importing them (the import pulls in torch)."""
    from streamer.cliargs import DTYPES
    from streamer.sessions.models import _DTYPES, parse_dtype

    assert set(DTYPES) == set(_DTYPES)
    assert all(parse_dtype(alias) == parse_dtype(name) for alias, name in DTYPES.items())


async def _create_and_read(url: str, text: str) -> dict:
    peer = await raw(url)
    try:
        sid = await peer.create()
        return await peer.request({"type": "input.text.append", "session_id": sid, "text": text})
    finally:
        await peer.ws.close()


def test_the_smallest_budget_named_works(runs, tmp_path):
    """The budget the error names starts a server on which a session is created and reads input."""
    done, values = runs
    line = done["kv-budget-one-short"].stderr
    budget = int(re.search(r"--limit kv_budget_bytes=(\d+)", line).group(1))
    assert budget == values["tiny_floor"]
    with ServerProcess("--store", "memory:", "--model", "tiny", "--limit", f"kv_budget_bytes={budget}",
                       ready_timeout=120) as server:
        ack = asyncio.run(_create_and_read(server.url, "The keeper is Ada."))
    assert ack["type"] == "input.ack", ack


@pytest.mark.embedded
def test_kv_budget_of_one_mib_on_the_embedded_model(tmp_path):
    """The issue's case: --kv-budget-mb 1 started a server on which every session.create failed;
    now the start is refused with the smallest --kv-budget-mb that works, and that one starts."""
    run = serve(["--store", "memory:", "--kv-budget-mb", "1"], str(tmp_path))
    # the check needs the model's KV shape, so the load's own log lines come first; the error
    # is one line, the last, with no traceback
    lines = run.stderr.splitlines()
    errors = [line for line in lines if ": error: " in line]
    assert run.returncode == 2 and errors == lines[-1:], run.stderr[-3000:]
    assert "Traceback" not in run.stderr and run.stdout == "", run.stderr[-3000:]
    assert errors[0].startswith("streamer serve: error: --kv-budget-mb 1 cannot hold one session"), errors
    works = int(re.search(r"the smallest budget that works is --kv-budget-mb (\d+)$", errors[0]).group(1))
    assert works > 1
    with ServerProcess("--store", "memory:", "--kv-budget-mb", str(works), ready_timeout=180) as server:
        ack = asyncio.run(_create_and_read(server.url, "The keeper is Ada."))
    assert ack["type"] == "input.ack", ack


def test_a_redis_store_on_a_unix_socket_serves(tmp_path):
    """unix:///path?db=N reaches the client as written (it was rewritten to unix:/path, which
    the preflight and the store both refused): a server starts on a private Redis's socket and
    its session's log lands in that db."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no redis-server binary (apt-get install redis-server)")
    import redis

    sock = tmp_path / "redis.sock"
    proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(sock.exists, 10, "the private redis-server's socket")
        url = f"unix://{sock}?db=3&prefix=unixtest"
        with ServerProcess("--store", url, "--model", "tiny", ready_timeout=120) as server:
            ack = asyncio.run(_create_and_read(server.url, "The keeper is Ada."))
        assert ack["type"] == "input.ack", ack
        client = redis.Redis(unix_socket_path=str(sock), db=3)
        assert list(client.scan_iter("unixtest:log:*")), "no session log in db 3"
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("url, message", [
    ("redis://127.0.0.1:6379/notadb", "the db 'notadb' is not a non-negative integer"),
    ("redis://127.0.0.1:port/0", "the port in '127.0.0.1:port'"),
])
def test_the_store_refuses_a_malformed_redis_url(url, message):
    """open_store (the server's path, and any other caller's) refuses what the preflight refuses."""
    from streamer.store import StoreError, open_store

    with pytest.raises(StoreError, match=re.escape(message)):
        open_store(url)


def test_redis_urls_the_store_takes():
    from streamer.redis_store import split_url

    assert split_url("redis://127.0.0.1:6379/2?prefix=a") == ("redis://127.0.0.1:6379/2", "a")
    assert split_url("redis://127.0.0.1:6379") == ("redis://127.0.0.1:6379", "streamer")
    assert split_url("redis://127.0.0.1:6379/") == ("redis://127.0.0.1:6379/", "streamer")
    assert split_url("rediss://h:1/0?db=0") == ("rediss://h:1/0?db=0", "streamer")
    assert split_url("unix:///run/redis.sock?db=1&prefix=p") == ("unix:///run/redis.sock?db=1", "p")
    assert split_url("unix:/run/redis.sock") == ("unix:///run/redis.sock", "streamer")
