"""The bounded text window: sinks + recent inputs, re-anchored by re-prefill; exact against a
fresh session holding the same inputs, and bounded however long the stream runs."""

import pytest
import torch
from helpers import Sync, driven, result

from streamer.sessions.errors import ContextOverflow, InvalidRequest

LINES = [f"[video {i * 0.5:.1f}s] colours: {c} 90%; brightness dim; motion low.\n"
         for i, c in enumerate(["red", "blue", "green", "grey", "white", "pink"] * 20)]


def reference_logits(ref, ids):
    with torch.inference_mode():
        return ref(torch.tensor([ids])).logits[0, -1].float()


def test_window_stays_bounded_and_equals_a_fresh_session(tiny):
    runner, ref = tiny
    engine = Sync(driven(runner, step_tokens=64))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    state = engine.configure_window(sid, max_tokens=prefix + 200, keep_tokens=prefix + 100, sink_inputs=1)
    assert state["window"]["max_tokens"] == prefix + 200
    peak = 0
    for line in LINES:
        peak = max(peak, engine.append(sid, line).total_tokens)
    session = engine.engine.sessions[sid]
    assert peak <= prefix + 200
    window = session.window
    assert window.slides >= 3 and window.dropped_inputs > 0
    # the sink (first input) stays, the newest inputs are kept in order, positions contiguous
    assert session.chunks[0].text == LINES[0]
    assert [c.text for c in session.chunks[1:]] == LINES[len(LINES) - len(session.chunks) + 1:]
    pos = len(session.prefix_ids)
    for chunk in session.chunks:
        assert chunk.start == pos
        pos += len(chunk.tokens)
    assert session.cache.length == pos == len(session.context_ids())
    # exact: the re-anchored cache is what a fresh forward over the kept inputs gives
    expected = reference_logits(ref, session.context_ids())
    assert (session.last_logits.float() - expected).abs().max().item() <= 1e-4
    # a question answers from the windowed cache
    answer = result(engine.engine, engine.engine.query(sid, "What colour?"))
    assert answer.context_tokens == session.cache.length
    assert state["window"]["sink_inputs"] == 1


def test_window_bounds_a_long_stream_and_its_memory(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner, step_tokens=128))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    bound = prefix + 160
    engine.configure_window(sid, max_tokens=bound)
    futures = [engine.engine.append(sid, LINES[i % len(LINES)]) for i in range(600)]  # queued faster than read
    engine.engine.run_until_idle()
    totals = [f.result(0).total_tokens for f in futures]
    state = engine.session_state(sid)
    assert max(totals) <= bound and state["tokens"] <= bound
    session = engine.engine.sessions[sid]
    assert session.cache.capacity <= bound + 64  # the cache's own buffer never grew past the bound
    assert len(session.chunks) < 40
    assert state["window"]["dropped_inputs"] == 600 - len(session.chunks)


def test_window_refusals(tiny):
    runner, _ = tiny
    engine = Sync(driven(runner))
    sid = engine.create_session()["session_id"]
    prefix = engine.session_state(sid)["tokens"]
    with pytest.raises(InvalidRequest, match="max_tokens"):
        engine.configure_window(sid, max_tokens=prefix)
    with pytest.raises(InvalidRequest, match="keep_tokens"):
        engine.configure_window(sid, max_tokens=prefix + 100, keep_tokens=prefix + 101)
    engine.configure_window(sid, max_tokens=prefix + 40)
    with pytest.raises(ContextOverflow, match="window"):
        engine.append(sid, "word " * 60)
    with pytest.raises(InvalidRequest, match="thinking"):
        engine.configure_thinking(sid, {"mode": "dual"})
    assert engine.append(sid, "still fine").seq == 1
