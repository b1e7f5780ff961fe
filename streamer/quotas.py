"""Per-key session and connection caps across the cluster.

Each worker counts the sessions an API key holds on it (`Directory`, `sessions_per_key`) and
the websocket connections it holds there (`ConnectionGate`, `max_connections_per_key`); with a
Redis store both caps hold over every worker sharing it too: the sessions a key holds are a
sorted set in Redis (`{p}:key-sessions:{key}`, member the session id, score the time its entry
expires, on Redis's clock), its connections another (`{p}:key-connections:{key}`, member the
worker id and the connection's id). A new session (at `session.create`) or connection (at the
handshake) is admitted by a Lua script that drops expired entries, counts the rest and adds the
new one only under the cap, atomically. Each worker re-stamps the entries of the sessions it
holds (detached ones too: they count, as on one worker) and of its open connections every
heartbeat, so the entries of a dead worker expire after the worker TTL (6 s) unless the worker
that adopts its sessions stamps them again; a closed session's or connection's entry goes at
once. A connection admission the store cannot answer is let through (logged): the worker's own
cap still holds. With a file or in-process store there is one worker: its own counts are all.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

from streamer.sessions.errors import Code, EngineError

from .store_base import HEARTBEAT_S, WORKER_TTL_S

log = logging.getLogger(__name__)

# KEYS[1]: the key's set; ARGV: ttl ms, cap, session id. Returns -1 when admitted, else the count held.
_ADMIT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if not redis.call('ZSCORE', KEYS[1], ARGV[3]) then
  local held = redis.call('ZCARD', KEYS[1])
  if held >= tonumber(ARGV[2]) then return held end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return -1
"""

# KEYS[1]: the key's set; ARGV: ttl ms, then the session ids this worker holds for that key.
_STAMP = """
local t = redis.call('TIME')
local until_ = t[1] * 1000 + math.floor(t[2] / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], until_, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return #ARGV - 1
"""


def _in_background(work, what: str) -> None:
    """Run a store write without waiting for it; a failure is logged (the entry then lapses with
    the worker TTL, as a dead worker's do)."""
    task = asyncio.get_running_loop().create_task(work)
    task.add_done_callback(lambda t: t.cancelled() or t.exception() is None or log.warning(
        "%s: %s", what, t.exception()))


class ClusterQuota:
    """The cluster-wide counts of sessions and connections per API key (a no-op unless the
    store is Redis)."""

    def __init__(self, store, sessions_per_key: int, ttl_s: float = WORKER_TTL_S,
                 connections_per_key: int | None = None) -> None:
        self.store = store
        self.sessions_per_key = sessions_per_key
        self.connections_per_key = connections_per_key
        self.ttl_ms = int(ttl_s * 1000)
        self.enabled = store.kind == "redis"
        if self.enabled:
            self._admit = store.redis.register_script(_ADMIT)
            self._stamp = store.redis.register_script(_STAMP)

    def _key(self, key_name: str) -> str:
        return self.store.key("key-sessions", key_name)

    async def admit(self, key_name: str, session_id: str) -> None:
        """Count `session_id` for `key_name` in the cluster, or raise `too_many_sessions`."""
        if not self.enabled:
            return
        held = await self.store._do(self._admit(keys=[self._key(key_name)],
                                                args=[self.ttl_ms, self.sessions_per_key, session_id]))
        if held != -1:
            raise EngineError(f"this API key already holds {held} sessions across the cluster "
                              f"(limit {self.sessions_per_key})", code=Code.TOO_MANY_SESSIONS)

    def _ckey(self, key_name: str) -> str:
        return self.store.key("key-connections", key_name)

    def member(self, conn_id: str) -> str:
        """A connection's entry in its key's set: this worker's id and the connection's."""
        return f"{self.store.worker_id}/{conn_id}"

    async def admit_connection(self, key_name: str, member: str) -> int | None:
        """Count a connection of `key_name` in the cluster: None when admitted, else how many the
        key holds across the cluster (at its cap). The store not answering admits it (logged)."""
        if not self.enabled or self.connections_per_key is None:
            return None
        try:
            held = await self.store._do(self._admit(keys=[self._ckey(key_name)],
                                                    args=[self.ttl_ms, self.connections_per_key, member]))
        except Exception as exc:
            log.warning("counting a connection of key %s across the cluster: %s (admitted on this "
                        "worker's own count)", key_name, exc)
            return None
        return None if held == -1 else int(held)

    def forget_connection(self, key_name: str, member: str) -> None:
        """A connection counted in the cluster closed: its entry goes now (in the background)."""
        if self.enabled:
            _in_background(self.store._do(self.store.redis.zrem(self._ckey(key_name), member)),
                           f"releasing a connection from key {key_name}'s count")

    async def release(self, key_name: str, session_id: str) -> None:
        if self.enabled:
            await self.store._do(self.store.redis.zrem(self._key(key_name), session_id))

    def forget(self, key_name: str | None, session_id: str) -> None:
        """A session of `key_name` closed here: its entry goes now (in the background)."""
        if self.enabled and key_name is not None:
            _in_background(self.release(key_name, session_id), f"releasing session {session_id} from its key's count")

    async def stamp(self, held: dict[str, list[str]], connections: dict[str, set[str]] | None = None) -> None:
        """Re-stamp the entries of the sessions this worker holds (key name -> session ids) and
        of its connections counted in the cluster (key name -> members)."""
        for key_name, sids in held.items():
            await self.store._do(self._stamp(keys=[self._key(key_name)], args=[self.ttl_ms, *sids]))
        for key_name, members in (connections or {}).items():
            if members:
                await self.store._do(self._stamp(keys=[self._ckey(key_name)], args=[self.ttl_ms, *members]))

    async def run(self, directory, gate=None, interval_s: float = HEARTBEAT_S) -> None:
        """Stamp every `interval_s` the sessions `directory` holds with a key (adopted ones too)
        and the connections `gate` (a ConnectionGate) counted in the cluster."""
        if not self.enabled:
            return
        while True:
            held: dict[str, list[str]] = defaultdict(list)
            for sid, tracked in list(directory.sessions.items()):
                if tracked.key_name is not None:
                    held[tracked.key_name].append(sid)
            connections = {k: set(v) for k, v in gate.cluster_members.items()} if gate is not None else None
            try:
                await self.stamp(held, connections)
            except Exception as exc:  # the store is down: entries may lapse; admissions fail alike
                log.warning("stamping the per-key session and connection counts: %s", exc)
            await asyncio.sleep(interval_s)
