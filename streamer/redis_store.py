"""The Redis store: event logs in Streams, the session directory, snapshots, worker heartbeats.

Keys (all under `prefix`, default `streamer`):

- `{p}:log:{sid}`    Stream; one entry per record, fields `n` (position), `r` (JSON record) and `i`
                     (the record's id); the entry id is `0-n`, so position n is looked up directly
- `{p}:owner:{sid}`  String; the owning worker's id
- `{p}:worker:{wid}` String with a TTL of `worker_ttl_s` (WORKER_TTL_S); the worker's URL (its heartbeat)
- `{p}:snap:{sid}`   String; the session's latest snapshot (JSON)
- `{p}:sessions`     Sorted set; session id scored by its snapshot's time (the dashboard list)
- `{p}:cluster:secret` String; what workers put on adoption requests to each other (streamer.adoption)
- `{p}:blob:{d}`     String; a blob (base64), content-addressed by its sha256 `d`: it expires
                     `retention_s` after its put unless a log names it (then it is persisted)
- `{p}:refs:{sid}`   Set; the blobs the session's log names
- `{p}:users:{d}`    Set; the sessions whose logs name blob d. Compaction (a checkpoint) and a
                     close let go of a session's blobs: one no session names any more expires
                     after the retention time (an earlier checkpoint's K/V at once)

A log is compacted at each checkpoint (`compact`, one script): positions 2 .. checkpoint-1 go,
the rest keep their positions (the stream's ids), so the last position is the last entry's id,
not the stream's length. The scripts build blob key names from the prefix (one Redis, not a
Redis Cluster).

Appends and claims are Lua scripts, so they are atomic: an append succeeds only while this
worker owns the session (a worker that was presumed dead and came back cannot write into a
log another worker adopted: fencing without home-made consensus), and a claim succeeds only
when the session has no owner, or an owner whose heartbeat key has expired. A successful beat
is this worker's lease until shortly before its key could expire (`lease_lapsed`): a worker
whose lease lapsed (paused, stalled) beats again before it serves a session, and learns then
which of its sessions another worker adopted (streamer.resume.Resumer.fence).

An append names its position n and record id: it is idempotent by (session, n), so a write
that timed out (and may have landed) is retried or read back without duplicating a record or
leaving a gap. An append to a session of which Redis knows nothing (no owner entry, no log:
Redis restarted empty) raises StoreLost, and the event log re-claims the session.

Every Redis error becomes a StoreError. Commands time out after `socket_timeout` seconds
(default 5; `?socket_timeout=` in the URL), so a stalled Redis fails writes instead of hanging.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .store_base import (DEFAULT_RETENTION_S, Conflict, LogGap, NotOwner, Store, StoreError, StoreLost,
                         _check_digest)

DEFAULT_SOCKET_TIMEOUT_S = 5.0
LEASE_MARGIN_S = 0.5  # a lease is trusted until this long before the heartbeat key's TTL runs out

_APPEND = """
local owner = redis.call('GET', KEYS[2])
if not owner then
  if redis.call('EXISTS', KEYS[1]) == 0 then return {-4} end
  return {-1}
end
if owner ~= ARGV[2] then return {-1} end
local len = 0
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if #last > 0 then len = tonumber(string.match(last[1][1], '-(%d+)$')) end
local n = tonumber(ARGV[3])
if n == 0 then n = len + 1 end
if n <= len then
  local at = redis.call('XRANGE', KEYS[1], '0-' .. n, '0-' .. n)
  local holder = ''
  if #at > 0 then
    local f = at[1][2]
    for k = 1, #f, 2 do if f[k] == 'i' then holder = f[k + 1] end end
  end
  if holder ~= '' and holder == ARGV[4] then return {n} end
  return {-2, holder}
end
if n > len + 1 and ARGV[7] ~= '1' then return {-3, len} end
redis.call('XADD', KEYS[1], '0-' .. n, 'n', n, 'r', ARGV[1], 'i', ARGV[4])
if ARGV[5] ~= '' then
  redis.call('SADD', KEYS[3], ARGV[5])
  redis.call('SADD', KEYS[4], ARGV[6])
  redis.call('PERSIST', KEYS[5])
