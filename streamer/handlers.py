"""The command table: one small handler per client command.

A handler takes the parsed `Command`, the client's `Peer` (what it produces into, what it
watches, where its events go) and the server's `Services` (engine, directory, event log,
resume, snapshots), and says what to answer:

- a `str`: one event to send now;
- `Await(future, reply, durable)`: wait for the engine's future (for a change: the event log's
  task, which logs it and applies it in the session's one order, streamer.eventlog), then send
  `reply(result)` (which may be a coroutine);
- a coroutine: a reply that needs the store (resume, sessions.list); it returns the event or None;
- None: nothing more to send.

A refusal is raised as an `EngineError` (code, message); the connection turns it into an `error`
event that names the command it answers. Nothing here touches a socket, so handlers are tested
with a peer whose `send` collects events.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from streamer.sessions.errors import Code, EngineError
from streamer.sessions.sampling import PENALTY_KEYS, SamplingParams

from .directory import Moved
from .eventlog import DUPLICATE
from .loopbridge import bridge
from .protocol import Command, ServerProtocol
from .records import Append, Create, End, FlashRegister, FlashUnregister, Revise, Update
from .store_base import StoreError

# Session events a peer forwards to its producer and subscribers.
PUBLIC_EVENTS = frozenset({"flash.updated", "flash.stale", "reasoning.delta", "reasoning.done", "action.chunk", "action.command"})


@dataclass(slots=True)
class Await:
    future: Future | asyncio.Future  # the engine's, or the event log's task (logged, then applied)
    reply: Callable[[Any], str | Awaitable[str]]
    durable: asyncio.Future | None = None  # resolves once the change is in the event log


@dataclass(eq=False)
class Peer:
    """One client of the edge: what it may touch and where its events go."""

    proto: ServerProtocol
    send: Callable[[str], None]  # queue an event for the client (on the event loop)
    loop: asyncio.AbstractEventLoop
    key_name: str | None = None  # the API key its handshake presented
    client: str | None = None  # who it is, for per-client quotas: the key name, else the remote address
    sessions: set[str] = field(default_factory=set)  # sessions it produces into
    listeners: dict[str, object] = field(default_factory=dict)  # session id -> engine listener, as producer
    subscriptions: dict[str, object] = field(default_factory=dict)  # session id -> engine listener, read-only
    queries: dict[tuple[str, str], object] = field(default_factory=dict)  # running questions
    media: Any = None  # its MediaHub, when the server takes media
    closed: bool = False

    def post(self, fn: Callable, *args) -> None:
        """Run `fn(*args)` on this peer's loop, in order with everything else the engine hands it
        (streamer.loopbridge: one wake-up per batch). Safe from any thread."""
        bridge(self.loop).post(fn, *args)

    def forwarder(self, sid: str):
        """An engine listener that forwards session events to this peer (called on the engine
        thread; the event is built and queued on the loop)."""

        def forward(event: str, payload: dict) -> None:
            if event in PUBLIC_EVENTS and not self.closed:
                self.post(lambda: self.send(self.proto.event(event, session_id=sid, **payload)))

        return forward

    def produce(self, engine, sid: str) -> None:
        """Become the producer of `sid`: its events come here."""
        self.sessions.add(sid)
        self.listeners[sid] = self.forwarder(sid)
        engine.add_listener(sid, self.listeners[sid])

    def stop_producing(self, engine, sid: str) -> None:
        self.sessions.discard(sid)
        listener = self.listeners.pop(sid, None)
        if listener is not None:
            engine.remove_listener(sid, listener)

    def producer_of(self, cmd: Command) -> str:
        """The command's session, if this peer produces into it; else a refusal."""
        if cmd.session_id in self.sessions:
            return cmd.session_id
        if cmd.session_id in self.subscriptions:
            raise EngineError(f"{cmd.type} needs the producer of session {cmd.session_id!r}; this connection "
                              "holds a read-only token for it", code=Code.FORBIDDEN)
        raise EngineError(f"no session {cmd.session_id!r} on this connection (never created, or closed)",
                          code=Code.SESSION_NOT_FOUND)

    def reader_of(self, cmd: Command) -> str:
        """The producer or a subscriber of the session may read its state."""
        return cmd.session_id if cmd.session_id in self.subscriptions else self.producer_of(cmd)


