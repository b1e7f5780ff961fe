"""API keys (operator and tenant roles) and per-session capability tokens over a real socket."""

import asyncio
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from websockets.exceptions import InvalidStatus

from streamer.auth import ApiKeys, KeysFileError, SessionTokens, key_from_request
from streamer.server import ServerConfig

from helpers import get_json, until
from wsutil import check_error, next_of, raw, serve

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-0123456789"
KEY_OPS = "ops-key-0123456789ab"


def keyed(**extra):
    return dict(api_keys=ApiKeys({"a": KEY_A, "b": KEY_B}), **extra)


def tenants(**extra):
    """Two tenant keys (a, b: a key without a role is a tenant) and an operator key."""
    return dict(api_keys=ApiKeys({"a": KEY_A, "b": KEY_B, "ops": KEY_OPS}, {"ops": "operator"}), **extra)


def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops\nops:0123456789abcdef01\n\nfedcba98765432100\n")
    keys = ApiKeys.from_file(path)
    assert keys.check("0123456789abcdef01") == "ops"
    assert keys.check("fedcba98765432100") == "key2"
    assert keys.check("nope") is None and keys.check(None) is None
    assert keys.role("ops") == keys.role("key2") == "tenant"  # a line without a role: a tenant
    path.write_text("ops:0123456789abcdef01   role=operator\nacme:0123456789abcdef02 role=tenant\n"
                    "fedcba98765432100\trole=operator\n")
    keys = ApiKeys.from_file(path)
    assert keys.check("0123456789abcdef01") == "ops" and keys.check("0123456789abcdef02") == "acme"
    assert keys.check("fedcba98765432100") == "key3"
    assert (keys.role("ops"), keys.role("acme"), keys.role("key3"), keys.role(None)) == \
        ("operator", "tenant", "operator", None)
    assert keys.roles() == {"operator": 2, "tenant": 1}
    for bad in ("short:abc\n", "", "x:0123456789abcdef01\nx:0123456789abcdef02\n",
                "x:0123456789abcdef01 role=admin\n", "x:0123456789abcdef01 role=\n", "x:short role=tenant\n"):
        path.write_text(bad)
        with pytest.raises(KeysFileError):
            ApiKeys.from_file(path)
    with pytest.raises(KeysFileError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "missing")
    # the example in docs/protocol.md parses to what the text around it says
    doc = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text()
    example = doc.split("```text\n# name:key [role=operator|tenant]\n", 1)[1].split("```", 1)[0]
    path.write_text(example)
    keys = ApiKeys.from_file(path)
    assert (len(keys), keys.role("ops"), keys.role("acme")) == (2, "operator", "tenant")
    with pytest.raises(ValueError, match="unknown key roles"):
        ApiKeys({"a": KEY_A}, {"a": "root"})
    with pytest.raises(ValueError, match="do not exist"):
        ApiKeys({"a": KEY_A}, {"b": "operator"})


def test_tokens_are_per_session_and_role():
    tokens = SessionTokens()
    a, b = tokens.issue("a"), tokens.issue("b")
    assert len({*a.values(), *b.values()}) == 6
    assert {tokens.role_of("a", t) for t in a.values()} == {"producer", "subscriber", "dashboard"}
    assert tokens.role_of("b", a["producer"]) is None  # a token opens its own session only
    assert tokens.role_of("a", "") is None and tokens.role_of("zz", a["producer"]) is None
    saved = tokens.export("a")
    assert all(len(d) == 64 and d not in a.values() for d in saved.values())  # digests, not secrets
    tokens.revoke("a")
    assert tokens.role_of("a", a["producer"]) is None
    tokens.restore("a", saved)
    assert tokens.role_of("a", a["dashboard"]) == "dashboard"


def test_key_from_request():
    assert key_from_request({"Authorization": "Bearer k1"}, "/") == "k1"
    assert key_from_request({"X-API-Key": "k2"}, "/") == "k2"
    assert key_from_request({}, "/?x=1&api_key=k3") == "k3"
    assert key_from_request({}, "/") is None


