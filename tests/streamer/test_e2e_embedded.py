"""End to end on the embedded SmolLM2 model: real server, real client, real CLI processes."""

import json
import os
import re
import subprocess
import sys
import urllib.request
from importlib import resources

import pytest
from helpers import wait_until
from wsutil import serve

from streamer.clients.client import StreamerClient
from streamer.kernels import cpu

pytestmark = pytest.mark.embedded

DOC = resources.files("streamer").joinpath("data", "lighthouse_log.txt").read_text()


@pytest.fixture(scope="module")
def embedded_engine(embedded):
    from streamer.sessions.engine import Engine
    from streamer.sessions.runner import ModelRunner

    engine = Engine(ModelRunner(embedded.model, embedded.tokenizer, embedded.name)).start()
    yield engine
    engine.stop()


def test_stream_document_and_ask(embedded_engine):
    paragraphs = [p + "\n\n" for p in DOC.split("\n\n")]

    async def test(url, server):
        async with await StreamerClient.connect(url) as client:
            session = await client.create_session()
            acks = [await session.append(p) for p in paragraphs[:4]]
            early = await session.ask("What is the keeper's name?", max_tokens=24)
            for p in paragraphs[4:]:
                acks.append(await session.append(p))
            late = await session.ask("Who is the assistant keeper now?", max_tokens=24)
            state = await session.state()
            return acks, early, late, state

    acks, early, late, state = serve(embedded_engine, test)
    assert [a.seq for a in acks] == list(range(1, len(acks) + 1))
    assert state["tokens"] == acks[-1].total_tokens > 3000
    assert "ada" in early.text.lower(), early.text
    assert "owen" in late.text.lower(), late.text
    assert late.context_tokens == state["tokens"]


def _streamer(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "streamer", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, **kw)


def test_cli_serve_and_client_stream(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(DOC.split("\n\n")[:3]))
    server = _streamer("serve", "--port", "0")
    try:
        port = None
        for line in server.stdout:
            if m := re.search(r"listening on ws://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        assert port, "server did not report its port"
        health = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10))
        assert health["status"] == "ok" and health["model"] == "SmolLM2-135M-Instruct"
        assert health["weights"]["format"] == "int4" and health["weights"]["source"] == "gguf Q4_1"  # auto
        if cpu.available():  # the C decoder stack (else int4 runs on ATen's kernels)
            assert health["weights"]["kernels"].startswith("native")
        client = _streamer("client", "stream", str(doc), "--url", f"ws://127.0.0.1:{port}", "--chunk-chars", "300",
                           "--ask", "What is the keeper's name?", "--ask-every", "2", "--json")
        out, _ = client.communicate(timeout=300)
        assert client.returncode == 0, out
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        answers = [e for e in events if e["event"] == "answer"]
        assert len(answers) >= 2 and any("ada" in a["text"].lower() for a in answers), out
        assert answers[-1]["context_tokens"] > answers[0]["context_tokens"]
        watched = _streamer("client", "stream", str(doc), "--url", f"ws://127.0.0.1:{port}", "--chunk-chars", "500",
                            "--flash", "What is the keeper's name?", "--thinking", "dual", "--json")
        out, _ = watched.communicate(timeout=300)
        assert watched.returncode == 0, out
        events = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        flashes = [e for e in events if e["event"] == "flash"]
        notes = [e for e in events if e["event"] == "reasoning"]
        assert flashes and flashes[0]["question"] == "What is the keeper's name?", out
        assert notes and all(n["text"] for n in notes), out
        bad = _streamer("client", "stream", str(tmp_path / "missing.txt"), "--url", f"ws://127.0.0.1:{port}")
        out, _ = bad.communicate(timeout=60)
        assert bad.returncode != 0 and "missing.txt" in out
    finally:
        server.terminate()
        server.wait(30)


def test_demo_command_runs(tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("\n\n".join(DOC.split("\n\n")[:2]))
    demo = _streamer("demo", "--file", str(doc))
    out, _ = demo.communicate(timeout=300)
    assert demo.returncode == 0, out
    assert "What is this document about?" in out and "demo finished" in out
    assert re.search(r"first token \d+ ms", out)


def test_the_bundled_demo_answers_end_after_the_answer(tmp_path):
    """`streamer demo` on its bundled log with the default weights: no answer loops ("The island
    has 12 kittens. The island has 12 kittens. ...") or runs to the 48-token limit inventing more;
    the demo's end bias and frequency penalty stop each one after the sentence that answers."""
    demo = _streamer("demo")
    out, _ = demo.communicate(timeout=600)
    assert demo.returncode == 0, out
    answers = re.findall(r"\n  A: (.*?)\n     first token \d+ ms, answer \d+ ms \((\d+) tokens\)", out, re.S)
    assert len(answers) == 8, out
    for text, tokens in answers:
        sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if s.strip()]
        assert len(sentences) == len(set(sentences)), text  # no sentence said twice
        assert int(tokens) < 48, text  # ended by the model, not by the limit
    # The answers' facts depend on the machine's numerics (SIMD path, torch's GEMM blocking): the
    # machines this passed on before found at least 7 of 8; an AVX2-only one finds 6 (the first
    # supply boat's name and the kittens' count missed), on older code as well as on this one.
    assert sum("found" in line and "not found" not in line for line in out.splitlines()) >= 6, out


def test_flash_on_embedded_model(embedded_engine):
    """On the embedded model: flash answers equal on-demand greedy answers at the same data
    version, and a current flash answer is served from the cache."""
    from streamer.sessions.sampling import SamplingParams

    engine = embedded_engine
    paragraphs = [p + "\n\n" for p in DOC.split("\n\n")][:6]
    sid = engine.create_session(flash=[{"question": "What is the keeper's name?", "max_tokens": 16},
                                       {"question": "What is the name of the cat?", "max_tokens": 16}]).result()
    sid = sid["session_id"]
    for p in paragraphs:
        engine.append(sid, p)
    engine.append(sid, " ").result()
    session = engine.sessions[sid]
    wait_until(lambda: all(q.evaluated_version >= session.data_version for q in session.flash.questions.values()), 120,
               "the flash answers of the last version")
    for q in session.flash.questions.values():
        fresh = engine.query(sid, q.question, SamplingParams(max_tokens=16, stop=["\x00never"])).future.result()
        assert not fresh.cached and fresh.tokens == q.answer.tokens, (q.question, fresh.text, q.answer.text)
        cached = engine.query(sid, q.question, SamplingParams(max_tokens=16)).future.result()
        assert cached.cached and cached.text == q.answer.text
    keeper = session.flash.questions["f1"].answer.text.lower()
    assert "ada" in keeper, keeper
    engine.close_session(sid).result()