@dataclass(eq=False)
class Services:
    """The server-wide parts a handler uses."""

    engine: Any
    config: Any  # ServerConfig
    directory: Any  # streamer.directory.Directory
    events: Any  # streamer.eventlog.EventLog
    resumer: Any  # streamer.resume.Resumer
    snapshots: Any  # streamer.snapshots.Snapshots
    store: Any
    take_over: Callable[[str, Peer], None]  # a producer resumed elsewhere: the old peer lets go
    mqtt: Any = None
    edge: dict = field(default_factory=dict)  # edge counters for /metrics
    query_ids: Any = field(default_factory=lambda: itertools.count(1))
    quotas: Any = None  # streamer.quotas.ClusterQuota: per-key caps over every worker of the store

    def operator(self, peer: Peer) -> bool:
        """Whether the peer may list every session and watch any of them read-only: an operator
        API key, or anyone when the server has no keys."""
        keys = self.config.api_keys
        return not keys.enabled or keys.role(peer.key_name) == "operator"

    def viewer(self, peer: Peer, what: str) -> str | None:
        """Whose sessions a token-less listing or watch may see: None for an operator (all), the
        key's name for a tenant (its own); a connection with no API key is refused."""
        if self.operator(peer):
            return None
        if peer.key_name is None:
            raise EngineError(f"{what} needs an API key on the websocket handshake", code=Code.UNAUTHORIZED)
        return peer.key_name


# ---- sessions -----------------------------------------------------------------------------------


def session_create(cmd: Command, peer: Peer, svc: Services):
    keys_on = svc.config.api_keys.enabled
    if keys_on and peer.key_name is None:
        svc.edge["auth_refused"] += 1
        raise EngineError("session.create needs an API key: send 'Authorization: Bearer <key>' (or ?api_key=) "
                          "when opening the websocket", code=Code.UNAUTHORIZED)
    if svc.resumer.draining:
        raise EngineError("this worker is draining (shutting down): create the session on another worker",
                          code=Code.DRAINING)
    key_name = peer.key_name if keys_on else None
    chosen = chosen_id(cmd, peer, key_name)
    evicted = svc.resumer.make_room(key_name)  # a detached session of this key holding the last slot goes first
    if key_name is not None:
        svc.directory.reserve(key_name)  # released below if creation fails
    engine = svc.engine
    flash = [flash_args(item) for item in cmd["flash"] or ()]
    fut = engine.create_session(cmd["system_prompt"], chosen, flash, cmd["thinking"], window_of(cmd),
                                owner=peer.client)

    def orphan_check(f) -> None:  # engine thread: a session created after its client left
        if peer.closed and not f.cancelled() and f.exception() is None:
            engine.close_session(f.result()["session_id"])
            if key_name is not None:
                peer.post(svc.directory.release, key_name)

    fut.add_done_callback(orphan_check)
    if key_name is not None:  # give the reservation back if the engine refuses the session
        fut.add_done_callback(lambda f: f.exception() is None or peer.post(svc.directory.release, key_name))
    return Await(fut, lambda state: _created(cmd, peer, svc, state, flash, key_name, evicted))


async def _created(cmd: Command, peer: Peer, svc: Services, state: dict, flash: list[dict], key_name,
                   evicted: list[str]) -> str:
    """The engine made the session: claim it in the store and log its creation, then answer.
    If the store refuses, it goes, as if it had never been created."""
    sid = state["session_id"]
    directory = svc.directory
    peer.produce(svc.engine, sid)
    tokens = directory.tokens.issue(sid)
    if svc.mqtt is not None:
        svc.mqtt.attach(sid)
    tracked = directory.track(sid, key_name)
    svc.snapshots.watch(tracked)
    record = Create(system_prompt=cmd["system_prompt"], thinking=cmd["thinking"],
                    window=False if window_of(cmd) is None else cmd["window"],
                    flash=[FlashRegister.of(a, q).arguments() for a, q in zip(flash, state["flash"])],
                    tokens=directory.tokens.export(sid), key=key_name)
    try:
        if key_name is not None and svc.quotas is not None:
            await svc.quotas.admit(key_name, sid)  # the cap over every worker (Redis), not just this one
        await svc.events.created(sid, record)
    except BaseException:
        peer.stop_producing(svc.engine, sid)
        if svc.mqtt is not None:
            svc.mqtt.detach(sid)
        svc.engine.close_session(sid)
        directory.forget(sid)
        raise
    return peer.proto.event("session.created", reply_to=cmd.event_id, session_id=sid, model=svc.engine.runner.name,
                            tokens=tokens, subscribe_token=tokens["subscriber"], evicted=evicted or None,
                            session=state)


