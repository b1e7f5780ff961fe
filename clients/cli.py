"""`streamer client ...`: stream a text file into a session and ask questions along the way."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from streamer.cliargs import CliError, fail, nonnegative_float, nonnegative_int, positive_int, read_text
from streamer.sessions.errors import Code

from .client import SYSTEM_PROMPT, StreamerClient, StreamerError
from .media import add_arguments as media_arguments
from .media import stream_media
from .options import answer_arguments, answer_options, url_argument
from .robot import add_arguments as robot_arguments
from .robot import run as run_robot

# When `client stream` asks over what has been read (query.create `over: "read"`) instead of
# waiting for the session to read everything sent (docs/limits.md, "Sustainable ingest"): the
# newest ack's lag_ms is over --lag-ms, or more inputs than this are unacknowledged.
LAG_MS = 1000.0
LAG_INPUTS = 4


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="client_command", required=True)
    stream = sub.add_parser("stream", help="stream a text file into a new session, asking questions as it grows")
    stream.add_argument("file", type=Path, help="UTF-8 text file ('-' for stdin)")
    url_argument(stream)
    stream.add_argument("--chunk-chars", type=positive_int, default=400, help="characters per append (default: %(default)s)")
    stream.add_argument("--rate", type=nonnegative_float, default=0.0,
                        help="characters per second to stream at; 0 = as fast as the service acks (default)")
    stream.add_argument("--ask", action="append", default=[], metavar="QUESTION",
                        help="a question to ask (repeatable); asked every --ask-every chunks and at the end")
    stream.add_argument("--ask-every", type=nonnegative_int, default=0, metavar="N",
                        help="ask the questions after every N chunks (default: only at the end)")
    stream.add_argument("--max-tokens", type=positive_int, default=64, help="answer token limit (default: %(default)s)")
    stream.add_argument("--lag-ms", type=nonnegative_float, default=LAG_MS, metavar="MS",
                        help=(f"a session whose newest ack's lag_ms is over MS (or with more than {LAG_INPUTS} "
                              "unacknowledged inputs) is lagging: --ask questions are then answered now over what "
                              "it has read (over: read) instead of after its backlog (default: %(default)s)"))
    stream.add_argument("--system-prompt", default=SYSTEM_PROMPT,
                        help="system prompt for the session (default: %(default)r)")
    stream.add_argument("--flash", action="append", default=[], metavar="QUESTION",
                        help="register a flash question (repeatable): re-answered after every chunk, printed on change")
    stream.add_argument("--thinking", choices=["off", "interleaved", "dual"], default=None,
                        help="think while reading; notes are printed as they are written")
    stream.add_argument("--json", action="store_true", help="print one JSON object per event instead of text")
    answer_arguments(stream)
    media_arguments(sub.add_parser("media", help="stream a video, audio or image file (or a camera or microphone) "
                                                 "into a new session; print observations and transcripts"))
    robot = sub.add_parser("robot", help="a simulated robot that follows a target with the session's action policy "
                                         "(needs an MQTT broker and `streamer serve --mqtt`)")
    robot_arguments(robot)
    ask = sub.add_parser("ask", help="create a session from a file (or nothing) and ask one question")
    ask.add_argument("question")
    url_argument(ask)
    ask.add_argument("--context", type=Path, default=None, help="UTF-8 text file to read first ('-' for stdin)")
    ask.add_argument("--max-tokens", type=positive_int, default=64, help="answer token limit (default: %(default)s)")
    answer_arguments(ask)


def chunks_of(text: str, size: int) -> list[str]:
    """Split on whitespace near `size` characters, keeping every character exactly once."""
    if size < 1:
        raise ValueError(f"chunk size must be >= 1, got {size}")
    out, start = [], 0
    while start < len(text):
        end = min(len(text), start + size)
        if end < len(text):
            cut = text.rfind(" ", start + size // 2, end)
            end = cut + 1 if cut > start else end
        out.append(text[start:end])
        start = end
    return out


async def stream_file(args: argparse.Namespace) -> int:
    text = read_text(args.file)  # before connecting: a bad file costs no session
    pieces = chunks_of(text, args.chunk_chars)
    emit = (lambda **kv: print(json.dumps(kv), flush=True)) if args.json else None
    async with await StreamerClient.connect(args.url, args.api_key) as client:
        flash = [{"question": q, **answer_options(args)} for q in args.flash] or None
        thinking = {"mode": args.thinking} if args.thinking else None
        session = await client.create_session(args.system_prompt, flash=flash, thinking=thinking)
        _say(emit, f"session {session.id} on {session.model}", event="session", session_id=session.id)
        printer = asyncio.get_running_loop().create_task(_print_events(client, emit))
        started = time.monotonic()
        sent = 0
        for i, piece in enumerate(pieces, 1):
            if args.rate > 0:  # pace by characters, not by chunks
                delay = started + sent / args.rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
            ack = await session.append(piece)
            sent += len(piece)
            _say(emit, f"  + chunk {ack.seq}: {ack.tokens} tokens, context {ack.total_tokens}, "
                       f"ingest {ack.lag_ms:.0f} ms", event="ack", seq=ack.seq, tokens=ack.tokens,
                 total_tokens=ack.total_tokens, lag_ms=ack.lag_ms)
            if args.ask and args.ask_every and i % args.ask_every == 0 and i < len(pieces):
                await _ask_all(session, args, emit)
        if args.ask:
            await _ask_all(session, args, emit)
        if args.flash or args.thinking:
            await session.end_input()
            await _settle(session)
        await session.close()
        printer.cancel()
    return 0


async def _settle(session, quiet: float = 0.5, limit: float = 120.0) -> None:
    """Wait until flash answers are current for the last input (thinking has finished too)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while loop.time() < deadline:
        state = await session.state()
        flash_ok = all(f.get("data_version") == state["data_version"] for f in state["flash"])
        thinking = state["thinking"]
        thinking_ok = thinking["mode"] == "off" or thinking.get("final_done", True)
        if flash_ok and thinking_ok:
            await asyncio.sleep(quiet)  # let the last events arrive
            return
        await asyncio.sleep(0.1)