end
return {n}
"""

# Compaction: drop positions 2 .. upto-1 (the creation stays, replay starts at the checkpoint at
# `upto`), then let go of the blobs the session no longer names (ARGV[5..]: those it still
# names): a blob no session names any more expires after the retention time (ARGV[4]);
# `superseded` ones (earlier checkpoints' K/V, ARGV[3], comma separated) go now.
_COMPACT = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return -1 end
local upto = tonumber(ARGV[2])
local dropped = 0
while upto > 2 do
  local batch = redis.call('XRANGE', KEYS[1], '0-2', '0-' .. (upto - 1), 'COUNT', 512)
  if #batch == 0 then break end
  local ids = {}
  for i, e in ipairs(batch) do ids[i] = e[1] end
  dropped = dropped + redis.call('XDEL', KEYS[1], unpack(ids))
end
local keep = {}
for i = 7, #ARGV do keep[ARGV[i]] = true end
local gone = {}
for d in string.gmatch(ARGV[3], '[^,]+') do gone[d] = true end
for _, d in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  if not keep[d] then
    redis.call('SREM', KEYS[3], d)
    local users = ARGV[6] .. 'users:' .. d
    redis.call('SREM', users, ARGV[5])
    if redis.call('SCARD', users) == 0 then
      if gone[d] then redis.call('DEL', ARGV[6] .. 'blob:' .. d)
      else redis.call('EXPIRE', ARGV[6] .. 'blob:' .. d, tonumber(ARGV[4])) end
    end
  end
end
return dropped
"""

# A blob some log names stays without a TTL when it is put again.
_PUT_BLOB = """
if redis.call('SCARD', KEYS[2]) > 0 then redis.call('SET', KEYS[1], ARGV[1]) return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
return 0
"""

# A closed session's blobs: each one no other session names expires with the log (ARGV[1] s).
_RELEASE_BLOBS = """
for _, d in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local users = ARGV[3] .. 'users:' .. d
  redis.call('SREM', users, ARGV[2])
  if redis.call('SCARD', users) == 0 then redis.call('EXPIRE', ARGV[3] .. 'blob:' .. d, tonumber(ARGV[1])) end
end
redis.call('EXPIRE', KEYS[1], tonumber(ARGV[1]))
return 0
"""

_CLAIM = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] and redis.call('EXISTS', ARGV[2] .. owner) == 1 then return owner end
redis.call('SET', KEYS[1], ARGV[1])
return false
"""


SCHEMES = ("redis", "rediss", "unix")
DEFAULT_PREFIX = "streamer"


def split_url(url: str) -> tuple[str, str]:
    """The Redis client's URL and the key prefix of a store URL: `redis://host:port/db`,
    `rediss://...` or `unix:///path/redis.sock?db=N`, with `?prefix=NAME` (ours, default
    `streamer`; the client never sees it). Raises ValueError saying what is malformed: the
    Redis client reads a db path that is not a number as db 0, so a typo would silently share
    db 0; a db must be a non-negative integer, a port a number."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{parts.scheme or 'no'} scheme: use redis://host:port/db, rediss://... or "
                         "unix:///path/redis.sock?db=N")
    query = parse_qsl(parts.query, keep_blank_values=True)
    prefixes = [v for k, v in query if k == "prefix"]
    prefix = prefixes[-1] if prefixes else DEFAULT_PREFIX
    if not prefix:
        raise ValueError("?prefix= is empty: name the key prefix, e.g. ?prefix=streamer")
    rest = [(k, v) for k, v in query if k != "prefix"]
    dbs = [v for k, v in rest if k == "db"]
    if parts.scheme == "unix":
        if not parts.path.strip("/"):
            raise ValueError("no socket path: use unix:///path/to/redis.sock?db=N")
    else:
        try:
            _ = parts.port  # raises for a port that is not a number in range
        except ValueError:
            host_port = parts.netloc.rpartition("@")[2]
            raise ValueError(f"the port in {host_port!r} is not a number in 1..65535: use "
                             "redis://host:port/db, e.g. redis://127.0.0.1:6379/0") from None
        if parts.path not in ("", "/"):
            dbs.insert(0, unquote(parts.path[1:]))
    for db in dbs:
        if not (db.isascii() and db.isdigit()):
            raise ValueError(f"the db {db!r} is not a non-negative integer: use redis://host:port/N "
                             "(N: 0, 1, ...; 0 when left out)")
    if len(set(map(int, dbs))) > 1:
        raise ValueError(f"two dbs ({', '.join(dbs)}): give the db once, as the path or as ?db=")
    plain = urlunsplit(parts._replace(query=urlencode(rest)))
    if parts.scheme == "unix":  # urlunsplit writes unix:/path, which the Redis client refuses
        plain = "unix://" + plain.removeprefix("unix:").removeprefix("//")
    return plain, prefix


