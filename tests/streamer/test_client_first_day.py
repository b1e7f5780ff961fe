"""A user's first day with `streamer client` and the Python SDK, against real servers: a media
stream sent to a server that takes none, a key-less client on a keyed server, the answer style
and system prompt the SDK and the CLI use unless told otherwise, and the robot's closing verdict
against what the README promises."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from procutil import ServerProcess
from servers import ThreadedServer

ROOT = Path(__file__).resolve().parents[2]
KEY = "first-day-key-0123456789"


def client(*argv: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`streamer client ARGV` as a user runs it: no $STREAMER_API_KEY unless `env` gives one."""
    base = {k: v for k, v in os.environ.items() if k != "STREAMER_API_KEY"}
    return subprocess.run([sys.executable, "-m", "streamer", "client", *argv], capture_output=True, text=True,
                          timeout=timeout, check=False, env={**base, "HF_HUB_OFFLINE": "1", **(env or {})})


def one_error_line(done: subprocess.CompletedProcess, command: str) -> str:
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr[-3000:]
    assert lines[0].startswith(f"streamer client {command}: error: ") and "Traceback" not in lines[0], lines[0]
    return lines[0]


def sentences(text: str) -> list[str]:
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s.strip()]


@pytest.fixture(scope="module")
def media_files(tmp_path_factory) -> Path:
    """clip.mp4 (a plain MP4 of three coloured scenes, 6 s) and photo.png."""
    av = pytest.importorskip("av")
    sys.path.insert(0, str(ROOT / "tests" / "vision"))
    from videogen import SCENES, encode_image, scene_frame

    tmp = tmp_path_factory.mktemp("media")
    (tmp / "photo.png").write_bytes(encode_image("png", scene_frame(4.5)))
    with av.open(str(tmp / "clip.mp4"), "w") as out:
        stream = out.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = 128, 96, "yuv420p"
        for i in range(60):
            frame = av.VideoFrame.from_ndarray(scene_frame(i / 10, SCENES), format="rgb24")
            frame.pts = i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return tmp


# ---- media to a server that takes none -------------------------------------------------------


@pytest.fixture(scope="module")
def no_media_server():
    with ServerProcess("--model", "tiny", "--store", "memory:", "--no-media") as server:
        yield server


@pytest.mark.parametrize("name", ["clip.mp4", "photo.png"])
def test_media_to_a_no_media_server_stops_at_the_first_refusal_with_one_line(no_media_server, media_files, name):
    """`streamer serve --no-media` refuses every binary frame with `unexpected_binary`, an error
    that names no frame: the CLI printed it once per frame, then waited 120 s for each frame's
    ack. It now sends one frame, waits for its ack or the refusal, and stops: one line, exit 3."""
    server = no_media_server
    done = client("media", str(media_files / name), "--url", server.url, "--piece-bytes", "512", timeout=120)
    line = one_error_line(done, "media")
    assert done.returncode == 3, done.stderr
    assert f"{server.url} takes no media (unexpected_binary: " in line, line
    assert "media input is not enabled on this server" in line and "without --no-media" in line, line
    out = done.stdout.splitlines()
    assert len(out) == 1 and out[0].startswith("session "), done.stdout  # no "! unexpected_binary" lines


# ---- API keys ----------------------------------------------------------------------------------


