"""Session snapshots for dashboards: written to the store and pushed to watchers at most once
per `interval_s` per session, and only when something changed.

A snapshot holds the directory entry, ingest lag, cache size, data_version, flash answers with
their version and confidence, recent reasoning and the last action chunks. What the engine's
state does not keep (reasoning text, action chunks) comes from a listener on the session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

from streamer.sessions.errors import EngineError

from .directory import Directory, Tracked
from .loopbridge import bridge
from .store_base import Store

log = logging.getLogger(__name__)

DEFAULT_SNAPSHOT_INTERVAL_S = 0.5


class Snapshots:
    def __init__(self, engine, store: Store, directory: Directory, push: Callable[[str, dict], None],
                 interval_s: float = DEFAULT_SNAPSHOT_INTERVAL_S) -> None:
        self.engine = engine
        self.store = store
        self.directory = directory
        self.push = push  # (session_id, snapshot): to the connections watching it
        self.interval_s = interval_s
        self.written = 0

    def watch(self, tracked: Tracked) -> None:
        """Listen to the session's events for what snapshots report beyond engine state."""
        if tracked.monitor is None:
            tracked.monitor = self._monitor(tracked)
            self.engine.add_listener(tracked.session_id, tracked.monitor)

    def _monitor(self, tracked: Tracked):
        """An engine listener, called on the engine thread; it hands each event to the event
        loop, which owns `tracked`."""
        loop = asyncio.get_running_loop()

        hand_over = bridge(loop).post  # after the loop has gone (shutting down), dropped

        def on_event(event: str, payload: dict) -> None:
            hand_over(apply, event, payload)

        def apply(event: str, payload: dict) -> None:
            tracked.dirty = True
            if event == "reasoning.delta":
                tracked.reasoning.extend(payload.get("delta", ""))
            elif event == "action.chunk":
                tracked.last_action_seq = payload.get("seq", tracked.last_action_seq)
                tracked.actions.append({k: payload.get(k) for k in ("seq", "t0", "dt", "obs_ts")} |
                                       {"n": len(payload.get("actions") or ())})
            elif event == "action.command":
                tracked.actions.append({"command": payload.get("command"), "rule_id": payload.get("rule_id"),
                                        "at": time.time()})

        return on_event

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.write_all()
            except Exception:
                log.warning("snapshot round failed", exc_info=True)

    async def write_all(self) -> None:
        for sid, tracked in list(self.directory.sessions.items()):
            if not tracked.dirty:
                continue
            tracked.dirty = False
            try:
                state = await asyncio.wrap_future(self.engine.session_state(sid))
            except EngineError:
                continue  # closed meanwhile
            snap = self.snapshot(tracked, state)
            body = json.dumps(snap, sort_keys=True, default=str)
            if body == tracked.last_snapshot:
                continue
            tracked.last_snapshot = body
            snap["updated_at"] = time.time()
            await self.store.put_snapshot(sid, snap)
            self.written += 1
            self.push(sid, snap)

    def snapshot(self, tracked: Tracked, state: dict) -> dict:
        return {
            "session_id": tracked.session_id, "key": tracked.key_name,
            "owner": self.store.worker_id, "owner_url": self.store.worker_url,
            "created_at": state["created_at"], "last_input_at": state["last_input_at"],
            "detached": tracked.detached_at is not None, "closed": False,
            "ingest_lag_ms": tracked.lag_ms, "tokens": state["tokens"], "cache_bytes": state["cache_bytes"],
            "context_window": state["context_window"], "data_version": state["data_version"],
            "frames": state.get("frames", 0),
            "last_seq": state["last_seq"], "last_client_seq": tracked.acked_client_seq, "ended": state["ended"],
            "flash": [{k: q.get(k) for k in ("flash_id", "question", "answer", "data_version", "media_s", "confidence",
                                             "staleness", "stale", "history")} for q in state["flash"]],
            "thinking": state["thinking"], "reasoning": "".join(tracked.reasoning)[-1000:],
            "last_action_seq": tracked.last_action_seq, "actions": list(tracked.actions)[-20:],
        }