class RedisStore(Store):
    kind = "redis"

    def __init__(self, url: str, prefix: str = "streamer", worker_id: str | None = None,
                 retention_s: float = DEFAULT_RETENTION_S) -> None:
        super().__init__(worker_id, retention_s)
        try:
            url, _ = split_url(url)  # open_store passed ?prefix= as `prefix`
        except ValueError as exc:
            raise StoreError(f"bad Redis URL: {exc}") from None
        self.url = url
        self.prefix = prefix
        options = {} if "socket_timeout" in url else {"socket_timeout": DEFAULT_SOCKET_TIMEOUT_S}
        if "socket_connect_timeout" not in url:
            options["socket_connect_timeout"] = DEFAULT_SOCKET_TIMEOUT_S
        # A pooled connection that Redis closed (it restarted) fails on its next use: that command
        # is sent once more on a new connection. Every write here is idempotent (appends by
        # position and record id, SETs), so a resend never duplicates; a timeout is not resent
        # (a stalled Redis fails the write within socket_timeout, as documented).
        options["retry"] = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self.redis = redis.Redis.from_url(url, decode_responses=True, **options)
        self._append = self.redis.register_script(_APPEND)
        self._claim = self.redis.register_script(_CLAIM)
        self._compact = self.redis.register_script(_COMPACT)
        self._put_blob = self.redis.register_script(_PUT_BLOB)
        self._release_blobs = self.redis.register_script(_RELEASE_BLOBS)
        self._locks: dict[str, asyncio.Lock] = {}
        self._closed = False
        self._beaten = False  # a heartbeat has been written (a later one that finds none: forgotten)
        self._lease_until = float("-inf")  # no beat yet (store_base.lease_lapsed)

    def key(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    async def start(self) -> "RedisStore":
        try:
            await self.redis.ping()
        except redis.RedisError as exc:
            raise StoreError(f"cannot reach Redis at {self.url}: {exc}") from None
        await self.heartbeat()
        return self

    async def heartbeat(self) -> bool:
        # The previous value comes back with the write: none after an earlier beat means the
        # key vanished before its TTL (a beat is due every HEARTBEAT_S < WORKER_TTL_S): Redis
        # restarted empty, or this worker stalled past its TTL.
        sent = time.monotonic()  # the key lives WORKER_TTL_S from when Redis runs the SET: later than this
        try:
            before = await self._do(self.redis.set(self.key("worker", self.worker_id), self.worker_url or "",
                                                   px=int(self.worker_ttl_s * 1000), get=True))
        except StoreError:
            self._beat_failed_at = time.monotonic()
            raise
        self._lease_until = sent + self.worker_ttl_s - LEASE_MARGIN_S
        forgotten = before is None and self._beaten
        self._beaten = True
        return forgotten

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.redis.delete(self.key("worker", self.worker_id))  # a clean exit: adoptable now
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self.url}: {exc}") from None
        finally:
            await self.redis.aclose()

    # ---- blobs: `blob:<digest>`, base64 (the client decodes responses), expiring -----------

    async def put_blob(self, digest: str, data: bytes) -> None:
        _check_digest(digest)
        text = base64.b64encode(data).decode()
        await self._do(self._put_blob(keys=[self.key("blob", digest), self.key("users", digest)],
                                      args=[text, max(1, int(self.retention_s))]))

    async def get_blob(self, digest: str, take: bool = False) -> bytes | None:
        _check_digest(digest)
        key = self.key("blob", digest)
        text = await self._do(self.redis.getdel(key) if take else self.redis.get(key))
        return base64.b64decode(text) if text is not None else None

    # ---- event log ------------------------------------------------------------------------

    async def append(self, session_id: str, record: dict, n: int | None = None, rid: str | None = None) -> int:
        # One writer per session at a time, in call order (asyncio locks are FIFO), so the log
        # order is the order of the calls.
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            data = json.dumps({**record, "session_id": session_id}, ensure_ascii=False, separators=(",", ":"))
            blob = record.get("blob") if isinstance(record.get("blob"), str) else ""
            if blob:
                _check_digest(blob)
            out = await self._do(self._append(
                keys=[self.key("log", session_id), self.key("owner", session_id), self.key("refs", session_id),
                      self.key("users", blob), self.key("blob", blob)],
                args=[data, self.worker_id, n or 0, rid or "", blob, session_id,
                      "1" if record.get("kind") == "checkpoint" else ""]))
        code = int(out[0])
        if code == -1:
            raise NotOwner(f"worker {self.worker_id} no longer owns session {session_id}")
        if code == -4:
            raise StoreLost(f"Redis at {self.url} knows nothing of session {session_id} (restarted empty?)")
        if code == -2:
            raise Conflict(f"position {n} of the log of session {session_id} holds record {out[1] or '?'}",
                           out[1] or None)
        if code == -3:
            raise LogGap(f"log of session {session_id} has {out[1]} records; cannot write position {n}")
        return code

    async def _do(self, awaitable):
        try:
            return await awaitable
        except redis.RedisError as exc:
            raise StoreError(f"Redis at {self.url}: {exc}") from None

    async def log_length(self, session_id: str) -> int:
        """The position of the last record (0: no log); a compacted log holds fewer."""
        last = await self._do(self.redis.xrevrange(self.key("log", session_id), count=1))
        return int(last[0][0].split("-")[1]) if last else 0

    async def compact(self, session_id: str, upto: int, superseded: tuple[str, ...] = ()) -> int:
        """Drop positions 2 .. upto-1 atomically (one script, only while this worker owns the
        session); blobs the kept records no longer name are let go (see `_COMPACT`)."""
        kept = await self.read_log(session_id)
        named = sorted({r["blob"] for r in kept if (r["n"] == 1 or r["n"] >= upto) and isinstance(r.get("blob"), str)})
        for digest in superseded:
            _check_digest(digest)
        out = await self._do(self._compact(
            keys=[self.key("log", session_id), self.key("owner", session_id), self.key("refs", session_id)],
            args=[self.worker_id, upto, ",".join(superseded), max(1, int(self.retention_s)), session_id,
                  self.key(""), *named]))
        if int(out) < 0:
            raise NotOwner(f"worker {self.worker_id} no longer owns session {session_id}")
        return int(out)

    async def read_log(self, session_id: str) -> list[dict]:
        return [record_of(fields) for _, fields in await self._do(self.redis.xrange(self.key("log", session_id)))]

    async def record_at(self, session_id: str, n: int) -> dict | None:
        at = await self._do(self.redis.xrange(self.key("log", session_id), f"0-{n}", f"0-{n}"))
        return record_of(at[0][1]) if at else None

    async def closed(self, session_id: str) -> None:
        ttl = max(1, int(self.retention_s))
        pipe = self.redis.pipeline()
        for kind in ("log", "snap", "owner"):
            pipe.expire(self.key(kind, session_id), ttl)
        await self._do(pipe.execute())
        await self._do(self._release_blobs(keys=[self.key("refs", session_id)], args=[ttl, session_id, self.key("")]))
        self._locks.pop(session_id, None)

    # ---- directory ------------------------------------------------------------------------

    async def claim(self, session_id: str) -> str | None:
        owner = await self._do(self._claim(keys=[self.key("owner", session_id)],
                                           args=[self.worker_id, self.key("worker", "")]))
        return owner or None

    async def owner(self, session_id: str) -> dict | None:
        worker = await self._do(self.redis.get(self.key("owner", session_id)))
        if worker is None:
            return None
        url = await self._do(self.redis.get(self.key("worker", worker)))
        return {"worker": worker, "url": url or None, "alive": url is not None}

    async def release(self, session_id: str) -> None:
        key = self.key("owner", session_id)
        if await self._do(self.redis.get(key)) == self.worker_id:
            await self._do(self.redis.delete(key))

    # ---- snapshots ------------------------------------------------------------------------

    async def put_snapshot(self, session_id: str, snapshot: dict) -> None:
        pipe = self.redis.pipeline()
        pipe.set(self.key("snap", session_id), json.dumps(snapshot, separators=(",", ":")))
        pipe.zadd(self.key("sessions"), {session_id: snapshot.get("updated_at") or time.time()})
        await self._do(pipe.execute())

    async def snapshot(self, session_id: str) -> dict | None:
        data = await self._do(self.redis.get(self.key("snap", session_id)))
        return json.loads(data) if data else None

    async def snapshots(self, limit: int = 500) -> list[dict]:
        ids = await self._do(self.redis.zrevrange(self.key("sessions"), 0, limit - 1))
        if not ids:
            return []
        values = await self._do(self.redis.mget([self.key("snap", sid) for sid in ids]))
        gone = [sid for sid, v in zip(ids, values) if v is None]
        if gone:  # expired by retention: drop them from the list too
            await self._do(self.redis.zrem(self.key("sessions"), *gone))
        return [json.loads(v) for v in values if v is not None]


def record_of(fields: dict) -> dict:
    record = json.loads(fields["r"])
    record["n"] = int(fields["n"])
    if fields.get("i"):
        record["rid"] = fields["i"]
    return record