def test_api_keys_gate_session_creation(tiny_engine):
    async def test(url, server):
        anon = await raw(url)  # no key: may connect (to subscribe), may not create
        check_error(await anon.request({"type": "session.create"}), "unauthorized")
        with pytest.raises(InvalidStatus) as info:  # a wrong key is refused at the handshake
            await raw(url, api_key="wrong-key-0123456789")
        assert info.value.response.status_code == 401
        query_key = await raw(url + "/?api_key=" + KEY_B)
        assert (await query_key.request({"type": "session.create"}))["type"] == "session.created"
        alice = await raw(url, api_key=KEY_A)
        sid = await alice.create()
        await alice.still_serving(sid)
        # the anonymous connection keeps working, and reads with a token
        created = await alice.request({"type": "session.create"})
        sub = await anon.request({"type": "subscribe", "session_id": created["session_id"],
                                  "token": created["tokens"]["subscriber"]})
        assert sub["type"] == "subscribed"
        for peer in (anon, query_key, alice):
            await peer.ws.close()

    serve(tiny_engine, test, **keyed())


def test_sessions_per_key_limit(tiny_engine):
    async def test(url, server):
        a1, a2 = await raw(url, api_key=KEY_A), await raw(url, api_key=KEY_A)
        b = await raw(url, api_key=KEY_B)
        first = await a1.create()
        await a2.create()
        check_error(await a2.request({"type": "session.create"}), "too_many_sessions")  # across connections
        sid_b = await b.create()  # another key is not affected
        await b.still_serving(sid_b)
        await a1.request({"type": "session.close", "session_id": first})
        await a2.create()  # closing gave the slot back
        await a1.ws.close()
        await a2.ws.close()
        await until(lambda: server.directory.held("a") == 0, 5, "the key's sessions to close")  # connection gone
        a3 = await raw(url, api_key=KEY_A)
        await a3.create()
        await a3.ws.close()
        await b.ws.close()

    serve(tiny_engine, test, **keyed(sessions_per_key=2, detach_ttl_s=0))


def test_roles(tiny_engine):
    """Subscriber and dashboard tokens read but cannot write; no token reads another session."""

    async def test(url, server):
        prod = await raw(url)
        created = await prod.request({"type": "session.create"})
        sid, tokens = created["session_id"], created["tokens"]
        assert set(tokens) == {"producer", "subscriber", "dashboard"}
        assert created["subscribe_token"] == tokens["subscriber"]
        other = await prod.create()
        await prod.request({"type": "input.text.append", "session_id": sid, "text": "The tide is high."})
        for role in ("subscriber", "dashboard"):
            peer = await raw(url)
            assert (await peer.request({"type": "subscribe", "session_id": sid, "token": tokens[role]}))["type"] \
                == "subscribed"
            state = await peer.request({"type": "session.get", "session_id": sid})
            assert state["type"] == "state" and state["session"]["tokens"] > 0
            for msg in ({"type": "input.text.append", "session_id": sid, "text": "x"},
                        {"type": "input.text.revise", "session_id": sid, "text": "x"},
                        {"type": "query.create", "session_id": sid, "question": "q"},
                        {"type": "flash.register", "session_id": sid, "question": "q"},
                        {"type": "session.close", "session_id": sid},
                        {"type": "input.end", "session_id": sid}):
                check_error(await peer.request(msg), "forbidden")
            # the token does not open the other session, nor read it
            check_error(await peer.request({"type": "subscribe", "session_id": other, "token": tokens[role]}),
                        "session_not_found")
            check_error(await peer.request({"type": "session.get", "session_id": other}), "session_not_found")
            await peer.ws.close()
        await prod.still_serving(sid)
        closed = await prod.request({"type": "session.close", "session_id": sid})
        assert closed["type"] == "session.closed"
        late = await raw(url)  # tokens of a closed session stop working
        check_error(await late.request({"type": "subscribe", "session_id": sid, "token": tokens["subscriber"]}),
                    "session_not_found")
        await late.ws.close()
        await prod.ws.close()

    serve(tiny_engine, test)


def test_tokens_never_logged(tiny_engine, caplog):
    caplog.set_level("DEBUG")

    async def test(url, server):
        prod = await raw(url, api_key=KEY_A)
        created = await prod.request({"type": "session.create"})
        peer = await raw(url)
        await peer.request({"type": "subscribe", "session_id": created["session_id"], "token": "bogus-token"})
        await peer.request({"type": "subscribe", "session_id": created["session_id"],
                            "token": created["tokens"]["dashboard"]})
        await prod.ws.close()
        await peer.ws.close()
        return created["tokens"]

    tokens = serve(tiny_engine, test, **keyed())
    text = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith("websockets.client"))
    assert "streamer.wire" in {r.name for r in caplog.records}  # the server side did log, at INFO
    for secret in (*tokens.values(), KEY_A):
        assert secret not in text


