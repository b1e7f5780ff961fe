"""Every ordinary mistake with the `streamer` command gets one line on stderr that says what to
do, and a non-zero exit: each case runs the real CLI as a subprocess (against real servers
where it needs one). Optional packages are made missing by blocking their import in the child
(`sys.modules[name] = None`), exactly what Python does for a package that is not installed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from servers import ThreadedServer

RUN = ("import sys; blocked = sys.argv.pop(1); sys.modules.update(dict.fromkeys(filter(None, blocked.split(','))));"
       "from streamer.cli import main; sys.exit(main())")
KEY = "cli-test-key-0123456789"


@dataclass(frozen=True, slots=True)
class Case:
    argv: tuple[str, ...]
    code: int
    says: tuple[str, ...]  # substrings of the one line, in order
    block: tuple[str, ...] = ()  # modules that are "not installed"
    env: tuple[tuple[str, str], ...] = ()


CASES = {
    # --url and the network
    "http-url": Case(("client", "ask", "hi", "--url", "http://127.0.0.1:{port}"), 2,
                     ("argument --url", "is an HTTP URL", "use ws://127.0.0.1:{port}")),
    "not-a-url": Case(("client", "stream", "{tmp}/notes.txt", "--url", "notaurl"), 2,
                      ("argument --url", "not a websocket URL", "ws://HOST:PORT")),
    "nobody-there": Case(("client", "ask", "hi", "--url", "ws://127.0.0.1:{dead}"), 3,
                         ("cannot reach ws://127.0.0.1:{dead}", "connection refused", "streamer serve")),
    "wrong-api-key": Case(("client", "ask", "hi", "--url", "{keyed}"), 3, ("HTTP 401", "STREAMER_API_KEY"),
                          env=(("STREAMER_API_KEY", "not-the-key-0123456789"),)),
    "refused-by-service": Case(("client", "ask", "hi", "--max-tokens", "100000", "--url", "{url}"), 2,
                               ("the service refused it", "max_tokens_too_large")),
    # files
    "not-utf8": Case(("client", "stream", "{tmp}/latin1.txt", "--url", "{url}"), 2,
                     ("latin1.txt is not UTF-8 text", "byte 0xe9", "iconv")),
    "context-not-utf8": Case(("client", "ask", "hi", "--context", "{tmp}/latin1.txt", "--url", "{url}"), 2,
                             ("--context", "not UTF-8 text")),
    "missing-file": Case(("client", "stream", "{tmp}/nope.txt", "--url", "{url}"), 2,
                         ("cannot read", "nope.txt", "no such file")),
    "directory": Case(("client", "stream", "{tmp}", "--url", "{url}"), 2, ("is a directory",)),
    "media-text-file": Case(("client", "media", "{tmp}/notes.txt", "--url", "{media}"), 2,
                            ("notes.txt", "not a video, audio or image file",)),
    "media-corrupt-jpeg": Case(("client", "media", "{tmp}/corrupt.jpg", "--url", "{media}"), 2,
                               ("corrupt.jpg is not a picture", "JPEG or PNG")),
    "media-text-as-jpeg": Case(("client", "media", "{tmp}/notes.jpg", "--url", "{media}"), 2,
                               ("notes.jpg is not a picture",)),
    "media-missing": Case(("client", "media", "{tmp}/nope.mp4", "--url", "{media}"), 2, ("no such file",)),
    "media-directory": Case(("client", "media", "{tmp}", "--url", "{media}"), 2, ("is a directory",)),
    "media-refused-by-service": Case(("client", "media", "{tmp}/big.png", "--url", "{strict}"), 1,
                                     ("could not use all of", "big.png", "1 media error", "'!'")),
    "media-without-pyav": Case(("client", "media", "{tmp}/clip.mp4", "--url", "{media}"), 2,
                               ("'media' extra", "pip install 'streamer[media]'"), block=("av",)),
    # numbers
    "negative-rate": Case(("client", "stream", "{tmp}/notes.txt", "--rate", "-5"), 2,
                          ("argument --rate", "0 or more", "got -5", "--help")),
    "zero-chunk": Case(("client", "stream", "{tmp}/notes.txt", "--chunk-chars", "0"), 2,
                       ("argument --chunk-chars", "at least 1")),
    "not-a-number": Case(("client", "ask", "hi", "--max-tokens", "many"), 2,
                         ("argument --max-tokens", "expected an integer", "'many'")),
    "end-bias-range": Case(("client", "ask", "hi", "--end-bias", "12"), 2,
                           ("argument --end-bias", "in [-10, 10]", "got 12")),
    "media-fps": Case(("client", "media", "x.mp4", "--fps", "0"), 2, ("argument --fps", "greater than 0")),
    "robot-latency": Case(("client", "robot", "--latency-ms", "300", "100"), 2, ("MIN must not exceed MAX",)),
    "robot-no-broker": Case(("client", "robot", "--url", "{url}", "--mqtt", "mqtt://127.0.0.1:{dead}"), 2,
                            ("cannot reach the MQTT broker", "mosquitto")),
    "robot-without-aiomqtt": Case(("client", "robot", "--url", "{url}"), 2,
                                  ("'mqtt' extra", "pip install 'streamer[mqtt]'"), block=("aiomqtt",)),
    "port-out-of-range": Case(("serve", "--port", "70000"), 2, ("argument --port", "[0, 65535]")),
    "no-subcommand": Case(("client",), 2, ("required",)),
    # serve and demo: found before the model loads (the model path does not even exist)
    "busy-port": Case(("serve", "--port", "{busy}", "--model", "/nonexistent/model", "--store", "memory:"), 2,
                      ("port {busy}", "already in use", "--port")),
    "mqtt-extra": Case(("serve", "--mqtt", "mqtt://127.0.0.1:1883", "--model", "/nonexistent/model"), 2,
                       ("--mqtt needs the 'mqtt' extra", "pip install 'streamer[mqtt]'"), block=("aiomqtt",)),
    "redis-extra": Case(("serve", "--store", "redis://127.0.0.1:6379/0", "--model", "/nonexistent/model"), 2,
                        ("--store redis:// needs the 'redis' extra", "pip install 'streamer[redis]'"),
                        block=("redis",)),
    "media-extra": Case(("serve", "--model", "tiny-vl"), 2,
                        ("'media' extra", "pip install 'streamer[media]'"), block=("av",)),
    "triton-extra": Case(("serve", "--attention-backend", "triton", "--model", "/nonexistent/model"), 2,
                         ("'triton' extra", "pip install 'streamer[triton]'"), block=("triton",)),
    "weights-off-cpu": Case(("serve", "--port", "0", "--store", "memory:", "--model", "tiny", "--device", "cuda",
                             "--weights", "int4"), 2, ("--weights int4 runs on ATen's CPU kernels", "--weights fp32")),
    "redis-down": Case(("serve", "--port", "0", "--store", "redis://127.0.0.1:{dead}/0", "--model",
                        "/nonexistent/model"), 2, ("cannot reach Redis", "redis-server", "--store")),
    "broker-down": Case(("serve", "--port", "0", "--store", "memory:", "--mqtt", "mqtt://127.0.0.1:{dead}",
                         "--model", "/nonexistent/model"), 2, ("cannot reach the MQTT broker", "--mqtt")),
    "bad-store-url": Case(("serve", "--port", "0", "--store", "ftp://x/y", "--model", "/nonexistent/model"), 2,
                          ("unknown --store URL", "redis://")),
    "no-model": Case(("serve", "--port", "0", "--store", "memory:", "--model", "/nonexistent/model"), 2,
                     ("--model /nonexistent/model", "no such directory")),
    "bad-limit": Case(("serve", "--port", "0", "--store", "memory:", "--limit", "nope=1"), 2,
                      ("--limit", "'--limit help'")),
    "keys-file-missing": Case(("serve", "--api-keys-file", "{tmp}/no-keys.txt"), 2, ("no-keys.txt",)),
    "keys-file-bad-role": Case(("serve", "--api-keys-file", "{tmp}/bad-role.txt"), 2,
                               ("bad-role.txt:2", "unknown role 'admin'", "role=operator or role=tenant")),
    "demo-not-utf8": Case(("demo", "--file", "{tmp}/latin1.txt", "--model", "/nonexistent/model"), 2,
                          ("--file", "not UTF-8 text")),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tiny_engine, tokenizer, tmp_path_factory):
    """Every case, run as a subprocess (a few at a time), with the servers they talk to."""
    from streamer.sessions.engine import Engine
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner
    from streamer.vision.ingest import VideoConfig
    from streamer.vision.video import DecodeLimits

    from streamer.auth import ApiKeys
    from streamer.media import MediaConfig

    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "notes.txt").write_text("The keeper's name is Ada Morrow. ")
    (tmp / "notes.jpg").write_text("not a picture")
    (tmp / "latin1.txt").write_bytes("Caf\xe9 au lait.".encode("latin-1"))
    (tmp / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + os.urandom(2000))
    (tmp / "clip.mp4").write_bytes(b"\x00" * 64)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vision"))
    from videogen import encode_image

    (tmp / "big.png").write_bytes(encode_image("png", np.zeros((120, 160, 3), np.uint8)))
    keys = tmp / "keys.txt"
    keys.write_text(f"ci:{KEY}\n")
    (tmp / "bad-role.txt").write_text(f"ci:{KEY} role=tenant\nops:{KEY}x role=admin\n")
    lm = build_tiny_model(tokenizer, seed=3)  # an engine of its own: it must see no session at all
    media_engine = Engine(ModelRunner(lm.model, tokenizer, lm.name)).start()
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    strict_media = MediaConfig(video=VideoConfig(decode=DecodeLimits(max_pixels=100 * 100)))
    with ThreadedServer(tiny_engine) as server, ThreadedServer(media_engine) as media, \
            ThreadedServer(tiny_engine, api_keys=ApiKeys.from_file(str(keys))) as keyed, \
            ThreadedServer(tiny_engine, media=strict_media) as strict:
        values = {"url": server.url, "port": server.port, "media": media.url, "keyed": keyed.url,
                  "strict": strict.url, "dead": free_port(), "busy": busy.getsockname()[1], "tmp": str(tmp)}
        with ThreadPoolExecutor(4) as pool:
            runs = dict(zip(CASES, pool.map(lambda c: _run(c, values), CASES.values())))
        sessions_on_media = media_engine.snapshot_stats()["sessions_created"]
    busy.close()
    media_engine.stop()
    return runs, values, sessions_on_media


def _run(case: Case, values: dict) -> subprocess.CompletedProcess:
    argv = [a.format(**values) for a in case.argv]
    env = {k: v for k, v in os.environ.items() if k != "STREAMER_API_KEY"}
    env.update(HF_HUB_OFFLINE="1", **dict(case.env))
    return subprocess.run([sys.executable, "-c", RUN, ",".join(case.block), *argv], capture_output=True, text=True,
                          check=False, timeout=120, env=env, cwd=values["tmp"])


@pytest.mark.parametrize("name", list(CASES))
def test_one_line_and_a_non_zero_exit(results, name):
    runs, values, _ = results
    case, run = CASES[name], runs[name]
    lines = run.stderr.splitlines()
    assert run.returncode == case.code, (run.returncode, run.stderr[-2000:])
    assert len(lines) == 1, run.stderr[-2000:]
    line = lines[0]
    assert line.startswith(f"streamer {case.argv[0]}"), line
    assert "Traceback" not in line and ": error: " in line
    at = 0
    for part in case.says:
        found = line.find(part.format(**values), at)
        assert found >= 0, f"{part.format(**values)!r} not in {line!r} (after column {at})"
        at = found
    if case.code != 1:  # 1: the service refused part of the stream, and the output says which
        assert run.stdout == "", run.stdout
    else:
        assert "  ! " in run.stdout, run.stdout


def test_bad_media_files_are_refused_before_a_session_is_created(results):
    runs, _, sessions = results
    assert all(runs[n].returncode == 2 for n in CASES if n.startswith("media-") and "service" not in n)
    assert sessions == 0


def test_the_detach_ttl_default_is_the_durability_one():
    """The CLI repeats the default instead of importing it (the import pulls in torch)."""
    from streamer.cli import DETACH_TTL_S
    from streamer.resume import DEFAULT_DETACH_TTL_S

    assert DETACH_TTL_S == DEFAULT_DETACH_TTL_S