async def _print_events(client, emit) -> None:
    async for event in client.events():
        kind = event["type"]
        if kind == "flash.updated":
            _say(emit, f"  * flash [{event['flash_id']}] v{event['data_version']}: {event['answer'].strip()} "
                       f"(gap {event['confidence']['logit_gap']:.2f})", event="flash", **{
                           k: event[k] for k in ("flash_id", "question", "answer", "data_version", "confidence")})
        elif kind == "reasoning.done" and not event.get("repeated"):  # a repeated note is dropped
            _say(emit, f"  ~ notes (unit {event['unit']}, inputs {event['seq_range']}): {event['text'].strip()}",
                 event="reasoning", unit=event["unit"], text=event["text"], seq_range=event["seq_range"])


def lagging(session, lag_ms: float) -> bool:
    """Whether the session reads behind what was sent: more than LAG_INPUTS inputs are
    unacknowledged, or the newest ack's lag_ms is over `lag_ms`."""
    ack = session.last_ack
    return len(session.unacked) > LAG_INPUTS or (ack is not None and ack.lag_ms > lag_ms)


async def _ask_all(session, args, emit) -> None:
    for question in args.ask:
        over = "read" if lagging(session, args.lag_ms) else None  # None: the service's default, "sent"
        answer = await session.ask(question, max_tokens=args.max_tokens, over=over, **answer_options(args))
        t = answer.timing
        covers = (f"\n   lagging: answered over {answer.data_version} inputs; {answer.unread_inputs} still being read"
                  if answer.over == "read" else "")
        _say(emit, f"Q [{answer.context_tokens} tokens read]: {question}\n"
                   f"A: {answer.text.strip()}\n   first token {t['first_token_ms']:.0f} ms, "
                   f"total {t['total_ms']:.0f} ms server / {answer.client_ms:.0f} ms client{covers}",
             event="answer", question=question, text=answer.text, context_tokens=answer.context_tokens,
             timing=t, client_ms=answer.client_ms, over=answer.over, data_version=answer.data_version,
             unread_inputs=answer.unread_inputs)


def _say(emit, line: str, /, **fields) -> None:
    """Print `line`, or with --json the fields as one JSON object (`fields` may hold a
    `message`, as error events do: `line` is positional-only)."""
    if emit:
        emit(**fields)
    else:
        print(line, flush=True)


async def ask_once(args: argparse.Namespace) -> int:
    context = read_text(args.context, "--context") if args.context else ""
    async with await StreamerClient.connect(args.url, args.api_key) as client:
        session = await client.create_session()
        for piece in chunks_of(context, 2000):
            await session.append(piece)
        stream = await session.ask_stream(args.question, max_tokens=args.max_tokens, **answer_options(args))
        async for delta in stream:
            print(delta, end="", flush=True)
        print()
        await session.close()
    return 0


def run(args: argparse.Namespace) -> int:
    """Run a client command; every failure is one line on stderr and a non-zero exit."""
    prog = f"streamer client {args.client_command}"
    try:
        if args.client_command == "robot":
            return run_robot(args)
        command = {"stream": stream_file, "ask": ask_once, "media": stream_media}[args.client_command]
        return asyncio.run(command(args))
    except CliError as exc:
        return fail(prog, exc, exc.exit_code)
    except StreamerError as exc:
        if exc.code == Code.UNAUTHORIZED:  # by code: the service's message speaks of HTTP headers
            return fail(prog, f"{args.url} needs an API key to create a session: set $STREAMER_API_KEY or pass "
                              "--api-key (a key from the server's --api-keys-file)")
        return fail(prog, f"the service refused it: {exc}")
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        problem = connection_problem(exc, args.url)
        if problem is None:
            raise
        return fail(prog, problem, 3)


def connection_problem(exc: Exception, url: str) -> str | None:
    """What to tell the user about a failure to reach or keep talking to the service (None:
    not a connection problem)."""
    import socket

    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI

    if isinstance(exc, InvalidURI):
        return f"{url} is not a websocket URL: use ws://HOST:PORT"
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        if status == 401:
            return (f"{url} refused the API key (HTTP 401): set $STREAMER_API_KEY (or pass --api-key) to a key "
                    "from the server's --api-keys-file")
        return f"{url} answered HTTP {status} instead of opening a websocket: is it a streamer service?"
    if isinstance(exc, InvalidHandshake):
        return f"{url} did not answer as a websocket server ({exc}): is it a streamer service?"
    if isinstance(exc, ConnectionClosed):
        return f"the service at {url} closed the connection ({exc}): it may have stopped; start it and retry"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve the host of {url} ({exc.strerror}): check --url"
    if isinstance(exc, ConnectionRefusedError):
        return f"cannot reach {url} (connection refused): is `streamer serve` running there? check --url"
    if isinstance(exc, TimeoutError):
        return f"no answer from {url} (timed out): check --url and that the service is up"
    if isinstance(exc, ConnectionError):  # the client's reader: the connection went away mid-command
        return f"lost the connection to {url} ({exc}): the service may have stopped; start it and retry"
    if isinstance(exc, OSError) and exc.filename is None:
        return f"cannot reach {url} ({exc.strerror or exc}): check --url and that the service is up"
    return None
