"""The edge's side of durability: the connection commands and server hooks for resume,
duplicates, the sessions list and snapshots (mixed into Connection and StreamerServer, so
streamer/server.py keeps only the calls). The policy lives in streamer.durability.Keeper."""

from __future__ import annotations

import asyncio

from streamer.sessions.errors import EngineError

from .durability import Moved
from .protocol import Command


class ResumeCommands:
    """Connection commands: session.resume, sessions.list, and client_seq handling."""

    @staticmethod
    def _input_record(cmd: Command, result) -> dict:
        """An accepted append or revise as its log record (with the client's seq, if given)."""
        record = {"kind": cmd.type.rsplit(".", 1)[-1], "text": cmd["text"], "seq": result.seq,
                  "client_seq": cmd["client_seq"]}
        if cmd.type == "input.text.revise":
            record["from_seq"] = cmd["from_seq"]
        return record

    def duplicate(self, cmd: Command) -> bool:
        """An input whose client_seq the session has already seen is acknowledged, not applied."""
        if not self.server.keeper.check_client_seq(cmd.session_id, cmd["client_seq"]):
            return False
        self.send(self.proto.event("input.ack", reply_to=cmd.event_id, session_id=cmd.session_id,
                                   client_seq=cmd["client_seq"], duplicate=True))
        return True

    def on_session_resume(self, cmd: Command) -> None:
        """Re-attach a producer to a live or detached session, or recover it from its log."""
        sid = cmd.session_id
        if sid in self.sessions:
            self.refuse(cmd, "invalid_field", f"this connection already produces into session {sid}")
            return
        task = self.loop.create_task(self._resume(cmd))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _resume(self, cmd: Command) -> None:
        sid, server = cmd.session_id, self.server
        try:
            replayed = 0  # live here: nothing to replay
            if sid in server.keeper.sessions:  # live here: the token must be its producer token
                if server.tokens.role_of(sid, cmd["token"]) != "producer":
                    raise EngineError(f"no session {sid!r} with that producer token", code="session_not_found")
            else:
                replayed = (await server.keeper.recover(sid, cmd["token"]))["records"]
                if server.mqtt is not None:
                    server.mqtt.attach(sid)
            server.take_over(sid, self)  # one producer at a time: the newest resume wins
            tracked = server.keeper.attach(sid)
            self.sessions.add(sid)
            self.listeners[sid] = self.listener(sid)
            self.engine.add_listener(sid, self.listeners[sid])
            state = await asyncio.wrap_future(self.engine.session_state(sid))
        except Moved as exc:
            self.send(self.proto.event("error", reply_to=cmd.event_id, session_id=sid, error={
                "code": exc.code, "message": exc.message, "recoverable": True, "owner": exc.owner}))
            return
        except EngineError as exc:
            self.refuse(cmd, exc.code, exc.message)
            return
        tracked.high_client_seq = max(tracked.high_client_seq, tracked.acked_client_seq)
        self.send(self.proto.event("session.resumed", reply_to=cmd.event_id, session_id=sid,
                                   last_client_seq=tracked.acked_client_seq, last_seq=state["last_seq"],
                                   replayed_records=replayed, worker=server.keeper.store.worker_id, session=state))

    def on_sessions_list(self, cmd: Command) -> None:
        """Every session's snapshot (all workers sharing the store): needs a server credential."""
        if not self.server.operator(self):
            self.refuse(cmd, "unauthorized", "sessions.list needs an API key on the websocket handshake")
            return
        task = self.loop.create_task(self._list(cmd))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _list(self, cmd: Command) -> None:
        store = self.server.keeper.store
        if cmd.session_id is None:
            snaps = await store.snapshots()
        else:
            snap = await store.snapshot(cmd.session_id)
            snaps = [snap] if snap is not None else []
        self.send(self.proto.event("sessions", reply_to=cmd.event_id, sessions=snaps,
                                   worker=self.server.keeper.store.worker_id))


class ServerHooks:
    """StreamerServer helpers the keeper and the commands above use."""

    def operator(self, conn: ResumeCommands) -> bool:
        """Whether the connection holds a server-level credential (any valid API key; anyone when
        the server has no keys): it may list sessions and watch any of them read-only."""
        return not self.config.api_keys.enabled or conn.key_name is not None

    def take_over(self, session_id: str, new: ResumeCommands) -> None:
        """A producer resumed on a new connection: the old one stops producing into it."""
        for conn in self.connections:
            if conn is not new and session_id in conn.sessions:
                conn.sessions.discard(session_id)
                listener = conn.listeners.pop(session_id, None)
                if listener is not None:
                    self.engine.remove_listener(session_id, listener)

    def close_detached(self, session_id: str) -> None:
        """Close a session no producer holds (detach TTL ran out, or detaching is off)."""
        if self.mqtt is not None:
            self.mqtt.detach(session_id)
        self.engine.close_session(session_id)
        self.forget(session_id)
        self.keeper.spawn(self.keeper.forget(session_id, "detached"))

    def push_snapshot(self, session_id: str, snapshot: dict) -> None:
        """Send a session's new snapshot to the connections watching it (and its counters to
        the retained MQTT state)."""
        if self.mqtt is not None:
            self.mqtt.snapshot(session_id, snapshot)
        for conn in list(self.connections):
            if session_id in conn.subscriptions:
                conn.send(conn.proto.event("session.snapshot", session_id=session_id, snapshot=snapshot))