KEY_SEPARATOR = ":"  # between a key's name and the id its holder chose (key names have no ':')


def chosen_id(cmd: Command, peer: Peer, key_name: str | None) -> str | None:
    """The id of a session whose creator chose one: on a server with API keys, namespaced by
    the key, `<key name>:<chosen>` (a chosen id that already starts with the key's prefix is
    taken as it is), so ids of different keys never collide and "already in use" only ever
    speaks of the asking key's own sessions: a tenant learns nothing of another's ids. Without
    keys (one tenant), the id as chosen. None: the server picks a random id."""
    chosen = cmd.session_id
    if chosen is None or key_name is None:
        return chosen
    prefix = key_name + KEY_SEPARATOR
    full = chosen if chosen.startswith(prefix) else prefix + chosen
    limit = peer.proto.limits.max_id_chars
    if len(full) > limit:
        raise EngineError(f"session_id {chosen!r} becomes {full!r} with this API key's prefix, {len(full)} "
                          f"characters; the limit is {limit}: choose one of at most {limit - len(prefix)}",
                          code=Code.INVALID_FIELD, param="session_id")
    return full


def window_of(cmd: Command) -> dict | str | None:
    """The `window` a command asks for: its settings, None for `window: null` (unbounded), or
    "default" when the field is absent."""
    if "window" not in cmd.fields:
        return "default"
    return cmd["window"]


def session_update(cmd: Command, peer: Peer, svc: Services):
    sid, engine = peer.producer_of(cmd), svc.engine
    if cmd["thinking"] is None and "window" not in cmd.fields:
        raise EngineError("session.update needs 'thinking' or 'window'", code=Code.MISSING_FIELD)
    record = Update(thinking=cmd["thinking"],
                    window=False if "window" in cmd.fields and cmd["window"] is None else cmd["window"])
    task = svc.events.first(sid, record, lambda: record.apply(engine, sid))
    return Await(task, lambda st: peer.proto.event("session.updated", reply_to=cmd.event_id, session_id=sid,
                                                   session=st))


def session_get(cmd: Command, peer: Peer, svc: Services):
    sid = peer.reader_of(cmd)

    def state(st: dict) -> str:
        media = peer.media.state(sid) if peer.media is not None else None
        return peer.proto.event("state", reply_to=cmd.event_id, session_id=sid,
                                session={**st, "media": media} if media else st)

    return Await(svc.engine.session_state(sid), state)


