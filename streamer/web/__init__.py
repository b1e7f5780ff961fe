"""The browser side of the service, on its own port: the JavaScript SDK (/sdk/), the
streaming page (/app), the dashboard (/dashboard), the JSON its first paint reads and the
pages' icon (/favicon.ico).

Static files only (no build step, no CDN), shipped as package data. StreamerServer's HTTP hook
hands every request to `route`, which answers the paths it knows (a Response, or an awaitable
for the JSON views) and returns None for the rest.
"""

from __future__ import annotations

from collections.abc import Awaitable
from http import HTTPStatus
from importlib import resources

from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from streamer.dashboard import response as dashboard_response

from .views import FAVICON_PATHS, JSON_VIEWS, favicon

JS = "text/javascript; charset=utf-8"
# path -> (file in this package, content type)
FILES: dict[str, tuple[str, str]] = {
    "/app": ("app.html", "text/html; charset=utf-8"),
    "/app/app.js": ("app.js", JS),
    "/app/app.css": ("app.css", "text/css; charset=utf-8"),
    "/sdk/streamer.js": ("streamer.js", JS),
    "/sdk/capture.js": ("capture.js", JS),
    "/sdk/pcm-worklet.js": ("pcm-worklet.js", JS),
}
# The page reaches its own server's websocket (or one the user names); media stays in the page.
APP_CSP = ("default-src 'self'; connect-src 'self' ws: wss:; img-src 'self' data: blob:; "
           "media-src 'self' blob: mediastream:")


def route(server, request: Request) -> Response | Awaitable[Response] | None:
    """The response for a browser path, or None when the path is not one of ours."""
    path = request.path.split("?", 1)[0]
    if path == "/app/":
        path = "/app"
    if path in FILES:
        return static(path)
    if path in JSON_VIEWS:
        return JSON_VIEWS[path](server, request)
    if path in FAVICON_PATHS:
        return favicon()
    if path.startswith(("/app/", "/sdk/")):
        return text_response(HTTPStatus.NOT_FOUND, f"no file {path!r}; the SDK is /sdk/streamer.js, the page /app")
    if path == "/dashboard" or path.startswith("/dashboard/"):
        return dashboard_response(path)
    return None


def static(path: str) -> Response:
    name, kind = FILES[path]
    body = resources.files(__package__).joinpath(name).read_bytes()
    headers = [("Content-Type", kind), ("Content-Length", str(len(body))), ("Cache-Control", "no-cache"),
               ("Connection", "close")]
    if path.startswith("/sdk/"):  # importable by pages served elsewhere (module scripts are CORS fetches)
        headers.append(("Access-Control-Allow-Origin", "*"))
    else:
        headers.append(("Content-Security-Policy", APP_CSP))
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, Headers(headers), body)


def text_response(status: HTTPStatus, text: str) -> Response:
    body = text.encode()
    headers = Headers([("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body))),
                       ("Connection", "close")])
    return Response(status.value, status.phrase, headers, body)
