"""Tenants learn nothing of each other and never close each other's sessions (issue 33, item 6):
chosen session ids are namespaced by API key, and detach caps and a full engine close only the
same key's detached sessions. Real server, real sockets, tiny model."""

from streamer.auth import ApiKeys

from helpers import until
from wsutil import check_error, raw, serve

KEY_A = "alpha-key-0123456789"
KEY_B = "bravo-key-0123456789"


def tenants(**extra):
    return dict(api_keys=ApiKeys({"a": KEY_A, "b": KEY_B}), **extra)


def test_a_chosen_session_id_is_namespaced_by_key_and_tells_nothing_of_other_tenants(tiny_engine):
    """`session.create` with an id another tenant uses (live, or closed with its log kept)
    answers exactly as for an unused id: a new session, `<key>:<id>`. Only the key's own ids
    are "in use"; an id that is too long with the prefix is refused with `param`."""

    async def test(url, server):
        alice, bob = await raw(url, api_key=KEY_A), await raw(url, api_key=KEY_B)
        assert await alice.create(session_id="cam1") == "a:cam1"
        assert await alice.create(session_id="a:cam2") == "a:cam2"  # the full id is taken as it is
        closed = await alice.request({"type": "session.close", "session_id": "a:cam2"})
        assert closed["type"] == "session.closed", closed
        # used live by a, used and closed by a (its log is kept), never used, a's full id: all alike
        for chosen, full in (("cam1", "b:cam1"), ("cam2", "b:cam2"), ("cam9", "b:cam9"), ("a:cam1", "b:a:cam1")):
            created = await bob.request({"type": "session.create", "session_id": chosen})
            assert created["type"] == "session.created" and created["session_id"] == full, created
        for chosen in ("cam1", "a:cam1", "cam2"):  # a's own ids, live or closed within the retention
            check_error(await alice.request({"type": "session.create", "session_id": chosen}), "invalid_field")
        error = check_error(await bob.request({"type": "session.create", "session_id": "x" * 63}), "invalid_field")
        assert error["param"] == "session_id" and "at most 62" in error["message"], error
        await alice.still_serving("a:cam1")
        await bob.still_serving("b:cam1")
        assert server.directory.key_of("a:cam1") == "a" and server.directory.key_of("b:cam1") == "b"
        for peer in (alice, bob):
            await peer.ws.close()

    serve(tiny_engine, test, **tenants())


def test_the_server_detach_cap_closes_only_the_detaching_keys_sessions(tiny_engine):
    """Past `max_detached` on the server, the detaching key's own oldest detached session closes,
    not another tenant's (the old rule closed the server's oldest, whoever's it was)."""

    async def test(url, server):
        made = []
        for _ in range(2):
            bob = await raw(url, api_key=KEY_B)
            created = await bob.request({"type": "session.create"})
            made.append((created["session_id"], created["tokens"]["producer"]))
            await bob.ws.close()
            await until(lambda: server.directory.detached() == len(made), 10, "b's session to be detached")
        alice = await raw(url, api_key=KEY_A)
        theirs = await alice.create()
        await alice.ws.close()  # the server's third detached session: over max_detached (2)
        await until(lambda: theirs not in server.directory.sessions, 10, "a's own session to close")
        assert server.resumer.counters["detached_evicted"] == 1 and server.directory.detached() == 2
        bob = await raw(url, api_key=KEY_B)
        for sid, token in made:  # b's detached sessions are still there to resume
            resumed = await bob.request({"type": "session.resume", "session_id": sid, "token": token})
            assert resumed["type"] == "session.resumed", resumed
            await bob.still_serving(sid)
        await bob.ws.close()

    serve(tiny_engine, test, **tenants(max_detached=2))


def test_without_keys_a_chosen_id_is_kept_and_a_full_engine_closes_any_detached_session(tiny, engine_factory):
    """A server without API keys is one tenant: a chosen id is used as it is (a second create
    with it is refused), and a full engine closes the oldest detached session, whoever left it
    (not named in `evicted`: it was another connection's)."""
    engine = engine_factory(tiny[0], max_sessions=2)

    async def test(url, server):
        first = await raw(url)
        assert await first.create(session_id="cam1") == "cam1"
        await first.ws.close()
        await until(lambda: server.directory.detached() == 1, 10, "the session to be detached")
        peer = await raw(url)
        check_error(await peer.request({"type": "session.create", "session_id": "cam1"}), "invalid_field")
        mine = await peer.create()
        created = await peer.request({"type": "session.create"})  # the engine is full: cam1 goes
        assert created["type"] == "session.created" and "evicted" not in created, created
        assert "cam1" not in server.directory.sessions and server.resumer.counters["detached_evicted"] == 1
        await peer.still_serving(mine)
        await peer.ws.close()

    serve(engine, test)