def test_config_default_is_open():
    assert not ServerConfig().api_keys.enabled





def listed(reply):
    assert reply["type"] == "sessions", reply
    return {s["session_id"] for s in reply["sessions"]}


def test_tenants_see_and_watch_only_their_own_sessions(tiny_engine):
    """Two tenant keys and an operator key: each tenant lists and watches (websocket and the
    dashboard's JSON) only the sessions its key created; another tenant's session is answered
    like one that does not exist, and the connection goes on; the operator sees all of them.
    Capability tokens work whoever holds them."""

    async def test(url, server):
        base = url.replace("ws://", "http://")
        get = lambda path: asyncio.to_thread(get_json, base + path)  # noqa: E731
        alice, bob, ops = await raw(url, api_key=KEY_A), await raw(url, api_key=KEY_B), await raw(url, api_key=KEY_OPS)
        sid_a = await alice.create()
        created_b = await bob.request({"type": "session.create"})
        sid_b = created_b["session_id"]
        sid_ops = await ops.create()
        for peer, sid in ((alice, sid_a), (bob, sid_b)):
            ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": "Private notes."})
            assert ack["type"] == "input.ack"
        every = {sid_a, sid_b, sid_ops}
        await until(lambda: server.snapshots.written >= 3, 30, "the first snapshots")
        assert listed(await ops.request({"type": "sessions.list"})) == every
        assert listed(await alice.request({"type": "sessions.list"})) == {sid_a}
        assert listed(await bob.request({"type": "sessions.list"})) == {sid_b}
        assert listed(await alice.request({"type": "sessions.list", "session_id": sid_b})) == set()
        assert listed(await ops.request({"type": "sessions.list", "session_id": sid_b})) == {sid_b}
        snap = (await bob.request({"type": "sessions.list", "session_id": sid_b}))["sessions"][0]
        assert snap["key"] == "b"

        # token-less watching: a tenant key opens its own sessions only, from any connection
        alice2 = await raw(url, api_key=KEY_A)
        assert (await alice2.request({"type": "subscribe", "session_id": sid_a}))["type"] == "subscribed"
        for other in (sid_b, sid_ops, "no-such-session"):
            error = check_error(await alice2.request({"type": "subscribe", "session_id": other}), "session_not_found")
            assert error["message"] == f"no session {other!r} that this API key may watch"  # existence not told
            check_error(await alice2.request({"type": "session.get", "session_id": other}), "session_not_found")
        state = await alice2.request({"type": "session.get", "session_id": sid_a})
        assert state["type"] == "state" and state["session"]["inputs"] == 1
        await alice.still_serving(sid_a)
        for sid in (sid_a, sid_b):  # the operator watches every session
            assert (await ops.request({"type": "subscribe", "session_id": sid}))["type"] == "subscribed"
        # a capability token still opens its session, whichever key the connection holds
        sub = await alice2.request({"type": "subscribe", "session_id": sid_b, "token": created_b["tokens"]["dashboard"]})
        assert sub["type"] == "subscribed"
        anon = await raw(url)
        check_error(await anon.request({"type": "sessions.list"}), "unauthorized")
        check_error(await anon.request({"type": "subscribe", "session_id": sid_a}), "unauthorized")

        # the dashboard's JSON: the same view per key
        status, body = await get(f"/dashboard/sessions.json?api_key={KEY_A}")
        assert status == 200 and {s["session_id"] for s in body["sessions"]} == {sid_a}
        status, body = await get(f"/dashboard/sessions.json?api_key={KEY_OPS}")
        assert status == 200 and {s["session_id"] for s in body["sessions"]} == every
        status, body = await get(f"/dashboard/session.json?session={sid_a}&api_key={KEY_A}")
        assert status == 200 and body["snapshot"]["session_id"] == sid_a and body["session"]["inputs"] == 2
        for sid in (sid_b, "no-such-session"):
            status, body = await get(f"/dashboard/session.json?session={sid}&api_key={KEY_A}")
            assert (status, body["error"]["code"]) == (404, "session_not_found"), body
        status, body = await get(f"/dashboard/session.json?session={sid_b}&api_key={KEY_OPS}")
        assert status == 200 and body["snapshot"]["key"] == "b"

        # closed: its watchers are told; the closed snapshot stays its own key's
        closed = await bob.request({"type": "session.close", "session_id": sid_b})
        assert closed["type"] == "session.closed" and "reason" not in closed
        for watcher in (ops, alice2):
            pushed = await next_of(watcher, "session.closed", 30)
            assert (pushed["session_id"], pushed["reason"]) == (sid_b, "closed") and "reply_to" not in pushed

        async def closed_listed():
            snaps = (await bob.request({"type": "sessions.list", "session_id": sid_b}))["sessions"]
            return snaps and snaps[0]["closed"]

        await until(closed_listed, 30, "the closed snapshot")
        assert listed(await alice.request({"type": "sessions.list"})) == {sid_a}
        status, body = await get(f"/dashboard/session.json?session={sid_b}&api_key={KEY_A}")
        assert status == 404  # not live any more: its snapshot is still not another tenant's to read
        status, body = await get(f"/dashboard/session.json?session={sid_b}&api_key={KEY_B}")
        assert status == 200 and body["snapshot"]["closed"] is True
        for peer in (alice, alice2, bob, ops, anon):
            await peer.ws.close()

    serve(tiny_engine, test, **tenants(snapshot_interval_s=0.1))