def test_a_keyless_client_is_told_to_set_streamer_api_key_or_pass_api_key(tiny_engine, tmp_path):
    """The service says "send 'Authorization: Bearer <key>'" (right for SDK authors); the CLI
    user is told, by the error's code, what the CLI takes: $STREAMER_API_KEY or --api-key."""
    from streamer.auth import ApiKeys

    keys = tmp_path / "keys.txt"
    keys.write_text(f"ci:{KEY}\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("The keeper's name is Ada Morrow. ")
    ask = ("ask", "Who is the keeper?", "--max-tokens", "2")
    with ThreadedServer(tiny_engine, api_keys=ApiKeys.from_file(str(keys))) as server:
        keyless = client(*ask, "--url", server.url)
        wrong = client(*ask, "--url", server.url, "--api-key", "not-the-key-0123456789")
        by_flag = client("stream", str(notes), "--ask", "Who?", "--max-tokens", "2", "--url", server.url,
                         "--api-key", KEY)
        by_env = client(*ask, "--url", server.url, env={"STREAMER_API_KEY": KEY})
    line = one_error_line(keyless, "ask")
    assert keyless.returncode == 2 and keyless.stdout == ""
    assert f"{server.url} needs an API key to create a session: set $STREAMER_API_KEY or pass --api-key" in line
    assert "Authorization" not in line and "Bearer" not in line, line
    line = one_error_line(wrong, "ask")
    assert wrong.returncode == 3 and "HTTP 401" in line and "--api-key" in line, line
    assert by_flag.returncode == 0, by_flag.stderr[-3000:]
    assert "Q [" in by_flag.stdout and "A:" in by_flag.stdout
    assert by_env.returncode == 0, by_env.stderr[-3000:]


# ---- what the SDK and the CLI ask with unless told -----------------------------------------------


def test_sdk_sessions_and_flash_questions_take_the_defaults_and_explicit_arguments_win(tiny_engine):
    """What reaches the service, as its event log records it: SDK sessions are told
    SYSTEM_PROMPT and their flash questions take ANSWER_STYLE; a value the call names wins,
    and None leaves it to the service's default."""
    from wsutil import serve

    from streamer.clients.client import ANSWER_STYLE, SYSTEM_PROMPT, StreamerClient

    async def test(url, server):
        async with await StreamerClient.connect(url) as sdk:
            plain = await sdk.create_session(flash=[{"question": "Who?", "flash_id": "who"}])
            await plain.register_flash("Where?", flash_id="where")
            told = await sdk.create_session(None, flash=[{"question": "Who?", "end_bias": 0.0}])
            await told.register_flash("Where?", frequency_penalty=None, end_bias=1.5)
            await plain.append("The keeper's name is Ada Morrow. ")
            styled = await plain.ask("Who is the keeper?", max_tokens=4)
            unstyled = await plain.ask("Who is the keeper?", max_tokens=4, end_bias=None, frequency_penalty=None)
            return [await server.store.read_log(s.id) for s in (plain, told)], styled, unstyled

    (plain, told), styled, unstyled = serve(tiny_engine, test)
    # questions are not logged; their answers show the style arrived: on this tiny random model
    # the end bias ends the answer at once, without it the answer runs to its limit
    assert (styled.finish_reason, unstyled.finish_reason, unstyled.tokens) == ("stop", "length", 4)
    assert styled.tokens < 4
    created, registered = plain[0], next(r for r in plain if r["kind"] == "flash.register")
    assert created["kind"] == "create" and created["system_prompt"] == SYSTEM_PROMPT
    assert all(created["flash"][0][k] == v for k, v in ANSWER_STYLE.items())
    assert all(registered[k] == v for k, v in ANSWER_STYLE.items())
    created, registered = told[0], next(r for r in told if r["kind"] == "flash.register")
    assert created.get("system_prompt") is None  # the service's own default prompt
    assert created["flash"][0]["end_bias"] == 0.0 and created["flash"][0]["frequency_penalty"] == 0.3
    assert registered["end_bias"] == 1.5 and registered.get("frequency_penalty") is None


def test_cli_stream_sends_the_demo_answer_style_unless_a_flag_names_another(tiny_engine, tmp_path):
    """`streamer client stream --flash Q`: the flash question reaches the service with the demo's
    frequency penalty and end bias (they were not sent: off), and --end-bias wins."""
    from streamer.clients.client import ANSWER_STYLE, SYSTEM_PROMPT

    notes = tmp_path / "notes.txt"
    notes.write_text("The keeper's name is Ada Morrow. She lit the lamp at dusk. ")
    with ThreadedServer(tiny_engine) as server:
        runs = [client("stream", str(notes), "--flash", "Who is the keeper?", "--url", server.url, "--json", *flags)
                for flags in ((), ("--end-bias", "0.5"))]
        logs = []
        for done in runs:
            assert done.returncode == 0, done.stderr[-3000:]
            sid = json.loads(done.stdout.splitlines()[0])["session_id"]
            logs.append(server.call(server.server.store.read_log(sid)))
    (default_flash,), (flagged_flash,) = (log[0]["flash"] for log in logs)
    assert logs[0][0].get("system_prompt") == SYSTEM_PROMPT
    assert all(default_flash[k] == v for k, v in ANSWER_STYLE.items())
    assert flagged_flash["end_bias"] == 0.5 and flagged_flash["frequency_penalty"] == ANSWER_STYLE["frequency_penalty"]


@pytest.fixture(scope="module")
def embedded_server():
    """`streamer serve --model embedded` as a user starts it (its default weights), media on."""
    with ServerProcess("--model", "embedded", "--store", "memory:") as server:
        yield server


def test_cli_media_answers_on_the_embedded_model_end_after_they_answer(embedded_server, media_files):
    """`streamer client media clip.mp4 --ask ...` at the CLI's defaults: each answer ends by
    itself before --max-tokens and says no sentence twice (at the service's defaults "What
    happened?" ran to the limit: "The video was cut to the next frame, and the next frame was cut
    to the next frame, and so on. ...")."""
    questions = ["What happened?", "What is in the video?"]
    argv = [a for q in questions for a in ("--ask", q)]
    done = client("media", str(media_files / "clip.mp4"), "--url", embedded_server.url, *argv, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    answers = [e for e in map(json.loads, done.stdout.splitlines()) if e["event"] == "answer"]
    assert [a["question"] for a in answers] == questions
    for answer in answers:
        assert answer["finish_reason"] == "stop" and answer["tokens"] < 64, answer
        said = sentences(answer["text"])
        assert said and len(said) == len(set(said)), answer["text"]


# ---- the robot's verdict, as the README states it ------------------------------------------------


def readme_bands() -> tuple[float, float, tuple[int, int]]:
    """The README's verdict bands and the inference time it says the defaults simulate."""
    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    bands = re.search(r'under (\d\.\d+) of that is "tracking well", above (\d\.\d+) "not following", between '
                      r'them "following, loosely"\. At its defaults the simulated policy takes (\d+)-(\d+) ms', text)
    assert bands, "README.md no longer states the robot's verdict bands and default inference time"
    return float(bands.group(1)), float(bands.group(2)), (int(bands.group(3)), int(bands.group(4)))


def test_robot_at_its_defaults_prints_the_verdict_the_readme_gives_for_its_score(tiny_engine, broker):
    """`streamer client robot` with nothing but where the services are: its closing verdict is
    the README's for the score it printed, the README names the inference time the defaults
    simulate, and the line says why a slow policy trails (at 100-300 ms the score is 0.53-0.58:
    "following, loosely", where the README promised "tracking well" under 0.45)."""
    from mqttutil import clear_retained

    from streamer.clients.cli import add_arguments
    from streamer.clients.robot import DEFAULT_LATENCY_MS, GOOD, POOR
    from streamer.cliargs import Parser

    good, poor, latency = readme_bands()
    assert (good, poor, latency) == (GOOD, POOR, DEFAULT_LATENCY_MS)
    parser = Parser(prog="streamer client")
    add_arguments(parser)
    assert tuple(parser.parse_args(["robot"]).latency_ms) == latency  # what the CLI runs when not told
    prefix = f"t{uuid.uuid4().hex[:8]}"
    with ThreadedServer(tiny_engine, mqtt_url=broker, mqtt_prefix=prefix) as server:
        server.call(asyncio.wait_for(server.server.mqtt.connected.wait(), 10))
        done = client("robot", "--url", server.url, "--mqtt", broker, "--prefix", prefix, timeout=120)
    asyncio.run(clear_retained(broker, prefix))
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.splitlines()[-1]
    found = re.search(r"so (\d\.\d+) of that: (tracking well|following, loosely|not following) \(", last)
    assert found, last
    ratio, verdict = float(found.group(1)), found.group(2)

    def band(r: float) -> str:
        return "tracking well" if r < good else "following, loosely" if r < poor else "not following"

    assert verdict in {band(ratio - 0.005), band(ratio + 0.005)}, last  # the printed ratio is rounded
    assert (f"the policy took {latency[0]}-{latency[1]} ms a chunk" in last and "trails the target" in last
            and "--latency-ms 10 20 tracks well" in last), last
