"""One address in front of three workers, and failover without the client (docs/cluster.md).

Real parts: HAProxy (the Debian package) on a port chosen at run time, three `streamer serve`
worker processes (tiny seeded model) sharing a Redis under a key prefix of this module's own.

- Every connection of a session, through the one URL with ?session=<id>, reaches the worker
  that owns it: a resume there finds it live (nothing replayed, never `moved`).
- kill -9 of the worker holding the most sessions: every session answers again through the same
  URL; the surviving worker the proxy now routes each to adopted it on its own (before its
  client came back); no acknowledged input is lost or doubled in the logs; answers equal those
  of a control session that saw the same input and never moved; flash answers keep coming, to
  the producer and to a read-only watcher that re-subscribed through the same URL.
- The workers publish to the real Mosquitto under a topic prefix of this run's own. After the
  kill, before any client is back, the adopting worker publishes the moved sessions' retained
  MQTT state and writes their dashboard snapshots (Redis, and `sessions.list` through the
  proxy) as their new owner, detached; later the flash answers and the action chunks of a
  session whose client came back and started its actions again go on over MQTT from it, and
  the snapshots follow the rows sent after the failover.
"""

import asyncio
import http.client
import json
import shutil
import socket
import subprocess
import uuid

import pytest
from redisutil import redis_server  # noqa: F401  (fixture)
from wsutil import raw

from mqttutil import clear_retained

from streamer.clients.failover import ClusterSession, ClusterWatcher, routed_url
from streamer.adoption import route_key
from streamer.cluster import LocalCluster, haproxy_config

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (apt-get install haproxy; .ci/run does)")

