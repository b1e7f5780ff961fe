"""Per-key session and connection caps hold across the cluster: two real worker processes on one
Redis share an API key's `sessions_per_key` and `max_connections_per_key`; a closed session or
connection frees its slot at once, and a dead worker's stop counting once its TTL has run out
(they never leak)."""

import asyncio
import json

import pytest
from websockets.exceptions import InvalidStatus
from helpers import until
from procutil import ServerProcess
from redisutil import redis_server, redis_url  # noqa: F401  (fixtures)
from wsutil import raw

pytestmark = pytest.mark.embedded

KEY = "acme-key-0123456789abcdef"


async def create(peer) -> dict:
    return await peer.request({"type": "session.create", "system_prompt": "Count."})


def test_sessions_per_key_hold_across_workers(redis_url, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text(f"acme:{KEY}\n")
    args = ("--store", redis_url, "--api-keys-file", str(keys), "--sessions-per-key", "2")

    async def run():
        with ServerProcess(*args, "--worker-id", "qa") as a, ServerProcess(*args, "--worker-id", "qb") as b:
            on_a, on_b = await raw(f"{a.url}/?api_key={KEY}"), await raw(f"{b.url}/?api_key={KEY}")
            assert (await create(on_a))["type"] == "session.created"
            assert (await create(on_b))["type"] == "session.created"
            for peer in (on_a, on_b):  # one session on each worker: the key is at its cap on both
                refused = await create(peer)
                assert refused["type"] == "error" and refused["error"]["code"] == "too_many_sessions", refused
                assert "across the cluster" in refused["error"]["message"]
            third = await create(on_b)
            assert third["type"] == "error", third  # still: refusals hold no slot

            a.kill()  # its session's entry is no longer stamped: it expires after the worker TTL

            async def admitted():
                reply = await create(on_b)
                return reply if reply["type"] == "session.created" else None

            created = await until(admitted, 30, "the dead worker's session to stop counting")
            assert (await create(on_b))["type"] == "error"  # two live on B: at the cap again
            closed = await on_b.request({"type": "session.close", "session_id": created["session_id"]})
            assert closed["type"] == "session.closed", closed
            return await until(admitted, 10, "the closed session's slot")

    assert asyncio.run(run())["type"] == "session.created"


def test_connections_per_key_hold_across_workers(redis_url, tmp_path):
    """`max_connections_per_key` over every worker of a Redis store: a connection on each of two
    workers puts a key at a cap of 2 on both; a closed connection frees its slot at once; a
    killed worker's connections stop counting after its TTL. Without a key nothing is counted."""
    keys = tmp_path / "keys.txt"
    keys.write_text(f"acme:{KEY}\n")
    args = ("--store", redis_url, "--api-keys-file", str(keys), "--limit", "max_connections_per_key=2")

    async def refused(url: str) -> dict:
        try:
            peer = await raw(url)
        except InvalidStatus as exc:
            assert exc.response.status_code == 429 and exc.response.headers["Retry-After"]
            return json.loads(exc.response.body)
        raise AssertionError(f"admitted past the cluster's cap: {peer}")

    async def run():
        with ServerProcess(*args, "--worker-id", "ca") as a, ServerProcess(*args, "--worker-id", "cb") as b:
            url_a, url_b = f"{a.url}/?api_key={KEY}", f"{b.url}/?api_key={KEY}"
            on_a, on_b = await raw(url_a), await raw(url_b)
            for url in (url_a, url_b):
                body = await refused(url)
                assert body["code"] == "too_many_connections_key" and "across the cluster" in body["error"], body
            assert (await create(on_a))["type"] == "session.created"  # the admitted ones serve
            anonymous = [await raw(a.url) for _ in range(3)]  # no key: not counted
            for peer in anonymous:
                assert (await peer.request({"type": "session.get", "session_id": "none"}))["type"] == "error"
            await on_b.ws.close()

            async def admitted(url):
                try:
                    return await raw(url)
                except InvalidStatus:
                    return None

            again = await until(lambda: admitted(url_a), 10, "the closed connection's slot")
            assert (await refused(url_b))["code"] == "too_many_connections_key"
            a.kill()  # its two connections are no longer stamped: they expire after the worker TTL
            first = await until(lambda: admitted(url_b), 30, "the dead worker's connections to stop counting")
            second = await until(lambda: admitted(url_b), 30, "both of the dead worker's connections to stop counting")
            assert (await refused(url_b))["code"] == "too_many_connections_key"  # two live on B: the cap
            return again, first, second

    assert all(asyncio.run(run()))
