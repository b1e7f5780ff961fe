"""Fuzzing in CI: 10,000+ random and mutated inputs against the protocol core, a live run over a
real socket, and a hypothesis property over schema-shaped messages. No crash, no undocumented
error code, no hang (bench/fuzz.py runs longer campaigns)."""

import asyncio
import importlib.util
import sys
import json
import shutil
from pathlib import Path

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamer.protocol import SCHEMAS, ProtocolError, ServerProtocol

_spec = importlib.util.spec_from_file_location("bench_fuzz", Path(__file__).resolve().parents[2] / "bench" / "fuzz.py")
fuzz = importlib.util.module_from_spec(_spec)
sys.modules["bench_fuzz"] = fuzz  # dataclasses look their module up
_spec.loader.exec_module(fuzz)
CODES = fuzz.documented_codes()


def test_documented_codes_are_read_from_the_docs():
    assert {"invalid_json", "invalid_utf8", "rate_limited", "forbidden", "internal_error"} <= CODES


def test_core_fuzz_10000():
    outcomes = {}
    fuzzed, crashes = fuzz.fuzz_core(12_000, seed=20261130, report=None, outcomes=outcomes)
    assert fuzzed == 12_000 and crashes == [], crashes[:5]
    # the generator reaches the success path and the main error paths
    assert outcomes["ok"] > 500
    assert {"invalid_json", "invalid_utf8", "unknown_field", "invalid_field", "missing_field",
            "unknown_type", "message_too_large"} <= set(outcomes), outcomes


def test_live_fuzz(embedded):
    outcomes = {}
    sent, crashes = asyncio.run(fuzz.fuzz_live(1000, seed=7, report=None, outcomes=outcomes))
    assert sent > 900 and crashes == [], crashes[:5]
    assert outcomes.get("input.ack", 0) + outcomes.get("state", 0) > 5, outcomes  # it reached the engine


def test_store_fault_fuzz(embedded):
    """Appends pipelined while a private Redis is killed, restarted empty and stalled, fuzzed
    messages beside them: every acked input is logged once, in order, and replays to the same
    answer on a second worker (the oracle is in bench/fuzz.py `fuzz_store`)."""
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server (Debian package redis-server)")
    outcomes = {}
    acked, crashes = asyncio.run(fuzz.fuzz_store(1500, seed=11, report=None, outcomes=outcomes))
    assert acked == 1500 and crashes == [], crashes[:5]
    assert outcomes["faults_killed"] + outcomes["faults_stalled"] >= 2, outcomes  # the faults really ran


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12)


@st.composite
def shaped_messages(draw):
    kind = draw(st.sampled_from(sorted(SCHEMAS)) | st.text(max_size=20))
    names = sorted(SCHEMAS.get(kind, {})) + ["event_id", "extra"]
    fields = draw(st.dictionaries(st.sampled_from(names), json_values, max_size=len(names)))
    return {"type": kind, **fields}


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(msg=shaped_messages())
def test_hypothesis_schema_shaped_messages(msg):
    proto = ServerProtocol()
    try:
        cmd = proto.receive_text(json.dumps(msg))
    except ProtocolError as err:
        assert err.code in CODES and err.recoverable and err.message
        json.loads(proto.protocol_error(err))
    else:
        assert cmd.type in SCHEMAS and set(cmd.fields) <= set(SCHEMAS[cmd.type])


@settings(max_examples=1500, deadline=None)
@given(data=st.binary(max_size=300))
def test_hypothesis_bytes(data):
    proto = ServerProtocol()
    for receive in (proto.receive_text, proto.receive_binary):
        try:
            receive(data)
        except ProtocolError as err:
            assert err.code in CODES and err.recoverable
