"""API keys and per-session capability tokens over a real socket."""


import pytest
from websockets.exceptions import InvalidStatus

from streamer.auth import ApiKeys, KeysFileError, SessionTokens, key_from_request
from streamer.server import ServerConfig

from helpers import until
from wsutil import check_error, raw, serve

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-0123456789"


def keyed(**extra):
    return dict(api_keys=ApiKeys({"a": KEY_A, "b": KEY_B}), **extra)


def test_keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# ops\nops:0123456789abcdef01\n\nfedcba98765432100\n")
    keys = ApiKeys.from_file(path)
    assert keys.check("0123456789abcdef01") == "ops"
    assert keys.check("fedcba98765432100") == "key2"
    assert keys.check("nope") is None and keys.check(None) is None
    for bad in ("short:abc\n", "", "x:0123456789abcdef01\nx:0123456789abcdef02\n"):
        path.write_text(bad)
        with pytest.raises(KeysFileError):
            ApiKeys.from_file(path)
    with pytest.raises(KeysFileError, match="cannot read"):
        ApiKeys.from_file(tmp_path / "missing")


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
