"""A real Redis for tests: the one on 127.0.0.1:6379 when it answers, else a private
redis-server on a free port (Debian package redis-server). Each test gets its own key prefix
and deletes its keys after (never FLUSHALL)."""

import shutil
import socket
import subprocess
import uuid

import pytest
from helpers import wait_until


def answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


@pytest.fixture(scope="session")
def redis_server():
    """host:port of a running Redis."""
    if answers(6379):
        yield "127.0.0.1:6379"
        return
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("no Redis on 127.0.0.1:6379 and no redis-server binary (apt-get install redis-server)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: answers(port), 5, "the private redis-server")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture()
def redis_url(redis_server):
    """A redis:// URL with a key prefix of its own; the prefix's keys are deleted after."""
    import redis

    prefix = f"streamer-test-{uuid.uuid4().hex[:10]}"
    yield f"redis://{redis_server}/0?prefix={prefix}"
    client = redis.Redis.from_url(f"redis://{redis_server}/0")
    keys = list(client.scan_iter(f"{prefix}:*"))
    if keys:
        client.delete(*keys)
    client.close()
