"""Read-only session JSON over plain HTTP, for the dashboard's first paint.

Why HTTP and not only the websocket: headless Chromium's `--virtual-time-budget` (what
screenshot and prerender jobs use) runs the page's clock ahead while nothing it counts as
loading is pending, and it counts fetches but not websocket messages. A page that painted only
from websocket events was captured before any reply arrived (an all-dashes panel), and the
cards fed by `session.snapshot` stayed empty until the session next changed, because snapshots
are pushed on change only. One fetch of this JSON holds the virtual clock and paints every card
at once; the websocket then keeps the page live.

    GET /dashboard/session.json?session=ID&token=TOKEN   (any of the session's tokens)
    GET /dashboard/session.json?session=ID&api_key=KEY   (an operator; or no key on an open server)
        -> {"session": state, "snapshot": snapshot}
    GET /dashboard/sessions.json?api_key=KEY -> {"sessions": snapshots, "worker": id}

Errors are JSON {"error": {"code", "message"}}: 404 `session_not_found` (unknown session or
wrong token, the same answer as the websocket's), 401 `unauthorized`, 400 `missing_field`.
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus
from urllib.parse import parse_qs

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamer.auth import key_from_request
from streamer.sessions.errors import EngineError


def json_response(status: HTTPStatus, body: dict) -> Response:
    data = json.dumps(body, default=str).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Cache-Control", "no-store"), ("Connection", "close")])
    return Response(status.value, status.phrase, headers, data)


def _error(status: HTTPStatus, code: str, message: str) -> Response:
    return json_response(status, {"error": {"code": code, "message": message}})


def _operator(server, request: Request) -> bool:
    """A valid API key on the request (or a server without keys): it may read any session."""
    keys = server.config.api_keys
    return not keys.enabled or keys.check(key_from_request(request.headers, request.path)) is not None


def _query(request: Request) -> dict[str, str]:
    raw = request.path.split("?", 1)[1] if "?" in request.path else ""
    return {k: v[0] for k, v in parse_qs(raw).items() if v}


async def session_view(server, request: Request) -> Response:
    query = _query(request)
    sid, token = query.get("session"), query.get("token")
    if not sid:
        return _error(HTTPStatus.BAD_REQUEST, "missing_field", "give ?session=ID and &token= (or an API key)")
    if token:
        allowed = server.directory.tokens.role_of(sid, token) is not None
    elif _operator(server, request):
        allowed = True
    else:
        return _error(HTTPStatus.UNAUTHORIZED, "unauthorized", "reading a session without a token needs an API key "
                      "(?api_key=)")
    tracked = server.directory.get(sid) if allowed else None
    if tracked is None:  # not live on this worker: an operator may still read its last snapshot
        snapshot = await server.store.snapshot(sid) if allowed and not token else None
        if snapshot is None:
            return _error(HTTPStatus.NOT_FOUND, "session_not_found", f"no session {sid!r} with that token")
        return json_response(HTTPStatus.OK, {"session": None, "snapshot": snapshot})
    try:
        state = await asyncio.wrap_future(server.engine.session_state(sid))
    except EngineError as exc:
        return _error(HTTPStatus.NOT_FOUND, exc.code, exc.message)
    snapshot = {**server.snapshots.snapshot(tracked, state), "updated_at": time.time()}
    return json_response(HTTPStatus.OK, {"session": state, "snapshot": snapshot})


async def sessions_view(server, request: Request) -> Response:
    if not _operator(server, request):
        return _error(HTTPStatus.UNAUTHORIZED, "unauthorized", "the session list needs an API key (?api_key=)")
    snapshots = await server.store.snapshots()
    return json_response(HTTPStatus.OK, {"sessions": snapshots, "worker": server.store.worker_id})


JSON_VIEWS = {"/dashboard/session.json": session_view, "/dashboard/sessions.json": sessions_view}
