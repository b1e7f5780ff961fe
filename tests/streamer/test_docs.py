"""Every code block in README.md and docs/*.md that is meant to run, runs.

- ```python blocks run as written (a fresh namespace, as `python file.py` would), against a real
  server: `ws://127.0.0.1:8765` becomes the test server's URL and a placeholder model path
  becomes the tiny one (SUBSTITUTIONS); one that asks a question of FACTS runs on the embedded
  model, and its answers must name the fact;
- ```sh blocks run line by line: `streamer serve ...` starts a real server process on a free
  port (with the tiny model and an in-memory store unless the line names its own), every
  `streamer client ...` runs against the server its block started (or the test server: `--url`
  is added), and each must exit 0;
- a block that is not meant to run says so on the line before it: `<!-- not run by
  tests/streamer/test_docs.py: why -->`, or `<!-- parsed by tests/streamer/test_docs.py, not
  run: why -->` (every `streamer ...` line then goes through the real argument parser, every
  `python bench/...` script and flag must exist); ```text blocks are not code.

A block with no language, or a runnable line this file has no runner for, fails: a new block
is run, or is marked with the reason it is not.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from servers import ThreadedServer

ROOT = Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- (not run by|parsed by) tests/streamer/test_docs\.py(?:, not run)?: (.+?) -->")
SUBSTITUTIONS = {'"path/to/Qwen2.5-VL-3B-Instruct"': '"tiny"'}  # plus the server URL
# A Python block that asks one of these questions runs on the embedded model, as `streamer
# serve` starts it (the tiny model answers noise), and every answer to the question must name
# the fact the block told the session (the README's once answered "The document is a collection
# of books...").
FACTS = {"Who is the keeper?": "Ada Morrow"}
DEFAULT_URL = "ws://127.0.0.1:8765"


@dataclass(frozen=True, slots=True)
class Block:
    path: Path
    line: int  # of the opening fence
    lang: str
    text: str
    mode: str  # "run", "parse" or "skip"
    reason: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, body = i, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        before = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = MARKER.search(before)
        mode, reason = ("run", "")
        if marker:
            mode, reason = ("skip" if marker.group(1) == "not run by" else "parse"), marker.group(2)
        out.append(Block(path, start + 1, fence.group(1), "\n".join(body) + "\n", mode, reason))
    return out


ALL = [b for path in FILES for b in blocks(path)]
CODE = [b for b in ALL if b.lang != "text"]


def test_every_block_says_what_it_is():
    """A fence without a language, or a language without a runner here, is a block nobody checks."""
    assert ALL, "no code blocks found"
    unlabelled = [b.name for b in ALL if not b.lang]
    assert not unlabelled, f"blocks without a language (use ```text for layout): {unlabelled}"
    unknown = [b.name for b in CODE if b.lang not in ("python", "sh") and b.mode != "skip"]
    assert not unknown, f"blocks this test cannot run: {unknown}"
    assert all(b.reason for b in CODE if b.mode != "run")


# ---- the environment the blocks run in ---------------------------------------------------------


@pytest.fixture(scope="module")
def docs_server(tiny_engine):
    with ThreadedServer(tiny_engine) as server:
        yield server


@pytest.fixture(scope="module")
def embedded_docs_server():
    server = Serve(["streamer", "serve", "--model", "embedded"])
    yield server
    assert server.stop() == 0, "".join(server.output[-20:])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The files the README's commands name: notes.txt, clip.mp4 (a plain MP4), photo.jpg."""
    tmp = tmp_path_factory.mktemp("docs")
    (tmp / "notes.txt").write_text("Log of the Gull Island light. The keeper's name is Ada Morrow. She lit the lamp "
                                   "at dusk and wrote down the wind. " * 4)
    try:
        import av
    except ImportError:
        return tmp
    sys.path.insert(0, str(ROOT / "tests" / "vision"))
    from videogen import SCENES, encode_image, scene_frame

    (tmp / "photo.jpg").write_bytes(encode_image("jpeg", scene_frame(4.5)))
    with av.open(str(tmp / "clip.mp4"), "w") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(10):
            frame = av.VideoFrame.from_ndarray(scene_frame(i / 10 * 3, SCENES), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return tmp


# ---- shell -----------------------------------------------------------------------------------


def commands(text: str) -> list[list[str]]:
    """The block's commands: continuation lines joined, comments dropped, split like a shell."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [argv for line in joined.splitlines() if (argv := shlex.split(line, comments=True))]


def parse(argv: list[str], block: Block) -> None:
    """What a `parsed` block promises: the command exists with these flags."""
    if argv[0] == "streamer":
        from streamer.cli import build_parser

        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                build_parser().parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"{block.name}: `{shlex.join(argv)}` does not parse: {err.getvalue().strip()}")
    elif argv[0] == "python" and argv[1].startswith("bench/"):
        script = ROOT / argv[1]
        assert script.is_file(), f"{block.name}: {argv[1]} does not exist"
        source = script.read_text(encoding="utf-8")
        for flag in (a for a in argv[2:] if a.startswith("--")):
            assert f'"{flag}"' in source, f"{block.name}: {argv[1]} has no {flag} flag"
    else:
        pytest.fail(f"{block.name}: no way to check `{shlex.join(argv)}`; mark the block 'not run' with a reason")


class Serve:
    """A `streamer serve` line of a block, started for real on a free port."""

    def __init__(self, argv: list[str]) -> None:
        args = list(argv[2:])
        if "--port" in args:
            args[args.index("--port") + 1] = "0"
        else:
            args += ["--port", "0"]
        for flag, value in (("--model", "tiny"), ("--store", "memory:")):
            if flag not in args:
                args += [flag, value]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "streamer", "serve", *args, "--threads", "1"],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.output: list[str] = []
        ready = threading.Event()
        self.url = None

        def read() -> None:
            for line in self.proc.stdout:
                self.output.append(line)
                found = re.search(r"streamer listening on (ws://\S+)", line)
                if found:
                    self.url = found.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.url is None:
            self.stop()
            raise AssertionError(f"`{shlex.join(argv)}` did not start:\n{''.join(self.output[-20:])}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def run_sh(block: Block, default_url: str, cwd: Path) -> None:
    servers: list[Serve] = []
    try:
        for argv in commands(block.text):
            parse(argv, block)
            if argv[:2] == ["streamer", "serve"]:
                servers.append(Serve(argv))
            elif argv[:2] == ["streamer", "client"]:
                url = servers[-1].url if servers else default_url
                if "--url" not in argv:
                    argv = [*argv, "--url", url]
                done = subprocess.run([sys.executable, "-m", "streamer", *argv[1:]], cwd=cwd, capture_output=True,
                                      text=True, timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
                assert done.returncode == 0, f"{block.name}: `{shlex.join(argv)}` failed:\n{done.stderr[-3000:]}"
                assert "Traceback" not in done.stderr, done.stderr[-3000:]
            else:
                pytest.fail(f"{block.name}: no runner for `{shlex.join(argv)}`: run it here, or mark the block")
    finally:
        for server in servers:
            assert server.stop() == 0, "".join(server.output[-20:])  # SIGTERM: a clean shutdown


# ---- python ----------------------------------------------------------------------------------


def run_python(block: Block, url: str) -> str:
    source = block.text.replace(DEFAULT_URL, url)
    for old, new in SUBSTITUTIONS.items():
        source = source.replace(old, new)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, block.name, "exec"), {"__name__": "__main__"})  # noqa: S102 - our own docs
    return out.getvalue()


def record_answers(monkeypatch) -> list[tuple[str, str]]:
    """(question, answer text) of every `Session.ask` from here on (the real call runs)."""
    from streamer.clients.client import Session

    seen: list[tuple[str, str]] = []
    ask = Session.ask

    async def recording(self, question: str, **options):
        answer = await ask(self, question, **options)
        seen.append((question, answer.text))
        return answer

    monkeypatch.setattr(Session, "ask", recording)
    return seen


@pytest.mark.parametrize("block", CODE, ids=[b.name for b in CODE])
def test_block(block: Block, request):
    if block.mode == "skip":
        assert block.reason
        return
    if block.mode == "parse":
        for argv in commands(block.text):
            parse(argv, block)
        return
    server = request.getfixturevalue("docs_server")
    if block.lang == "python":
        facts = {q: fact for q, fact in FACTS.items() if q in block.text}
        if not facts:
            run_python(block, server.url)
            return
        answers = record_answers(request.getfixturevalue("monkeypatch"))
        run_python(block, request.getfixturevalue("embedded_docs_server").url)
        for question, fact in facts.items():
            said = [text for q, text in answers if q == question]
            assert said and all(fact in text for text in said), f"{block.name}: {question!r} answered {said}"
        return
    needs_media = any("media" in argv[:3] for argv in commands(block.text))
    if needs_media:
        pytest.importorskip("av", reason="media commands need PyAV (pip install -e '.[test]')")
    run_sh(block, server.url, request.getfixturevalue("workdir"))
