"""Read-only session JSON over plain HTTP, for the dashboard's first paint.

Why HTTP and not only the websocket: headless Chromium's `--virtual-time-budget` (what
screenshot and prerender jobs use) runs the page's clock ahead while nothing it counts as
loading is pending, and it counts fetches but not websocket messages. A page that painted only
from websocket events was captured before any reply arrived (an all-dashes panel), and the
cards fed by `session.snapshot` stayed empty until the session next changed, because snapshots
are pushed on change only. One fetch of this JSON holds the virtual clock and paints every card
at once; the websocket then keeps the page live.

    GET /dashboard/session.json?session=ID&token=TOKEN   (any of the session's tokens)
    GET /dashboard/session.json?session=ID&api_key=KEY   (an operator: any session; a tenant: its
        own; no key on an open server) -> {"session": state, "snapshot": snapshot}
    GET /dashboard/sessions.json?api_key=KEY -> {"sessions": snapshots, "worker": id} (a tenant:
        its own sessions only)

Errors are JSON {"error": {"code", "message"}}: 404 `session_not_found` (unknown session, wrong
token or another tenant's session, the same answer as the websocket's), 401 `unauthorized`, 400
`missing_field`.

Also the pages' tab icon, a small SVG written here (no file, no external resource):
    GET /favicon.ico and GET /favicon.svg -> image/svg+xml (browsers ask for /favicon.ico on their
        own; the pages name /favicon.svg in a <link rel="icon">)
"""

from __future__ import annotations

import asyncio
import json
import time
from http import HTTPStatus
from urllib.parse import parse_qs

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamer.auth import ALL_SESSIONS, NO_SESSIONS, key_from_request
from streamer.sessions.errors import EngineError


def json_response(status: HTTPStatus, body: dict) -> Response:
    data = json.dumps(body, default=str).encode()
    headers = Headers([("Content-Type", "application/json"), ("Content-Length", str(len(data))),
                       ("Cache-Control", "no-store"), ("Connection", "close")])
    return Response(status.value, status.phrase, headers, data)


def _error(status: HTTPStatus, code: str, message: str) -> Response:
    return json_response(status, {"error": {"code": code, "message": message}})


_NO_KEY = object()  # no valid API key on the request


def _viewer(server, request: Request):
    """Whose sessions the request's API key may read: None for all (an operator key, or any
    request on a server without keys), a tenant key's name for its own, `_NO_KEY` for none
    (no key, or an unknown one)."""
    viewer = server.config.api_keys.viewer(key_from_request(request.headers, request.path))
    if viewer is ALL_SESSIONS:
        return None
    return _NO_KEY if viewer is None or viewer is NO_SESSIONS else viewer


def _query(request: Request) -> dict[str, str]:
    raw = request.path.split("?", 1)[1] if "?" in request.path else ""
    return {k: v[0] for k, v in parse_qs(raw).items() if v}


async def session_view(server, request: Request) -> Response:
    query = _query(request)
    sid, token = query.get("session"), query.get("token")
    if not sid:
        return _error(HTTPStatus.BAD_REQUEST, "missing_field", "give ?session=ID and &token= (or an API key)")
    viewer = None if token else _viewer(server, request)
    if token:
        allowed = server.directory.tokens.role_of(sid, token) is not None
    elif viewer is _NO_KEY:
        return _error(HTTPStatus.UNAUTHORIZED, "unauthorized", "reading a session without a token needs an API key "
                      "(?api_key=)")
    else:  # an operator reads any session, a tenant its own key's
        allowed = viewer is None or server.directory.key_of(sid) == viewer or server.directory.get(sid) is None
    tracked = server.directory.get(sid) if allowed else None
    if tracked is None:  # not live on this worker: a key holder may still read its last snapshot
        snapshot = await server.store.snapshot(sid) if allowed and not token else None
        if snapshot is not None and viewer is not None and snapshot.get("key") != viewer:
            snapshot = None  # another tenant's: as if it did not exist
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
    viewer = _viewer(server, request)
    if viewer is _NO_KEY:
        return _error(HTTPStatus.UNAUTHORIZED, "unauthorized", "the session list needs an API key (?api_key=)")
    snapshots = await server.store.snapshots()
    if viewer is not None:  # a tenant key: its own sessions only
        snapshots = [snap for snap in snapshots if snap.get("key") == viewer]
    return json_response(HTTPStatus.OK, {"sessions": snapshots, "worker": server.store.worker_id})


# A dark rounded square with three bars of rising height: a stream being read.
FAVICON_SVG = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
               b'<rect width="32" height="32" rx="6" fill="#1d2330"/>'
               b'<rect x="6" y="18" width="5" height="8" rx="1" fill="#8fb0ff"/>'
               b'<rect x="13.5" y="12" width="5" height="14" rx="1" fill="#5c8dff"/>'
               b'<rect x="21" y="6" width="5" height="20" rx="1" fill="#2d5bd3"/></svg>')
FAVICON_PATHS = frozenset({"/favicon.ico", "/favicon.svg"})


def favicon() -> Response:
    headers = Headers([("Content-Type", "image/svg+xml"), ("Content-Length", str(len(FAVICON_SVG))),
                       ("Cache-Control", "max-age=86400"), ("Connection", "close")])
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, FAVICON_SVG)


JSON_VIEWS = {"/dashboard/session.json": session_view, "/dashboard/sessions.json": sessions_view}
