"""Fair share over a real websocket: one client (its own API key) runs 96 long flash questions
and long questions of its own on six sessions fed all the time; another client's questions keep
the bound the scheduler states (docs/protocol.md, *Scheduling and the fair share*).

The bound is checked in engine steps and tokens, which do not depend on how busy the machine is:
a bystander's question waits for no step beyond the one running when it arrives (one more at
most, for input aged past the question class), runs in as many steps as it does on an idle
server (one more at most), and no step it runs in carries more than max(`query_step_tokens`, its
question's tokens) tokens of anyone's work. The load is `bench/fairness.py --flash`'s, which
also measures the wall-clock ratio (printed here)."""

import importlib.util
import statistics
import sys
from pathlib import Path

import pytest

from streamer.auth import ApiKeys
from streamer.sessions.engine import Engine, EngineLimits
from streamer.sessions.models import build_tiny_model
from streamer.sessions.runner import ModelRunner
from wsutil import serve

_spec = importlib.util.spec_from_file_location("bench_fairness",
                                               Path(__file__).resolve().parents[2] / "bench" / "fairness.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules["bench_fairness"] = bench
_spec.loader.exec_module(bench)

LOADER, BYSTANDER = "k-loader-0123456789", "k-bystander-0123456789"
QUERY_STEP = 64


@pytest.fixture()
def engine(tokenizer):
    lm = build_tiny_model(tokenizer, seed=11, max_positions=4096)
    engine = Engine(ModelRunner(lm.model, tokenizer, lm.name),
                    EngineLimits(max_context_tokens=4096, query_step_tokens=QUERY_STEP, step_tokens=512)).start()
    yield engine
    engine.stop()


def test_a_bystanders_questions_keep_their_bound_beside_96_long_flash_questions(engine):
    async def test(url, server):
        return await bench.flash_load(url, LOADER, BYSTANDER, idle_n=5, loaded_n=8)

    idle, loaded, pushed = serve(engine, test, api_keys=ApiKeys({"loader": LOADER, "bystander": BYSTANDER}))
    assert all(q["text"] == idle[0]["text"] for q in idle + loaded)  # the same data: the same answer
    own = idle[0]["question_tokens"]
    idle_steps = max(q["timing"]["steps"] for q in idle)
    for q in loaded:
        t = q["timing"]
        assert t["steps_waited"] <= 1, t
        assert t["steps"] <= idle_steps + 1, (t, idle_steps)
        assert t["max_step_tokens"] <= max(QUERY_STEP, own), (t, own)
    # the load really shared its steps: other work rode along in them, flash answers kept coming
    assert max(q["timing"]["max_step_tokens"] for q in loaded) > max(q["timing"]["max_step_tokens"] for q in idle)
    assert pushed["flash.updated"] >= 1 and pushed["query.done"] > 0 and pushed["errors"] == 0, pushed
    p50_idle = statistics.median(q["timing"]["total_ms"] for q in idle)
    p99_loaded = max(q["timing"]["total_ms"] for q in loaded)
    print(f"bystander total_ms: idle p50 {p50_idle:.1f}, loaded max {p99_loaded:.1f} "
          f"({p99_loaded / max(p50_idle, 1e-3):.2f}x); loader pushes {pushed}")
