"""The command-line arguments every client command shares: the service's URL and API key, and
the answer flags (penalties, end bias) with the SDK's answer style as their default."""

from __future__ import annotations

import argparse

from streamer.cliargs import bounded, ws_url

from .client import ANSWER_STYLE

DEFAULT_URL = "ws://127.0.0.1:8765"


def url_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", type=ws_url, default=DEFAULT_URL, help="service URL (default: %(default)s)")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="API key for a service started with --api-keys-file (default: $STREAMER_API_KEY)")


ANSWER_FLAGS = (
    ("repetition_penalty", bounded(float, 0.0, 10.0, above=True),
     "scale down tokens the answer already produced, in (0, 10] (default: 1, off)"),
    ("presence_penalty", bounded(float, -2.0, 2.0), "subtract once from tokens the answer produced, in [-2, 2] (default: 0)"),
    ("frequency_penalty", bounded(float, -2.0, 2.0),
     f"subtract per time a token was produced, in [-2, 2] (default: {ANSWER_STYLE['frequency_penalty']:g}, as "
     "`streamer demo`; 0: off)"),
    ("end_bias", bounded(float, -10.0, 10.0),
     ("add to the end-of-answer tokens' logits, in [-10, 10]: above 0 answers end sooner "
      f"(default: {ANSWER_STYLE['end_bias']:g}, as `streamer demo`; 0: off)")),
)


def answer_arguments(parser: argparse.ArgumentParser) -> None:
    """--repetition-penalty, --presence-penalty, --frequency-penalty, --end-bias (docs/protocol.md,
    "Penalties"); unset ones take the SDK's ANSWER_STYLE (frequency penalty and end bias as
    `streamer demo`, which stop the embedded model's loops) or else the service's defaults (off)."""
    for name, kind, help_text in ANSWER_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None, help=help_text)


def answer_options(args: argparse.Namespace) -> dict:
    """The answer flags that were given, as query.create / flash.register fields."""
    return {name: getattr(args, name) for name, _, _ in ANSWER_FLAGS if getattr(args, name, None) is not None}
