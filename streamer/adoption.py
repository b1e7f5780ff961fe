"""Failover without the client: a dead worker's sessions are adopted by the worker the proxy
now routes them to, before their clients come back (docs/cluster.md).

Every worker sharing a Redis store looks, every `interval_s`, for open sessions whose owner's
heartbeat key has expired (`orphans`). Which worker takes one is the proxy's choice,
not ours: the finder asks the proxy itself, with `GET /cluster/adopt?session=<route key>&sid=<id>`
through the public address. The proxy hashes that request on the same URL parameter as the
session's websocket connections, so it reaches exactly the worker that the session's clients
will reach; that worker adopts the session (claim in the directory, replay of its log:
streamer.resume.Resumer.recover with `adopt`), its flash questions and MQTT topics go on, and
it waits detached for its producer. Whatever the proxy (HAProxy, nginx, a Kubernetes gateway)
and its hash, nobody has to compute it twice, and a resume finds the session already there:
no `moved` round trip.

The route key is what the client put in `?session=`: the id it chose at `session.create`
(without the `<key name>:` prefix a server with API keys adds). Requests carry the cluster's
secret (`X-Streamer-Adopt`), kept in Redis, so nobody outside makes a worker adopt anything.

Only workers given the proxy's URL (`--proxy-url`) on a Redis store do this; without a proxy a
dead worker's session is adopted by whichever worker its client resumes on (streamer.resume).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import parse_qs, quote, urlsplit

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from .redis_store import record_of

log = logging.getLogger(__name__)

ADOPT_PATH = "/cluster/adopt"
SECRET_HEADER = "X-Streamer-Adopt"
DEFAULT_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0


def route_key(session_id: str, key_name: str | None) -> str:
    """What a session's clients put in `?session=`: the id as its creator chose it."""
    prefix = f"{key_name}:" if key_name else ""
    return session_id[len(prefix):] if prefix and session_id.startswith(prefix) else session_id


class Adopter:
    """Finds orphaned sessions, asks the proxy which worker takes each, adopts those it is given."""

    def __init__(self, store, recover: Callable, proxy_url: str, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.store = store
        self.recover = recover  # (session id) -> awaitable of {records, ...}, None when live here already
        self.proxy = _http_address(proxy_url)
        self.interval_s = interval_s
        self.secret: str | None = None
        self._probing: dict[str, asyncio.Task] = {}  # session id -> request to the proxy in flight
        self._adopting: dict[str, asyncio.Task] = {}  # session id -> adoption in flight here
        self.counters = {"orphans_seen": 0, "adopt_requests": 0}

    async def run(self) -> None:
        self.secret = await cluster_secret(self.store)
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # a Redis hiccup: look again next time
                log.warning("looking for orphaned sessions: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def sweep(self) -> None:
        for sid, key_name in await orphans(self.store):
            if sid in self._probing or sid in self._adopting:
                continue
            self.counters["orphans_seen"] += 1
            _start(self._probing, sid, self._probe(sid, route_key(sid, key_name)))

    async def _adopt(self, sid: str) -> None:
        try:
            result = await self.recover(sid)
            if result is None:
                return  # live here already
            log.info("adopted session %s of a dead worker (%d log records)", sid, result["records"])
        except Exception as exc:  # another worker claimed it first, or it closed: nothing to do
            log.info("did not adopt session %s: %s", sid, getattr(exc, "message", exc))

    async def _probe(self, sid: str, route: str) -> None:
        host, port, base = self.proxy
        target = f"{base}{ADOPT_PATH}?session={quote(route, safe='')}&sid={quote(sid, safe='')}"
        request = (f"GET {target} HTTP/1.1\r\nHost: {host}:{port}\r\n{SECRET_HEADER}: {self.secret}\r\n"
                   "Connection: close\r\n\r\n").encode()
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), PROBE_TIMEOUT_S)
            try:
                writer.write(request)
                status = (await asyncio.wait_for(reader.readline(), PROBE_TIMEOUT_S)).decode(errors="replace")
            finally:
                writer.close()
            if " 202 " not in status:
                log.info("adoption request for session %s through %s:%d: %s", sid, host, port, status.strip())
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot reach the proxy at %s:%d to hand session %s over: %s", host, port, sid, exc)

    def handle(self, request: Request) -> Response:
        """`GET /cluster/adopt?session=..&sid=..` routed here by the proxy: adopt `sid`."""
        given = request.headers.get(SECRET_HEADER, "")
        if self.secret is None or not hmac.compare_digest(given.encode(), self.secret.encode()):
            return _json(HTTPStatus.FORBIDDEN, {"error": "adoption requests come from workers of this cluster"})
        sid = (parse_qs(urlsplit(request.path).query).get("sid") or [""])[0]
        if not sid:
            return _json(HTTPStatus.BAD_REQUEST, {"error": "sid= names the session to adopt"})
        self.counters["adopt_requests"] += 1
        if sid not in self._adopting:
            _start(self._adopting, sid, self._adopt(sid))
        return _json(HTTPStatus.ACCEPTED, {"worker": self.store.worker_id, "session_id": sid})

    def stop(self) -> None:
        for task in [*self._probing.values(), *self._adopting.values()]:
            task.cancel()


