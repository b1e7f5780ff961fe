"""Command-line plumbing shared by `streamer serve|demo|client`: a parser whose errors are one
line, argument types that refuse out-of-range numbers and URLs the service cannot speak, and
the error the CLI prints as one line ending in what to do.

Kept free of torch and the engine, so `streamer client ...` and a failing start answer fast.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit


class CliError(Exception):
    """A mistake the user can fix; the message says what went wrong and what to do."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (argparse prints the usage block first)."""

    def error(self, message: str):  # argparse's hook: never returns
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def configure_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Library chatter (progress bars, hub notices) is noise for a service log.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    for name in ("transformers", "websockets", "httpx", "filelock"):
        logging.getLogger(name).setLevel(logging.WARNING)


def fail(prog: str, exc: BaseException | str, exit_code: int = 2) -> int:
    """Print one error line for `prog` on stderr and return the exit code."""
    text = " ".join(str(exc).split())  # one line, whatever the message held
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return exit_code


def _number(kind: type, text: str) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def bounded(kind: type, lo: float | None = None, hi: float | None = None, *, above: bool = False):
    """An argparse type: a number of `kind` in [lo, hi] (or (lo, hi] with `above`)."""

    def parse(text: str):
        value = _number(kind, text)
        low_bad = lo is not None and (value <= lo if above else value < lo)
        if low_bad or (hi is not None and value > hi):
            if above:
                want = f"greater than {lo:g}" if hi is None else f"in ({lo:g}, {hi:g}]"
            elif hi is None:
                want = "at least 1" if lo == 1 else f"{lo:g} or more"
            else:
                want = f"in [{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"must be {want}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse


positive_int = bounded(int, 1)
nonnegative_int = bounded(int, 0)
nonnegative_float = bounded(float, 0.0)
positive_float = bounded(float, 0.0, above=True)
port = bounded(int, 0, 65535)


# --dtype names, as streamer.sessions.models.parse_dtype takes them (not imported: it pulls in torch)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def dtype_name(text: str) -> str:
    """An argparse type: a model dtype the engine loads (float32, bfloat16, float16 or their
    short names), refused at parse time instead of after the model starts loading."""
    name = text.strip().lower()
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}: use float32, bfloat16 or float16 "
                                         "(or fp32, bf16, fp16)")
    return DTYPES[name]


def ws_url(text: str) -> str:
    """An argparse type: a websocket URL (ws:// or wss://) with a host."""
    parts = urlsplit(text)
    if parts.scheme in ("http", "https") and parts.netloc:
        fixed = parts._replace(scheme="wss" if parts.scheme == "https" else "ws").geturl()
        raise argparse.ArgumentTypeError(f"{text!r} is an HTTP URL; the service speaks websockets: "
                                         f"use {fixed}")
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not a websocket URL: use ws://HOST:PORT, "
                                         "e.g. ws://127.0.0.1:8765")
    try:
        _ = parts.port  # raises for a port that is not a number in range
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} has a bad port: use ws://HOST:PORT with a port "
                                         "in 1..65535") from None
    return text


def read_text(path: str | Path, flag: str = "") -> str:
    """A UTF-8 text file ('-': stdin), or a CliError that says what is wrong with it."""
    name = f"{flag} {path}".strip()
    try:
        data = sys.stdin.buffer.read() if str(path) == "-" else Path(path).expanduser().read_bytes()
    except FileNotFoundError:
        raise CliError(f"cannot read {name}: no such file: check the path") from None
    except IsADirectoryError:
        raise CliError(f"cannot read {name}: it is a directory: give a text file") from None
    except OSError as exc:
        raise CliError(f"cannot read {name} ({exc.strerror}): check the path and its permissions") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        stem = "input" if str(path) == "-" else Path(path).stem
        raise CliError(f"{name} is not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): convert "
                       f"it first, e.g. iconv -f latin1 -t utf-8 {path} > {stem}.utf8.txt") from None