def _metrics(base: str, key: str | None = None, header: str = "Authorization") -> tuple[int, str]:
    """(status, body) of GET /metrics, presenting `key` in `header` (or as ?api_key=)."""
    url, headers = base + "/metrics", {}
    if key is not None and header == "query":
        url += f"?api_key={key}"
    elif key is not None:
        headers[header] = f"Bearer {key}" if header == "Authorization" else key
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _series_sessions(text: str) -> set[str]:
    return set(re.findall(r'session="([^"]+)"', text))


def test_metrics_show_each_key_only_its_own_sessions(tiny_engine):
    """/metrics on a keyed server: without a key, aggregates only (no session id in any series);
    a tenant key adds its own sessions' series; an operator key sees every session's; an unknown
    key is refused (401). The aggregates are the same whoever reads them."""

    async def test(url, server):
        base = url.replace("ws://", "http://")
        alice, bob = await raw(url, api_key=KEY_A), await raw(url, api_key=KEY_B)
        sid_a, sid_b = await alice.create(), await bob.create()
        for peer, sid in ((alice, sid_a), (bob, sid_b)):
            ack = await peer.request({"type": "input.text.append", "session_id": sid, "text": "Private notes."})
            assert ack["type"] == "input.ack"
        fetch = lambda *a: asyncio.to_thread(_metrics, base, *a)  # noqa: E731
        status, anonymous = await fetch()
        assert status == 200 and "streamer_sessions 2" in anonymous
        assert _series_sessions(anonymous) == set() and sid_a not in anonymous and sid_b not in anonymous
        for header in ("Authorization", "X-API-Key", "query"):
            status, text = await fetch(KEY_A, header)
            assert status == 200 and _series_sessions(text) == {sid_a} and sid_b not in text, header
        status, text = await fetch(KEY_B)
        assert status == 200 and _series_sessions(text) == {sid_b}
        status, text = await fetch(KEY_OPS)
        assert status == 200 and _series_sessions(text) == {sid_a, sid_b}
        status, text = await fetch("not-a-key-0123456789")
        assert status == 401 and sid_a not in text and "unknown API key" in text
        for peer in (alice, bob):
            await peer.ws.close()

    serve(tiny_engine, test, **tenants())


def test_metrics_without_keys_show_every_session(tiny_engine):
    """A server without keys (the open default on loopback) shows every session's series."""

    async def test(url, server):
        peer = await raw(url)
        sid = await peer.create()
        status, text = await asyncio.to_thread(_metrics, url.replace("ws://", "http://"))
        assert status == 200 and _series_sessions(text) == {sid}
        await peer.ws.close()

    serve(tiny_engine, test)