def _start(tasks: dict[str, asyncio.Task], sid: str, job) -> None:
    task = tasks[sid] = asyncio.get_running_loop().create_task(job)
    task.add_done_callback(lambda _t: tasks.pop(sid, None))


# ---- what Redis says (streamer.redis_store's keys) ---------------------------------------------


async def orphans(store, limit: int = 1000) -> list[tuple[str, str | None]]:
    """Up to `limit` open sessions of a RedisStore whose owner's heartbeat key has expired, each
    with the API key name that created it (None: none): [(session id, key name)]. Closed ones
    (their log ends with a close) are left out."""
    owner_keys = []
    async for key in store.redis.scan_iter(match=store.key("owner", "*"), count=500):
        owner_keys.append(key)
    if not owner_keys:
        return []
    owners = await store._do(store.redis.mget(owner_keys))
    workers = sorted({w for w in owners if w})
    alive = dict(zip(workers, await store._do(store.redis.mget([store.key("worker", w) for w in workers]))))
    start = len(store.key("owner", ""))
    dead = [key[start:] for key, w in zip(owner_keys, owners) if w and alive.get(w) is None][:limit]
    if not dead:
        return []
    pipe = store.redis.pipeline()
    for sid in dead:
        pipe.xrange(store.key("log", sid), count=1)
        pipe.xrevrange(store.key("log", sid), count=1)
    ends = await store._do(pipe.execute())
    out = []
    for i, sid in enumerate(dead):
        first, last = ends[2 * i], ends[2 * i + 1]
        if not first or record_of(last[0][1]).get("kind") == "close":
            continue
        out.append((sid, record_of(first[0][1]).get("key")))
    return out


async def cluster_secret(store) -> str:
    """The secret the workers sharing this Redis put on adoption requests (made by the first)."""
    await store._do(store.redis.set(store.key("cluster", "secret"), secrets.token_hex(16), nx=True))
    return await store._do(store.redis.get(store.key("cluster", "secret")))


def check_proxy_url(url: str, store_url: str | None) -> None:
    """ValueError saying what is wrong with `--proxy-url` (adoption needs a shared Redis store)."""
    _http_address(url)
    if not (store_url or "").startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("workers behind a proxy share a Redis store: add --store redis://host:port/db")


def _http_address(url: str) -> tuple[str, int, str]:
    """(host, port, path prefix) of the proxy's URL (ws://, http://; wss/https are not spoken
    here: give the proxy's plain address on the workers' network)."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "http") or not parts.hostname:
        raise ValueError(f"proxy URL {url!r}: use ws://host:port or http://host:port (the address workers reach it at)")
    return parts.hostname, parts.port or 80, parts.path.rstrip("/")


def _json(status: HTTPStatus, body: dict) -> Response:
    data = json.dumps(body).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, data)
