import pytest


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


