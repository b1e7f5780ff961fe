"""The live dashboard: static files (HTML, JS, CSS; no build step, no CDN) served on the
service's own port at /dashboard. The page talks to the same port over a websocket, read-only:
`sessions.list` (with an API key when keys are configured: an operator key lists every session,
a tenant key its own) and `subscribe` (with a session's dashboard token, or without one for a
holder of an API key that may see the session). Its first paint reads the session
JSON of streamer.web.views; streamer.web.route sends /dashboard paths here."""

from __future__ import annotations

from http import HTTPStatus
from importlib import resources

from websockets.datastructures import Headers
from websockets.http11 import Response

FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8"}


def response(path: str) -> Response:
    """GET /dashboard (the page) or /dashboard/<file>."""
    name = path.removeprefix("/dashboard").strip("/") or "index.html"
    if name not in FILES:
        body, status, kind = f"no dashboard file {name!r}".encode(), HTTPStatus.NOT_FOUND, "text/plain"
    else:
        body = resources.files(__package__).joinpath(name).read_bytes()
        status, kind = HTTPStatus.OK, FILES[name]
    headers = Headers([("Content-Type", kind), ("Content-Length", str(len(body))), ("Cache-Control", "no-cache"),
                       ("Content-Security-Policy", "default-src 'self'; connect-src 'self' ws: wss:"),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, body)