SYSTEM = "You are a harbour master's assistant."
ROWS = [f"row {i}: buoy {i % 3} reads {17 + i} knots from the {'north' if i % 2 else 'west'}. " for i in range(1, 9)]
FLASH = [{"question": "How fast is the wind?", "max_tokens": 6, "end_bias": 0.0, "frequency_penalty": 0.0}]
QUESTION = {"max_tokens": 8, "end_bias": 0.0, "frequency_penalty": 0.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(redis_server, broker):  # noqa: F811
    import redis

    prefix = f"streamer-cluster-{uuid.uuid4().hex[:8]}"
    with LocalCluster(3, f"redis://{redis_server}/0?prefix={prefix}", f"127.0.0.1:{free_port()}",
                      ["--model", "tiny", "--threads", "1", "--detach-ttl", "600",
                       "--mqtt", broker, "--mqtt-prefix", prefix]) as c:
        c.redis = redis.Redis.from_url(f"redis://{redis_server}/0", decode_responses=True)
        c.prefix = prefix
        c.broker = broker
        yield c
    asyncio.run(clear_retained(broker, prefix))
    keys = list(c.redis.scan_iter(f"{prefix}:*"))
    if keys:
        c.redis.delete(*keys)
    c.redis.close()


def owner(cluster, sid: str) -> str:
    return cluster.redis.get(f"{cluster.prefix}:owner:{sid}")


def snapshot(cluster, sid: str) -> dict | None:
    text = cluster.redis.get(f"{cluster.prefix}:snap:{sid}")
    return None if text is None else json.loads(text)


class MqttTap:
    """Every message the workers publish under the cluster's MQTT prefix, as (topic leaf, session
    id, message), collected in the background from a real subscriber."""

    def __init__(self, cluster) -> None:
        self.prefix, self.broker = cluster.prefix, cluster.broker
        self.messages: list[tuple[str, str, dict]] = []
        self.subscribed = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        import aiomqtt

        from streamer.mqtt import parse_url

        host, port = parse_url(self.broker)
        async with aiomqtt.Client(host, port) as client:
            await client.subscribe(f"{self.prefix}/sessions/#", qos=1)
            self.subscribed.set()
            async for message in client.messages:
                if message.payload:
                    parts = str(message.topic).split("/")
                    self.messages.append((parts[-1], parts[-2], json.loads(message.payload)))

    async def until(self, match, timeout: float = 60) -> tuple[str, str, dict]:
        """The first message (seen so far or to come) that `match(leaf, sid, message)` accepts."""
        async def wait():
            seen = 0
            while True:
                for m in self.messages[seen:]:
                    if match(*m):
                        return m
                seen = len(self.messages)
                await asyncio.sleep(0.1)

        return await asyncio.wait_for(wait(), timeout)

    async def close(self) -> None:
        self.task.cancel()
        try:
            await self.task
        except asyncio.CancelledError:
            pass


async def listed(cluster) -> dict[str, dict]:
    """The dashboard's session list through the proxy (any worker answers): {session id: snapshot}."""
    peer = await raw(cluster.url)
    reply = await peer.request({"type": "sessions.list"})
    await peer.ws.close()
    assert reply["type"] == "sessions", reply
    return {snap["session_id"]: snap for snap in reply["sessions"]}


def logged_client_seqs(cluster, sid: str) -> list[int]:
    entries = cluster.redis.xrange(f"{cluster.prefix}:log:{sid}")
    return [json.loads(f["r"]).get("client_seq") for _, f in entries if json.loads(f["r"]).get("kind") == "append"]


def test_generated_haproxy_config_is_valid(tmp_path):
    path = tmp_path / "haproxy.cfg"
    path.write_text(haproxy_config(["127.0.0.1:8701", "127.0.0.1:8702"]))
    check = subprocess.run(["haproxy", "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "balance url_param session" in path.read_text() and "hash-type consistent" in path.read_text()
    with pytest.raises(ValueError, match="host:port"):
        haproxy_config(["no-port"])


def test_route_key_is_the_id_the_client_chose():
    assert route_key("tenant:cam-1", "tenant") == "cam-1"
    assert route_key("cam-1", None) == "cam-1"
    assert route_key("other:cam-1", "tenant") == "other:cam-1"


def test_adoption_requests_need_the_cluster_secret(cluster):
    host, port = cluster.bind.rsplit(":", 1)
    for headers in ({}, {"X-Streamer-Adopt": "guess"}):
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request("GET", "/cluster/adopt?session=x&sid=x", headers=headers)
        reply = conn.getresponse()
        assert reply.status == 403, reply.status
        assert "workers of this cluster" in json.loads(reply.read())["error"]
        conn.close()


def test_every_connection_of_a_session_reaches_its_owner(cluster):
    async def main():
        created = {}
        for i in range(9):
            sid = f"route-{i}"
            peer = await raw(routed_url(cluster.url, sid))
            created[sid] = await peer.request({"type": "session.create", "session_id": sid, "system_prompt": SYSTEM})
            assert created[sid]["type"] == "session.created", created[sid]
            await peer.ws.close()
        owners = {sid: owner(cluster, sid) for sid in created}
        assert len(set(owners.values())) > 1, f"the proxy sent every session to one worker: {owners}"
        for sid, event in created.items():  # a second connection finds it live where it is
            peer = await raw(routed_url(cluster.url, sid))
            resumed = await peer.request({"type": "session.resume", "session_id": sid,
                                          "token": event["tokens"]["producer"]})
            assert resumed["type"] == "session.resumed", resumed
            assert resumed["replayed_records"] == 0 and resumed["worker"] == owners[sid], (resumed, owners[sid])
            await peer.request({"type": "session.close", "session_id": sid})
            await peer.ws.close()

    asyncio.run(main())


def test_kill9_failover_through_the_same_url(cluster):
    asyncio.run(_failover(cluster))


async def _failover(cluster):
    tap = MqttTap(cluster)
    await asyncio.wait_for(tap.subscribed.wait(), 10)
    try:
        await _kill_and_check(cluster, tap)
    finally:
        await tap.close()


async def _kill_and_check(cluster, tap):
    sessions = [await ClusterSession.create(cluster.url, session_id=f"feed-{i}", system_prompt=SYSTEM,
                                            flash=[dict(q) for q in FLASH]) for i in range(9)]
    for row in ROWS[:4]:
        for s in sessions:
            await s.append(row)
    owners = {s.id: owner(cluster, s.id) for s in sessions}
    assert len(set(owners.values())) > 1, f"the proxy sent every session to one worker: {owners}"
    victim = max(set(owners.values()), key=list(owners.values()).count)
    moving = [s for s in sessions if owners[s.id] == victim]
    watched = moving[0]
    watcher = await ClusterWatcher.subscribe(cluster.url, watched.id, watched.session.subscribe_token)
    cluster.kill(int(victim.split("-")[0][1:]) - 1)

    # adopted with no client asking: the owner changes while every client is silent
    async def adopted():
        while any(owner(cluster, s.id) in (victim, None) for s in moving):
            await asyncio.sleep(0.2)

    await asyncio.wait_for(adopted(), 60)
    adopters = {s.id: owner(cluster, s.id) for s in moving}
    # MQTT and dashboards go on from the adopter before any client is back: its retained state
    # says so, and the snapshot in Redis and in the dashboard's list names it, detached
    for s in moving:
        await tap.until(lambda leaf, sid, m, s=s: leaf == "state" and sid == s.id
                        and m["worker"] == adopters[s.id] and m["status"] == "detached")

    async def snapshots_moved():
        while True:
            snaps = {s.id: snapshot(cluster, s.id) for s in moving}
            if all(snap and snap["owner"] == adopters[sid] and snap["detached"] for sid, snap in snaps.items()):
                return
            await asyncio.sleep(0.2)

    await asyncio.wait_for(snapshots_moved(), 60)
    dashboard = await listed(cluster)
    for s in moving:
        assert dashboard[s.id]["owner"] == adopters[s.id] and dashboard[s.id]["last_client_seq"] == 4, dashboard[s.id]
    for s in moving:
        assert s.reconnects == 0  # nobody has touched them yet

    for row in ROWS[4:]:
        for s in sessions:
            await s.append(row)
    answers = {s.id: (await s.ask("How fast is the wind at buoy 2?", **QUESTION)).text for s in sessions}
    control = await ClusterSession.create(cluster.url, session_id="control", system_prompt=SYSTEM,
                                          flash=[dict(q) for q in FLASH])
    for row in ROWS:
        await control.append(row)
    expected = (await control.ask("How fast is the wind at buoy 2?", **QUESTION)).text
    assert answers == {s.id: expected for s in sessions}

    for s in sessions:  # every acknowledged input logged exactly once, in order
        assert logged_client_seqs(cluster, s.id) == list(range(1, len(ROWS) + 1)), s.id
        assert owner(cluster, s.id) != victim
    assert all(s.reconnects >= 1 for s in moving)

    # flash answers keep being evaluated on the adopted sessions, up to the last row
    async def current(s):
        while True:
            state = await s.state()
            if state["flash"][0].get("data_version", -1) >= state["data_version"]:
                return
            await asyncio.sleep(0.1)

    for s in moving:
        await asyncio.wait_for(current(s), 60)
    # and pushed from the adopting worker: the watcher re-subscribed through the same URL and is
    # sent the first answer of a question registered after the failover
    seen = []

    async def resubscribed():
        async for event in watcher.events():
            seen.append(event)
            if [e["type"] for e in seen].count("watcher.subscribed") >= 2:
                return

    await asyncio.wait_for(resubscribed(), 60)
    flash = await watched.register_flash("Which buoy reads the most?", max_tokens=4, end_bias=0.0,
                                         frequency_penalty=0.0)

    async def pushed():
        async for event in watcher.events():
            seen.append(event)
            if event["type"] == "flash.updated" and event["flash_id"] == flash["flash_id"]:
                return event

    assert (await asyncio.wait_for(pushed(), 60))["session_id"] == watched.id
    # the same flash answer went out over MQTT, from the adopter
    await tap.until(lambda leaf, sid, m: leaf == "flash" and sid == watched.id and m["type"] == "flash.updated"
                    and m["flash_id"] == flash["flash_id"])

    # the dashboards follow the rows sent after the failover, from the new owners
    async def snapshots_current():
        while True:
            snaps = {s.id: snapshot(cluster, s.id) for s in moving}
            if all(snap["owner"] == adopters[sid] and snap["last_client_seq"] == len(ROWS) and not snap["detached"]
                   for sid, snap in snaps.items()):
                return
            await asyncio.sleep(0.2)

    await asyncio.wait_for(snapshots_current(), 60)
    dashboard = await listed(cluster)
    assert all(dashboard[s.id]["owner"] == adopters[s.id] and dashboard[s.id]["last_client_seq"] == len(ROWS)
               for s in moving), {s.id: dashboard[s.id] for s in moving}

    # actions are not replayed: the client that came back starts them again and sends an
    # observation; the chunks go out over MQTT from the adopter, its retained state counts them
    started = await watched.session.client.request({"type": "action.start", "session_id": watched.id, "dt_ms": 20,
                                                     "horizon": 5, "mode": "async_rollforward"})
    assert started["type"] == "action.started", started
    await watched.append('{"target": [1.0, 0.5]}')  # an observation: the policy's input
    _, _, chunk = await tap.until(lambda leaf, sid, m: leaf == "actions" and sid == watched.id
                                  and m["type"] == "action.chunk")
    await tap.until(lambda leaf, sid, m: leaf == "state" and sid == watched.id and m["worker"] == adopters[sid]
                    and m["status"] == "live" and m.get("last_action_seq", 0) >= chunk["seq"])
    stopped = await watched.session.client.request({"type": "action.stop", "session_id": watched.id})
    assert stopped["type"] == "action.stopped", stopped

    await watcher.close()
    for s in [*sessions, control]:
        await s.close()


# ---- the JavaScript SDK through the proxy ----------------------------------------------------------



def test_the_js_sdk_fails_over_through_the_same_url(cluster):
    """The browser SDK, given the session's id (`session:` option: ?session=<id> on the URL the
    proxy hashes), streams through the proxy; kill -9 of the worker that owns its session: it
    reconnects through the same URL (never pinned to a worker's own address), resumes on the
    worker that adopted the session and resends what was not acked: every input is in the log
    once, in order."""
    from browserutil import Chromium, sdk_feed

    n, sid = 80, f"js-{uuid.uuid4().hex[:6]}"
    alive = [i for i, w in enumerate(cluster.workers) if w.poll() is None]
    assert len(alive) >= 2, "the cluster needs a worker left to adopt the session"
    browser = Chromium().start()

    async def run():
        async with browser.page() as page:
            await page.navigate(cluster.url.replace("ws://", "http://") + "/sdk/streamer.js")
            created = await page.eval(sdk_feed(cluster.url + "/", n, session=sid))
            assert created == sid
            await page.wait_for("window.t.acks >= 10", 60)
            victim = owner(cluster, sid)
            cluster.kill(int(victim.split("-")[0][1:]) - 1)  # SIGKILL with inputs in flight
            await page.wait_for("window.t.done", 240)
            home = await page.eval("[window.t.client.url, window.t.client.homeUrl]")
            return (victim, await page.eval("window.t.results"), await page.eval("window.t.resumed"),
                    await page.eval("window.t.session.unacked.size"), home)

    try:
        victim, results, resumed, unacked, (url, home) = asyncio.run(run())
    finally:
        browser.stop()
    assert all(r in ("ack", "duplicate") for r in results), results
    assert unacked == 0 and resumed is not None and resumed["session_id"] == sid
    assert url == home and f"session={sid}" in url  # it went back through the proxy's URL
    adopter = owner(cluster, sid)
    assert adopter not in (victim, None) and resumed["worker"] == adopter
    entries = cluster.redis.xrange(f"{cluster.prefix}:log:{sid}")
    appends = [json.loads(f["r"]) for _, f in entries]
    appends = [r for r in appends if r.get("kind") == "append"]
    assert [r["text"] for r in appends] == [f"piece {i}. " for i in range(n)]  # every input once, in order
    assert [r["client_seq"] for r in appends] == list(range(1, n + 1))


def test_the_app_page_fails_over_through_the_same_url(redis_server):  # noqa: F811
    """/app, loaded through the proxy of a cluster of its own (two workers): "New session" picks
    the id the proxy routes on, rows typed into the page go to the worker that owns it; kill -9
    of that worker while rows are still being sent: the page reconnects through the same URL,
    resumes on the worker that adopted the session (its note says so), resends what was not
    acked, and every row is in the log once, in order."""
    import redis
    from browserutil import Chromium, click, el, fill

    prefix = f"streamer-app-{uuid.uuid4().hex[:8]}"
    store = redis.Redis.from_url(f"redis://{redis_server}/0", decode_responses=True)
    rows = [f"app row {i}: the tide is {i} metres." for i in range(12)]
    with LocalCluster(2, f"redis://{redis_server}/0?prefix={prefix}", f"127.0.0.1:{free_port()}",
                      ["--model", "tiny", "--threads", "1", "--detach-ttl", "600"]) as c:
        browser = Chromium().start()

        async def send(page, row: str) -> None:
            await fill(page, "text-input", row)
            await click(page, "send-text")

        async def run():
            async with browser.page() as page:
                await page.navigate(c.url.replace("ws://", "http://") + "/app")
                await page.eval("localStorage.clear(); sessionStorage.clear()")
                await click(page, "create")
                sid = await page.wait_for(f"{el('sid')}.length > 8 && {el('sid')}", 60)
                assert sid.startswith("app-") and f"session={sid}" in await page.eval("streamerApp.client.url")
                for row in rows[:4]:
                    await send(page, row)
                await page.wait_for("streamerApp.session.unacked.size === 0", 60)
                victim = store.get(f"{prefix}:owner:{sid}")
                assert victim is not None
                c.kill(int(victim.split("-")[0][1:]) - 1)  # SIGKILL; the page goes on typing
                for row in rows[4:]:
                    await send(page, row)
                    await asyncio.sleep(0.2)
                await page.wait_for("streamerApp.session.unacked.size === 0", 180)
                note = await page.wait_for(f"{el('session-note')}.includes('reconnected') && {el('session-note')}", 30)
                status = await page.eval(el("conn"))
                urls = await page.eval("[streamerApp.client.url, streamerApp.client.homeUrl]")
                return sid, victim, note, status, urls

        try:
            sid, victim, note, status, (url, home) = asyncio.run(run())
        finally:
            browser.stop()
        assert "session resumed" in note and status == "live", (note, status)
        assert url == home and url.startswith(c.url) and f"session={sid}" in url  # through the proxy
        adopter = store.get(f"{prefix}:owner:{sid}")
        assert adopter not in (victim, None)
        appends = [json.loads(f["r"]) for _, f in store.xrange(f"{prefix}:log:{sid}")]
        appends = [r for r in appends if r.get("kind") == "append"]
        assert [r["text"] for r in appends] == [row + "\n" for row in rows]  # every row once, in order
    keys = list(store.scan_iter(f"{prefix}:*"))
    if keys:
        store.delete(*keys)
    store.close()
