"""Per-key session caps hold across the cluster: two real worker processes on one Redis share
an API key's `sessions_per_key`; a closed session frees its slot at once, and a dead worker's
sessions stop counting once its TTL has run out (they never leak)."""

import asyncio

import pytest
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
