import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from skipsummary import pytest_terminal_summary  # noqa: E402, F401  (a hook: the run ends with its skips)


@pytest.fixture(scope="session")
def embedded():
    """The embedded SmolLM2 model (converted once into the user cache)."""
    from streamer.sessions.models import load_model

    return load_model("embedded")


@pytest.fixture(scope="session")
def tokenizer(embedded):
    return embedded.tokenizer


@pytest.fixture(scope="session")
def tiny(tokenizer):
    """A tiny seeded fp32 Llama with the embedded tokenizer, and an untouched twin for
    stateless reference runs (stock SDPA attention, stock generate)."""
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=1234)
    ref = build_tiny_model(tokenizer, seed=1234).model
    ref.set_attn_implementation("sdpa")
    return ModelRunner(lm.model, tokenizer, lm.name), ref


@pytest.fixture()
def engine_factory():
    from streamer.sessions.engine import Engine

    engines = []

    def make(runner, **limits):
        from streamer.sessions.engine import EngineLimits

        engine = Engine(runner, EngineLimits(**limits)).start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