def test_detached_sessions_count_against_their_key_and_the_oldest_goes_first(tiny_engine):
    """A key's detached sessions hold its `sessions_per_key` slots; a new session at the quota
    closes the key's oldest detached one (`session.created` names it in `evicted`, its watchers
    get `session.closed` with reason `evicted`); newer ones stay resumable; with every slot
    attached the key is refused; another key is not touched."""

    async def test(url, server):
        made = []
        for _ in range(2):
            peer = await raw(url, api_key=KEY_A)
            created = await peer.request({"type": "session.create"})
            made.append((created["session_id"], created["tokens"]["producer"]))
            await peer.ws.close()
            await until(lambda: server.directory.detached() == len(made), 10, "the session to be detached")
        (s1, t1), (s2, t2) = made
        assert server.directory.held("a") == 2  # detached, and still the key's
        ops = await raw(url, api_key=KEY_OPS)
        for sid in (s1, s2):
            assert (await ops.request({"type": "subscribe", "session_id": sid}))["type"] == "subscribed"
        alice = await raw(url, api_key=KEY_A)
        created = await alice.request({"type": "session.create"})
        assert created["type"] == "session.created" and created["evicted"] == [s1]  # the oldest first
        pushed = await next_of(ops, "session.closed", 30)
        assert (pushed["session_id"], pushed["reason"]) == (s1, "evicted")
        s3 = created["session_id"]
        assert server.directory.held("a") == 2 and server.resumer.counters["detached_evicted"] == 1
        bob = await raw(url, api_key=KEY_B)
        created_b = await bob.request({"type": "session.create"})
        assert created_b["type"] == "session.created" and "evicted" not in created_b  # another key: untouched
        check_error(await alice.request({"type": "session.resume", "session_id": s1, "token": t1}),
                    "session_not_found")
        # s2 (detached) and s3 (attached) hold the quota; the detached one makes room
        created = await alice.request({"type": "session.create"})
        assert created["evicted"] == [s2]
        check_error(await alice.request({"type": "session.create"}), "too_many_sessions")  # all attached
        await alice.still_serving(s3)
        await bob.still_serving(created_b["session_id"])
        for peer in (alice, bob, ops):
            await peer.ws.close()

    serve(tiny_engine, test, **tenants(sessions_per_key=2))


def test_a_full_engine_closes_the_oldest_detached_session_first(tiny, engine_factory):
    """At the engine's session limit a new session closes the oldest detached session of its
    own API key (named in `evicted`; its watchers get `session.closed` `evicted`); another
    key's detached sessions are never closed (issue 33: a tenant that filled the engine closed
    the others' detached sessions): with none of its own detached, the engine refuses
    (`too_many_sessions`) and the other key's sessions stay resumable."""
    engine = engine_factory(tiny[0], max_sessions=3)

    async def test(url, server):
        made = []
        for _ in range(2):
            peer = await raw(url, api_key=KEY_A)
            created = await peer.request({"type": "session.create"})
            made.append((created["session_id"], created["tokens"]["producer"]))
            await peer.ws.close()
            await until(lambda: server.directory.detached() == len(made), 10, "the session to be detached")
        ops = await raw(url, api_key=KEY_OPS)
        assert (await ops.request({"type": "subscribe", "session_id": made[0][0]}))["type"] == "subscribed"
        bob = await raw(url, api_key=KEY_B)
        mine = await bob.create()  # the third slot
        check_error(await bob.request({"type": "session.create"}), "too_many_sessions")  # a's stay
        assert server.directory.detached() == 2 and server.resumer.counters["detached_evicted"] == 0
        alice = await raw(url, api_key=KEY_A)
        resumed = await alice.request({"type": "session.resume", "session_id": made[1][0], "token": made[1][1]})
        assert resumed["type"] == "session.resumed", resumed
        created = await alice.request({"type": "session.create"})  # her own detached session makes room
        assert created["type"] == "session.created" and created["evicted"] == [made[0][0]], created
        pushed = await next_of(ops, "session.closed", 30)
        assert (pushed["session_id"], pushed["reason"]) == (made[0][0], "evicted")
        assert server.resumer.counters["detached_evicted"] == 1
        check_error(await alice.request({"type": "session.create"}), "too_many_sessions")  # nothing of hers detached
        for peer, sid in ((bob, mine), (alice, made[1][0]), (alice, created["session_id"])):
            await peer.still_serving(sid)
        for peer in (alice, bob, ops):
            await peer.ws.close()

    serve(engine, test, **tenants(sessions_per_key=8))