def session_close(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    peer.sessions.discard(sid)
    peer.listeners.pop(sid, None)
    if peer.media is not None:
        peer.media.close_session(sid)
    fut, recorded = svc.resumer.close(sid, "closed")
    return Await(fut, lambda st: peer.proto.event("session.closed", reply_to=cmd.event_id, session_id=sid,
                                                  session=st), recorded)


def session_resume(cmd: Command, peer: Peer, svc: Services):
    """Re-attach a producer to a live or detached session, or recover it from its log."""
    if cmd.session_id in peer.sessions:
        raise EngineError(f"this connection already produces into session {cmd.session_id}", code=Code.INVALID_FIELD)
    return _resume(cmd, peer, svc)


async def _resume(cmd: Command, peer: Peer, svc: Services) -> str:
    sid, directory = cmd.session_id, svc.directory
    try:
        replayed = reprefill = 0  # live here: nothing to replay
        if directory.get(sid) is not None:  # live here: the token must be its producer token
            if directory.tokens.role_of(sid, cmd["token"]) != "producer":
                raise EngineError(f"no session {sid!r} with that producer token", code=Code.SESSION_NOT_FOUND)
        else:
            recovered = await svc.resumer.recover(sid, cmd["token"])
            replayed, reprefill = recovered["records"], recovered["reprefill_tokens"]
            if svc.mqtt is not None:
                svc.mqtt.attach(sid)
        svc.take_over(sid, peer)  # one producer at a time: the newest resume wins
        tracked = svc.resumer.attach(sid)
        peer.produce(svc.engine, sid)
        state = await bridge(peer.loop).wrap(svc.engine.session_state(sid))
    except Moved as exc:
        return peer.proto.event("error", reply_to=cmd.event_id, session_id=sid, error={
            "code": exc.code, "message": exc.message, "recoverable": True, "owner": exc.owner})
    return peer.proto.event("session.resumed", reply_to=cmd.event_id, session_id=sid,
                            last_client_seq=tracked.acked_client_seq, last_seq=state["last_seq"],
                            replayed_records=replayed, reprefill_tokens=reprefill, worker=svc.store.worker_id,
                            session=state)


def sessions_list(cmd: Command, peer: Peer, svc: Services):
    """Every session's snapshot (all workers sharing the store) for an operator; a tenant key's
    own sessions only (another's are left out, as if they did not exist)."""
    tenant = svc.viewer(peer, "sessions.list")

    async def listing() -> str:
        try:
            if cmd.session_id is None:
                snaps = await svc.store.snapshots()
            else:
                snap = await svc.store.snapshot(cmd.session_id)
                snaps = [snap] if snap is not None else []
        except StoreError as exc:
            raise EngineError(f"the store cannot list sessions now ({exc}); retry later",
                              code=Code.STORE_UNAVAILABLE) from None
        if tenant is not None:
            snaps = [snap for snap in snaps if snap.get("key") == tenant]
        return peer.proto.event("sessions", reply_to=cmd.event_id, sessions=snaps, worker=svc.store.worker_id)

    return listing()


# ---- input --------------------------------------------------------------------------------------


def duplicate_ack(cmd: Command, peer: Peer, svc: Services):
    """An input whose client_seq is in the session's log is acknowledged, not applied (a resend
    of one still on its way is answered once that one is logged: if it fails, so does this)."""
    seen = svc.events.duplicate(cmd.session_id, cmd["client_seq"])
    if seen is None:
        return None
    ack = lambda _=None: peer.proto.event("input.ack", reply_to=cmd.event_id, session_id=cmd.session_id,  # noqa: E731
                                          client_seq=cmd["client_seq"], duplicate=True)
    return ack() if seen is True else Await(seen, ack)


def input_ack(cmd: Command, peer: Peer, svc: Services, result) -> str:
    if result is DUPLICATE:  # a resend of a write that timed out but had landed
        return peer.proto.event("input.ack", reply_to=cmd.event_id, session_id=cmd.session_id,
                                client_seq=cmd["client_seq"], duplicate=True)
    svc.directory.note_lag(result.session_id, result.lag_s)
    return peer.proto.event(
        "input.ack", reply_to=cmd.event_id, session_id=result.session_id, seq=result.seq,
        client_seq=cmd["client_seq"], tokens=result.tokens, total_tokens=result.total_tokens,
        data_version=result.data_version, lag_ms=round(result.lag_s * 1000, 2), kept_tokens=result.kept_tokens,
        replaced_seqs=result.replaced_seqs or None, evicted_seqs=result.evicted_seqs or None)


def input_append(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    if (dup := duplicate_ack(cmd, peer, svc)) is not None:
        return dup
    record = Append(text=cmd["text"], client_seq=cmd["client_seq"], **cmd.fields.get("logged", {}))  # realtime.py
    task = svc.events.first(sid, record, lambda: svc.engine.append(sid, cmd["text"]), cmd["client_seq"])
    return Await(task, lambda r: input_ack(cmd, peer, svc, r))


def input_revise(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    if (dup := duplicate_ack(cmd, peer, svc)) is not None:
        return dup
    record = Revise(text=cmd["text"], client_seq=cmd["client_seq"], from_seq=cmd["from_seq"])
    task = svc.events.first(sid, record, lambda: svc.engine.revise(sid, cmd["text"], cmd["from_seq"]),
                            cmd["client_seq"])
    return Await(task, lambda r: input_ack(cmd, peer, svc, r))


def input_end(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    task = svc.events.first(sid, End(), lambda: svc.engine.end_input(sid))
    return Await(task, lambda st: peer.proto.event("input.ack", reply_to=cmd.event_id, session_id=sid,
                                                   seq=st["last_seq"], ended=True, total_tokens=st["tokens"],
                                                   data_version=st["data_version"]))


# ---- questions ----------------------------------------------------------------------------------


def query_create(cmd: Command, peer: Peer, svc: Services):
    sid, f = peer.producer_of(cmd), cmd.fields
    query_id = f.get("query_id") or f"q{next(svc.query_ids)}"
    key = (sid, query_id)
    if key in peer.queries:
        raise EngineError(f"query {query_id!r} is still running on session {sid}", code=Code.INVALID_FIELD)
    params = SamplingParams(
        max_tokens=f.get("max_tokens", 128), temperature=f.get("temperature", 0.0),
        top_p=f.get("top_p", 1.0) or 1.0, top_k=f.get("top_k", 0), seed=f.get("seed"), stop=f.get("stop", []),
        **{k: float(f[k]) for k in PENALTY_KEYS if f.get(k) is not None})
    index = itertools.count()

    def on_delta(delta: str) -> None:  # engine thread
        text = peer.proto.event("query.delta", reply_to=cmd.event_id, session_id=sid, query_id=query_id,
                                index=next(index), delta=delta)
        peer.post(peer.send, text)

    handle = svc.engine.query(sid, cmd["question"], params, on_delta if f.get("stream", True) else None, query_id,
                              f.get("over", "sent"))
    peer.queries[key] = handle
    handle.future.add_done_callback(lambda _: peer.post(peer.queries.pop, key, None))
    return Await(handle.future, lambda r: query_done(cmd, peer, r))


def query_done(cmd: Command, peer: Peer, r) -> str:
    return peer.proto.event(
        "query.done", reply_to=cmd.event_id, session_id=r.session_id, query_id=r.query_id, text=r.text,
        cached=r.cached or None, finish_reason=r.finish_reason, tokens=len(r.tokens), data_version=r.data_version,
        over=r.over, unread_inputs=r.unread_inputs, context_tokens=r.context_tokens, question_tokens=r.question_tokens,
        timing={"queue_ms": _ms(r.queue_s), "prefill_ms": _ms(r.prefill_s), "first_token_ms": _ms(r.first_token_s),
                "total_ms": _ms(r.total_s), "decode_tokens_per_s": round(r.decode_tokens_per_s, 2),
                "steps": r.steps, "steps_waited": r.steps_waited, "max_step_tokens": r.max_step_tokens,
                "commands_waited": r.commands_waited})


def query_cancel(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    handle = peer.queries.get((sid, cmd["query_id"]))
    if handle is None:
        raise EngineError(f"no running query {cmd['query_id']!r} on session {sid}", code=Code.QUERY_NOT_FOUND)
    handle.cancel()


def flash_register(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    args = flash_args(cmd.fields)
    task = svc.events.after(sid, lambda: svc.engine.register_flash(sid, **args),
                            lambda st: FlashRegister.of(args, st, **cmd.fields.get("logged", {})))  # realtime.py
    return Await(task, lambda st: peer.proto.event("flash.registered", reply_to=cmd.event_id, session_id=sid,
                                                   flash=st))


def flash_unregister(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    task = svc.events.first(sid, FlashUnregister(flash_id=cmd["flash_id"]),
                            lambda: svc.engine.unregister_flash(sid, cmd["flash_id"]))
    return Await(task, lambda st: peer.proto.event("flash.unregistered", reply_to=cmd.event_id, session_id=sid,
                                                   flash_id=st["flash_id"]))


def flash_args(fields: dict) -> dict:
    """Protocol field names -> Engine.register_flash keyword arguments."""
    args = {k: v for k, v in fields.items() if k in ("question", "flash_id", "max_tokens", "priority", "confirm")}
    args.update({k: float(fields[k]) for k in PENALTY_KEYS if fields.get(k) is not None})
    if fields.get("min_interval_ms") is not None:
        args["min_interval_s"] = fields["min_interval_ms"] / 1000
    return args


# ---- watching -----------------------------------------------------------------------------------


def subscribe(cmd: Command, peer: Peer, svc: Services):
    """Read-only access to a session with any of its tokens (subscriber, dashboard or
    producer), or without one with an API key: an operator's watches any session, a tenant's
    only those its key created. An unknown session, a wrong token and another tenant's session
    get the same answer."""
    sid = cmd.session_id
    if cmd["token"] is None:  # a key holder's view (the dashboard)
        tenant = svc.viewer(peer, "subscribe without a token (or give one of the session's tokens)")
        live = sid in svc.directory.tokens
        if tenant is None:
            role = "operator" if live else None
        else:
            role = "tenant" if live and svc.directory.key_of(sid) == tenant else None
        if role is None:
            raise EngineError(f"no session {sid!r} that this API key may watch", code=Code.SESSION_NOT_FOUND)
    else:
        role = svc.directory.tokens.role_of(sid, cmd["token"])
    if role is None:
        raise EngineError(f"no session {sid!r} with that token", code=Code.SESSION_NOT_FOUND)
    if sid in peer.subscriptions:
        raise EngineError(f"already subscribed to session {sid}", code=Code.INVALID_FIELD)
    listener = peer.subscriptions[sid] = peer.forwarder(sid)
    svc.engine.add_listener(sid, listener)
    return Await(svc.engine.session_state(sid),
                 lambda st: peer.proto.event("subscribed", reply_to=cmd.event_id, session_id=sid, session=st))


def unsubscribe(cmd: Command, peer: Peer, svc: Services):
    listener = peer.subscriptions.pop(cmd.session_id, None)
    if listener is None:
        raise EngineError(f"not subscribed to session {cmd.session_id!r}", code=Code.SESSION_NOT_FOUND)
    return Await(svc.engine.remove_listener(cmd.session_id, listener),
                 lambda _: peer.proto.event("unsubscribed", reply_to=cmd.event_id, session_id=cmd.session_id))


# ---- actions ------------------------------------------------------------------------------------


def action_rule(cmd: Command, peer: Peer, svc: Services):
    sid, f = peer.producer_of(cmd), cmd.fields
    fut = svc.engine.add_rule(sid, f["flash_id"], f["pattern"], f["command"], f.get("debounce_ms", 0) / 1000,
                              f.get("rule_id"))
    return Await(fut, lambda r: peer.proto.event("action.rule.added", reply_to=cmd.event_id, session_id=sid, rule=r))


def action_rule_remove(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    return Await(svc.engine.remove_rule(sid, cmd["rule_id"]),
                 lambda r: peer.proto.event("action.rule.removed", reply_to=cmd.event_id, session_id=sid,
                                            rule_id=r["rule_id"]))


def action_start(cmd: Command, peer: Peer, svc: Services):
    sid, f = peer.producer_of(cmd), cmd.fields
    options = {k: f[k] for k in ("horizon", "gain", "max_speed") if k in f}
    if "latency_ms" in f:
        if len(f["latency_ms"]) != 2 or not 0 <= f["latency_ms"][0] <= f["latency_ms"][1] <= 60_000:
            raise EngineError("latency_ms must be [min, max] with 0 <= min <= max <= 60000", code=Code.INVALID_FIELD)
        options["latency_s"] = (f["latency_ms"][0] / 1000, f["latency_ms"][1] / 1000)
    fut = svc.engine.start_actions(sid, f.get("policy", "tracker"), f.get("mode", "async_rollforward"),
                                   f.get("dt_ms", 50) / 1000, **options)
    return Await(fut, lambda st: peer.proto.event("action.started", reply_to=cmd.event_id, session_id=sid, actions=st))


def action_stop(cmd: Command, peer: Peer, svc: Services):
    sid = peer.producer_of(cmd)
    return Await(svc.engine.stop_actions(sid),
                 lambda r: peer.proto.event("action.stopped", reply_to=cmd.event_id, session_id=sid, **r))


def robot_state(cmd: Command, peer: Peer, svc: Services):
    """Robot state comes from the producer at control rate: no reply unless it is refused."""
    svc.engine.robot_state(peer.producer_of(cmd), cmd["state"], cmd["ts"])


def media(cmd: Command, peer: Peer, svc: Services):
    """A binary media frame: decoded on its stream's thread; `input.ack` when it is in."""
    sid, f = peer.producer_of(cmd), cmd.fields

    def ack(counters: dict) -> None:
        peer.send(peer.proto.event("input.ack", session_id=sid, kind=f["kind"], format=f["format"], media_seq=f["seq"],
                                   bytes=len(f["payload"]), ended=f.get("end") or None, media=counters))

    peer.media.submit(cmd, peer.loop, ack)


HANDLERS: dict[str, Callable[[Command, Peer, Services], Any]] = {
    "session.create": session_create, "session.update": session_update, "session.get": session_get,
    "session.close": session_close, "session.resume": session_resume, "sessions.list": sessions_list,
    "input.text.append": input_append, "input.text.revise": input_revise, "input.end": input_end,
    "query.create": query_create, "query.cancel": query_cancel,
    "flash.register": flash_register, "flash.unregister": flash_unregister,
    "subscribe": subscribe, "unsubscribe": unsubscribe,
    "action.rule": action_rule, "action.rule.remove": action_rule_remove, "action.start": action_start,
    "action.stop": action_stop, "robot.state": robot_state, "media": media,
}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)
