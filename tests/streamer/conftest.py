import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from helpers import wait_until


@pytest.fixture(scope="module")
def tiny_engine(tokenizer):
    """An engine on a tiny seeded model with a small context window (cheap overflow tests)."""
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=7)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name),
                    EngineLimits(max_context_tokens=400, max_answer_tokens=64)).start()
    yield engine
    engine.stop()


def _open(port):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def broker():
    """The machine's Mosquitto on 1883, or a private one on a free port."""
    if _open(1883):
        yield "mqtt://127.0.0.1:1883"
        return
    exe = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None)
    if exe is None:
        pytest.skip("no MQTT broker on 127.0.0.1:1883 and no mosquitto binary (apt-get install mosquitto)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_until(lambda: _open(port), 5, "the private mosquitto")
    yield f"mqtt://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)

