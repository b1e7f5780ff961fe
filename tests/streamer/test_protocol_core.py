"""Strict unit tests of streamer.protocol: the sans-I/O wire protocol (no sockets, no model).

Frames in -> typed `Command`s or `ProtocolError` with a stable code; events out as JSON text.
"""

from __future__ import annotations

import json
import math
import random
import time

import pytest

from streamer import protocol as P
from streamer.protocol import SCHEMAS, Command, ProtocolError, ProtocolLimits, ServerProtocol

CODES = {
    P.INVALID_JSON, P.INVALID_UTF8, P.NOT_AN_OBJECT, P.UNKNOWN_TYPE, P.MISSING_FIELD,
    P.INVALID_FIELD, P.UNKNOWN_FIELD, P.MESSAGE_TOO_LARGE, P.UNEXPECTED_BINARY,
    P.TEXT_TOO_LONG, P.QUESTION_TOO_LONG, P.SYSTEM_PROMPT_TOO_LONG, P.PATTERN_TOO_LONG, P.FLASH_LIMIT,
    P.MEDIA_HEADER_INVALID, P.UNSUPPORTED_MEDIA, P.MEDIA_TOO_LARGE,
}

# One valid message per type, with every field the schema knows (session_id included).
FULL = {
    "session.create": {"system_prompt": "Be brief. — ünïcode ✓", "session_id": "s-1",
                       "flash": [{"question": "Who?", "flash_id": "f-1", "max_tokens": 8, "priority": 2,
                                  "min_interval_ms": 100, "confirm": 2, "repetition_penalty": 1.1,
                                  "presence_penalty": 0.1, "frequency_penalty": 0.2, "end_bias": 1.5},
                                 {"question": "Where?"}],
                       "thinking": {"mode": "dual", "every_tokens": 64, "unit_tokens": 16, "stop": "sentence",
                                    "final_tokens": 32, "max_tokens": 512, "positions": "after", "offset": 0,
                                    "question": "Who?", "prompt": "Notes."},
                       "window": {"max_tokens": 2048, "keep_tokens": 1024, "sink_inputs": 1}},
    "session.update": {"session_id": "s-1", "thinking": {"mode": "off"}, "window": {"max_tokens": 512}},
    "session.get": {"session_id": "s-1"},
    "session.close": {"session_id": "s-1"},
    "input.text.append": {"session_id": "s-1", "text": "hello wörld ✓\n", "client_seq": 7},
    "input.text.revise": {"session_id": "s-1", "text": "revised", "from_seq": 3, "client_seq": 8},
    "input.end": {"session_id": "s-1"},
    "query.create": {
        "session_id": "s-1", "question": "What?", "query_id": "q-1", "max_tokens": 32,
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 123, "stop": ["\n\n", "END"],
        "stream": False, "over": "read", "repetition_penalty": 1.1, "presence_penalty": 0.2,
        "frequency_penalty": 0.3, "end_bias": 2.0,
    },
    "query.cancel": {"session_id": "s-1", "query_id": "q-1"},
    "flash.register": {"session_id": "s-1", "question": "Who?", "flash_id": "f-1", "max_tokens": 8,
                       "priority": -3, "min_interval_ms": 0, "confirm": 1, "repetition_penalty": 1.2,
                       "presence_penalty": 0.0, "frequency_penalty": 0.5, "end_bias": -1.0},
    "flash.unregister": {"session_id": "s-1", "flash_id": "f-1"},
    "subscribe": {"session_id": "s-1", "token": "tok-1"},
    "unsubscribe": {"session_id": "s-1"},
    "session.resume": {"session_id": "s-1", "token": "tok-1", "last_client_seq": 7},
    "sessions.list": {"session_id": "s-1"},
    "action.rule": {"session_id": "s-1", "flash_id": "f-1", "pattern": "^yes", "command": {"do": "stop"},
                    "debounce_ms": 100, "rule_id": "r-1"},
    "action.rule.remove": {"session_id": "s-1", "rule_id": "r-1"},
    "action.start": {"session_id": "s-1", "policy": "tracker", "mode": "async", "dt_ms": 50, "horizon": 8,
                     "latency_ms": [100, 300], "gain": 2.0, "max_speed": 1.0},
    "action.stop": {"session_id": "s-1"},
    "robot.state": {"session_id": "s-1", "state": [0.5, 1.0], "ts": 12.5},
}


def minimal(kind: str) -> dict:
    """The smallest valid message of `kind`: only its required fields."""
    msg = {"type": kind}
    for name, spec in SCHEMAS[kind].items():
        if spec.required:
            msg[name] = FULL[kind][name]
    return msg


def full(kind: str, event_id: str | None = "e-1") -> dict:
    msg = {"type": kind, **FULL[kind]}
    if event_id is not None:
        msg["event_id"] = event_id
    return msg


def dumps(msg) -> str:
    """JSON text; infinite floats are written as 1e999 (which parses to inf) rather than Infinity."""
    return json.dumps(msg).replace("-Infinity", "-1e999").replace("Infinity", "1e999")


def parse(msg, proto: ServerProtocol | None = None) -> Command:
    data = msg if isinstance(msg, (str, bytes, bytearray, memoryview)) else dumps(msg)
    return (proto or ServerProtocol()).receive_text(data)


def fail(msg, code: str, proto: ServerProtocol | None = None, param: str | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse(msg, proto)
    err = info.value
    assert err.code == code, (err.code, err.message)
    assert err.recoverable is True
    assert isinstance(err.message, str) and err.message
    assert str(err) == err.message
    assert err.param == param
    return err


ALL_FIELDS = [(kind, name) for kind, schema in SCHEMAS.items() for name in schema]


# ---- sanity of the test data --------------------------------------------------------------------


def test_codes_match_module_constants():
    constants = {v for k, v in vars(P).items() if k.isupper() and isinstance(v, str) and not k.startswith("_")}
    assert constants == CODES


def test_full_examples_cover_every_schema_field():
    assert set(FULL) == set(SCHEMAS)
    for kind, schema in SCHEMAS.items():
        assert set(FULL[kind]) == set(schema), kind


# ---- valid messages -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_type_parses_with_all_fields(kind):
    cmd = parse(full(kind))
    assert isinstance(cmd, Command)
    assert cmd.type == kind
    assert cmd.event_id == "e-1"
    expected = dict(FULL[kind])
    sid = expected.pop("session_id")
    assert cmd.session_id == sid
    assert "session_id" not in cmd.fields
    assert cmd.fields == expected
    for name, value in expected.items():
        assert cmd[name] == value
        assert type(cmd[name]) is type(value)


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_every_type_parses_with_required_fields_only(kind):
    msg = minimal(kind)
    cmd = parse(msg)
    assert cmd.type == kind
    assert cmd.event_id is None
    assert cmd.session_id == msg.get("session_id")
    assert cmd.fields == {k: v for k, v in msg.items() if k not in ("type", "session_id")}
    for name in SCHEMAS[kind]:
        if name not in msg and name != "session_id":
            assert cmd[name] is None


def test_session_create_without_session_id():
    cmd = parse({"type": "session.create"})
    assert cmd == Command("session.create", None, None, {})
    cmd = parse({"type": "session.create", "session_id": None, "system_prompt": None, "event_id": None})
    assert cmd == Command("session.create", None, None, {})


@pytest.mark.parametrize("kind,name", [(k, n) for k, n in ALL_FIELDS
                                       if not SCHEMAS[k][n].required and not SCHEMAS[k][n].nullable])
def test_optional_field_given_as_null_is_dropped(kind, name):
    msg = full(kind)
    msg[name] = None
    cmd = parse(msg)
    assert name not in cmd.fields
    assert cmd[name] is None


@pytest.mark.parametrize("kind,name", [(k, n) for k, n in ALL_FIELDS if SCHEMAS[k][n].nullable])
def test_a_nullable_field_given_as_null_is_kept(kind, name):
    msg = full(kind)
    msg[name] = None
    cmd = parse(msg)
    assert name in cmd.fields and cmd[name] is None  # window: null asks for an unbounded session
    assert name not in parse({k: v for k, v in msg.items() if k != name}).fields


def test_bytes_bytearray_memoryview_and_str_inputs_are_equivalent():
    text = json.dumps(full("query.create"), ensure_ascii=False)
    raw = text.encode()
    results = [parse(text), parse(raw), parse(bytearray(raw)), parse(memoryview(raw))]
    assert all(r == results[0] for r in results)
    assert results[0].fields["question"] == "What?"


def test_non_ascii_text_survives():
    text = "naïve — 日本語 🙂"
    cmd = parse(json.dumps({"type": "input.text.append", "session_id": "s", "text": text}, ensure_ascii=False))
    assert cmd["text"] == text
    cmd = parse(json.dumps({"type": "input.text.append", "session_id": "s", "text": text}))  # \u escapes
    assert cmd["text"] == text


def test_whitespace_around_json_is_fine():
    assert parse('  \n\t{"type": "session.get", "session_id": "s"}\r\n ').type == "session.get"


def test_duplicate_keys_last_one_wins():
    cmd = parse('{"type":"session.get","session_id":"a","session_id":"b"}')
    assert cmd.session_id == "b"


def test_command_getitem_and_defaults():
    cmd = Command("x")
    assert cmd.event_id is None and cmd.session_id is None and cmd.fields == {}
    assert cmd["anything"] is None
    assert Command("x").fields is not Command("x").fields


def test_protocol_error_defaults():
    err = ProtocolError("invalid_field", "msg")
    assert isinstance(err, Exception)
    assert (err.code, err.message, err.recoverable, err.reply_to, err.session_id, err.param) == (
        "invalid_field", "msg", True, None, None, None)
    assert str(err) == "msg"
    with pytest.raises(ValueError):  # codes are the documented ones (streamer.sessions.errors.Code)
        ProtocolError("code", "msg")


def test_default_limits():
    lim = ServerProtocol().limits
    assert lim == ProtocolLimits()
    assert (lim.max_message_bytes, lim.max_text_chars, lim.max_question_chars,
            lim.max_system_prompt_chars, lim.max_id_chars) == (1 << 20, 256 * 1024, 8 * 1024, 16 * 1024, 64)


# ---- invalid_json -------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [
    "", " ", "{", "}", '{"type": "session.get",}', "{'type': 'session.get'}", '{"type" "x"}',
    "[1, 2", "tru", "nul", '{"a": 1} {"b": 2}', '{"a": 1}x', '"unterminated', "\ufeff{}",
    '{"type": "input.text.append", "session_id": "s", "text": "a\x00b"}',  # raw control char
    '{"type": "session.get", "session_id": "s"}\x00',
    '{"a": ' + "9" * 5000 + "}",  # int beyond the str->int digit limit
    b"",
])
def test_invalid_json(data):
    err = fail(data, P.INVALID_JSON)
    assert "not valid JSON" in err.message
    assert err.reply_to is None and err.session_id is None


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_constants_are_rejected(constant):
    for data in (constant, f"[{constant}]",
                 f'{{"type": "query.create", "session_id": "s", "question": "q", "temperature": {constant}}}',
                 f'{{"type": "session.get", "session_id": "s", "event_id": "e", "x": {constant}}}'):
        err = fail(data, P.INVALID_JSON)
        assert constant.lstrip("-") in err.message
        assert err.reply_to is None and err.session_id is None


@pytest.mark.parametrize("opener", ["[", '{"a":'])
def test_deeply_nested_json_is_invalid_json(opener):
    data = opener * 200_000
    with pytest.raises(RecursionError):  # the precondition: the stdlib parser recurses out
        json.loads(data)
    err = fail(data, P.INVALID_JSON)
    assert "recursion" in err.message


# ---- invalid_utf8 -------------------------------------------------------------------------------


@pytest.mark.parametrize("data,offset", [
    (b'{"type": "\xff"}', 10),
    (b"\x80", 0),
    (b'{"type":"session.get","session_id":"\xc3"}', 36),  # truncated 2-byte sequence
    (b'{"text": "\xed\xa0\x80"}', 10),  # encoded surrogate
    (b'{"text": "\xc0\xaf"}', 10),  # overlong
])
def test_invalid_utf8_names_the_byte_offset(data, offset):
    with pytest.raises(UnicodeDecodeError) as info:
        data.decode("utf-8")
    assert info.value.start == offset
    for variant in (data, bytearray(data), memoryview(data)):
        err = fail(variant, P.INVALID_UTF8)
        assert err.message == f"text frame is not valid UTF-8 at byte {offset}"
        assert err.reply_to is None and err.session_id is None


def test_invalid_utf8_helper_without_decode_error():
    err = ServerProtocol.invalid_utf8()
    assert (err.code, err.message, err.recoverable) == (P.INVALID_UTF8, "text frame is not valid UTF-8", True)
    err = ServerProtocol.invalid_utf8(ValueError("boom"))
    assert err.message == "text frame is not valid UTF-8"
    exc = UnicodeDecodeError("utf-8", b"ab\xff", 2, 3, "invalid start byte")
    assert ServerProtocol().invalid_utf8(exc).message == "text frame is not valid UTF-8 at byte 2"


# ---- not_an_object ------------------------------------------------------------------------------


@pytest.mark.parametrize("data,name", [
    ("[]", "list"), ('[{"type": "session.get"}]', "list"), ('"session.get"', "str"), ("1", "int"),
    ("1.5", "float"), ("1e999", "float"), ("true", "bool"), ("null", "NoneType"),
])
def test_not_an_object(data, name):
    err = fail(data, P.NOT_AN_OBJECT)
    assert err.message == f"message must be a JSON object, got {name}"
    assert err.reply_to is None and err.session_id is None


# ---- unknown_type / missing type ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["session.nope", "", "SESSION.GET", "session.get ", 5, 1.5, True, False,
                                  ["session.get"], {"session.get": 1}, "x" * 500])
def test_unknown_type(kind):
    err = fail({"type": kind, "session_id": "s", "event_id": "e"}, P.UNKNOWN_TYPE, param="type")
    assert (err.reply_to, err.session_id) == ("e", "s")
    assert "unknown message type" in err.message
    for known in SCHEMAS:
        assert known in err.message
    if kind == "x" * 500:  # the bad value is quoted, but shortened
        assert "type '" + "x" * 56 + "...;" in err.message and "x" * 57 not in err.message


@pytest.mark.parametrize("msg", [{}, {"session_id": "s"}, {"type": None, "session_id": "s", "event_id": "e"}])
def test_missing_type(msg):
    err = fail(msg, P.MISSING_FIELD, param="type")
    assert err.message == "message has no 'type'"
    assert err.reply_to == msg.get("event_id")
    assert err.session_id == msg.get("session_id")


# ---- missing_field ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind,name", [(k, n) for k, n in ALL_FIELDS if SCHEMAS[k][n].required])
@pytest.mark.parametrize("how", ["absent", "null"])
def test_missing_required_field(kind, name, how):
    msg = full(kind)
    if how == "absent":
        del msg[name]
    else:
        msg[name] = None
    err = fail(msg, P.MISSING_FIELD, param=name)
    assert err.message == f"{kind} needs '{name}'"
    assert err.reply_to == "e-1"
    assert err.session_id == (None if name == "session_id" else "s-1")


def test_missing_fields_reported_in_schema_order():
    err = fail({"type": "query.create"}, P.MISSING_FIELD, param="session_id")
    assert err.session_id is None
    fail({"type": "query.create", "session_id": "s"}, P.MISSING_FIELD, param="question")
    fail({"type": "query.cancel", "session_id": "s"}, P.MISSING_FIELD, param="query_id")


# ---- unknown_field ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(SCHEMAS))
def test_unknown_field(kind):
    msg = full(kind)
    msg["bogus"] = 1
    err = fail(msg, P.UNKNOWN_FIELD, param="bogus")
    assert err.message == f"{kind} has no field 'bogus'"
    assert (err.reply_to, err.session_id) == ("e-1", "s-1")


def test_unknown_field_from_another_schema_and_null_value():
    fail({"type": "session.get", "session_id": "s", "text": "hi"}, P.UNKNOWN_FIELD, param="text")
    fail({"type": "session.get", "session_id": "s", "question": None}, P.UNKNOWN_FIELD, param="question")
    fail({"type": "session.get", "session_id": "s", "ts": 1}, P.UNKNOWN_FIELD, param="ts")


def test_unknown_fields_first_in_sorted_order_is_named_and_checked_before_missing():
    err = fail({"type": "query.cancel", "zz": 1, "aa": 2, "mm": 3}, P.UNKNOWN_FIELD, param="aa")
    assert err.session_id is None and err.reply_to is None


def test_type_and_event_id_are_not_unknown_fields():
    assert parse({"type": "session.get", "session_id": "s", "event_id": "e"}).fields == {}


# ---- invalid_field, per field kind -------------------------------------------------------------

BAD_BY_KIND = {
    "str": [1, 0, 1.5, True, False, [], ["a"], {}, {"a": "b"}],
    "id": ["", "x" * 65, "a\nb", "a\tb", "\x00", "\x7f", "\u2028", "a\u200bb", "\ud800", 5, 0, 1.5, True, [],
           ["a"], {}],
    "int": [True, False, 1.5, 2.0, "1", [], [1], {}, 1e999, -1e999],
    "float": [True, False, "0.5", [], [0.5], {}, 1e999, -1e999],
    "bool": [0, 1, "true", "false", [], {}, 0.0],
    "strlist": ["stop", [""], ["a", ""], [1], [None], [["a"]], [{}], ["a"] * 9, {}, {"a": "b"}, 1, True],
    "flashlist": ["q", 1, True, {}, {"question": "q"}, [1], ["q"], [None], [[]]],
    "object": ["dual", 1, True, [], [{"mode": "dual"}]],
    "anyobject": ["x", 1, True, [], [{}]],
    "numlist": ["x", 1, [True], ["1"], [None], [1e999], [0.0] * 65, {}],
}


def bad_cases():
    for kind, name in ALL_FIELDS:
        spec = SCHEMAS[kind][name]
        for value in BAD_BY_KIND[spec.kind]:
            yield pytest.param(kind, name, value, id=f"{kind}-{name}-{value!r}"[:80])


@pytest.mark.parametrize("kind,name,value", list(bad_cases()))
def test_invalid_field_by_kind(kind, name, value):
    msg = full(kind)
    msg[name] = value
    err = fail(msg, P.INVALID_FIELD, param=name)
    assert err.message.startswith((f"{kind}: '{name}' must be ", f"{kind}: '{name}["))
    assert err.reply_to == "e-1"
    if name == "session_id":
        assert err.session_id is None  # a malformed session_id is never echoed back
    else:
        assert err.session_id == "s-1"


def range_cases():
    for kind, name in ALL_FIELDS:
        spec = SCHEMAS[kind][name]
        if spec.kind not in ("int", "float"):
            continue
        step = 1 if spec.kind == "int" else 0.001
        if spec.lo is not None:
            yield pytest.param(kind, name, spec.lo, True, id=f"{name}-lo")
            yield pytest.param(kind, name, spec.lo - step, False, id=f"{name}-below-lo")
        if spec.hi is not None:
            yield pytest.param(kind, name, spec.hi, True, id=f"{name}-hi")
            yield pytest.param(kind, name, spec.hi + step, False, id=f"{name}-above-hi")
        else:
            yield pytest.param(kind, name, 10**30 if spec.kind == "int" else 1e300, True, id=f"{name}-huge")


@pytest.mark.parametrize("kind,name,value,ok", list(range_cases()))
def test_numeric_range_bounds(kind, name, value, ok):
    spec = SCHEMAS[kind][name]
    msg = full(kind)
    msg[name] = value
    if ok:
        got = parse(msg)[name]
        assert got == value
        assert type(got) is (int if spec.kind == "int" else float)
    else:
        err = fail(msg, P.INVALID_FIELD, param=name)
        hi = spec.hi if spec.hi is not None else "inf"
        assert f"must be in [{spec.lo}, {hi}]" in err.message


def test_int_bounds_exact():
    base = full("query.create")
    assert parse({**base, "seed": 2**63 - 1})["seed"] == 2**63 - 1
    fail({**base, "seed": 2**63}, P.INVALID_FIELD, param="seed")
    fail({**base, "seed": -1}, P.INVALID_FIELD, param="seed")
    assert parse({**base, "top_k": 0})["top_k"] == 0
    fail({**base, "top_k": -1}, P.INVALID_FIELD, param="top_k")
    fail({**base, "max_tokens": 0}, P.INVALID_FIELD, param="max_tokens")
    err = fail({**base, "max_tokens": -5}, P.INVALID_FIELD, param="max_tokens")
    assert "must be in [1, inf], got -5" in err.message
    revise = full("input.text.revise")
    fail({**revise, "from_seq": 0}, P.INVALID_FIELD, param="from_seq")
    assert parse({**revise, "from_seq": 10**40})["from_seq"] == 10**40


def test_int_rejects_bool_and_float():
    base = full("query.create")
    err = fail({**base, "max_tokens": True}, P.INVALID_FIELD, param="max_tokens")
    assert err.message == "query.create: 'max_tokens' must be an integer, got True"
    fail({**base, "max_tokens": 5.0}, P.INVALID_FIELD, param="max_tokens")
    fail('{"type":"query.create","session_id":"s","question":"q","max_tokens":5.0}', P.INVALID_FIELD,
         param="max_tokens")
    fail('{"type":"query.create","session_id":"s","question":"q","max_tokens":5e0}', P.INVALID_FIELD,
         param="max_tokens")


def test_float_accepts_int_and_converts():
    base = full("query.create")
    cmd = parse({**base, "temperature": 1, "top_p": 0})
    assert cmd["temperature"] == 1.0 and type(cmd["temperature"]) is float
    assert cmd["top_p"] == 0.0 and type(cmd["top_p"]) is float
    cmd = parse('{"type":"query.create","session_id":"s","question":"q","temperature":10,"top_p":1}')
    assert (cmd["temperature"], cmd["top_p"]) == (10.0, 1.0)
    assert type(cmd["temperature"]) is float and type(cmd["top_p"]) is float
    assert parse({**base, "temperature": -0.0})["temperature"] == 0.0


def test_float_rejects_bool_string_and_non_finite():
    base = full("query.create")
    err = fail({**base, "temperature": True}, P.INVALID_FIELD, param="temperature")
    assert err.message == "query.create: 'temperature' must be a finite number, got True"
    fail({**base, "top_p": False}, P.INVALID_FIELD, param="top_p")
    fail({**base, "top_p": "0.5"}, P.INVALID_FIELD, param="top_p")
    # JSON overflow to infinity: not a constant, so it parses, then is rejected as a field
    err = fail('{"type":"query.create","session_id":"s","question":"q","temperature":1e999}', P.INVALID_FIELD,
               param="temperature")
    assert "got inf" in err.message
    fail('{"type":"query.create","session_id":"s","question":"q","top_p":-1e999}', P.INVALID_FIELD, param="top_p")
    fail({**base, "temperature": 10.000001}, P.INVALID_FIELD, param="temperature")
    fail({**base, "temperature": -0.000001}, P.INVALID_FIELD, param="temperature")
    fail({**base, "top_p": 1.0000001}, P.INVALID_FIELD, param="top_p")


def test_float_nan_is_rejected_by_the_field_check():
    # JSON cannot carry NaN (the constant is refused as invalid_json), so drive the field check directly.
    proto = ServerProtocol()
    spec = SCHEMAS["query.create"]["temperature"]
    for value in (math.nan, -math.nan, math.inf, -math.inf):
        with pytest.raises(ProtocolError) as info:
            proto._check("query.create", "temperature", spec, value)
        assert info.value.code == P.INVALID_FIELD and info.value.param == "temperature"
        assert "must be a finite number" in info.value.message
    assert proto._check("query.create", "temperature", spec, 3) == 3.0


def test_str_field_without_limit_is_only_type_checked():
    proto = ServerProtocol(ProtocolLimits(max_text_chars=1))
    spec = P._Field("str")
    assert proto._check("k", "n", spec, "long enough") == "long enough"
    with pytest.raises(ProtocolError) as info:
        proto._check("k", "n", spec, 1)
    assert info.value.code == P.INVALID_FIELD


def test_bool_field():
    base = full("query.create")
    assert parse({**base, "stream": True})["stream"] is True
    assert parse({**base, "stream": False})["stream"] is False
    err = fail({**base, "stream": 1}, P.INVALID_FIELD, param="stream")
    assert err.message == "query.create: 'stream' must be true or false, got 1"
    fail({**base, "stream": "true"}, P.INVALID_FIELD, param="stream")


def test_strlist_field():
    base = full("query.create")
    assert parse({**base, "stop": []})["stop"] == []
    assert parse({**base, "stop": ["a"] * 8})["stop"] == ["a"] * 8
    assert parse({**base, "stop": [" ", "\n", "ü"]})["stop"] == [" ", "\n", "ü"]
    err = fail({**base, "stop": ["a"] * 9}, P.INVALID_FIELD, param="stop")
    assert "a list of at most 8 non-empty strings" in err.message
    fail({**base, "stop": ["a", ""]}, P.INVALID_FIELD, param="stop")
    fail({**base, "stop": "a"}, P.INVALID_FIELD, param="stop")
    fail({**base, "stop": ["a", 1]}, P.INVALID_FIELD, param="stop")


def test_over_takes_sent_or_read_only():
    base = full("query.create")
    assert parse({**base, "over": "sent"})["over"] == "sent"
    assert parse({**base, "over": "read"})["over"] == "read"
    assert "over" not in parse({k: v for k, v in base.items() if k != "over"}).fields  # the server's default: sent
    for value in ("later", "", "Read", "read ", "sent,read"):
        err = fail({**base, "over": value}, P.INVALID_FIELD, param="over")
        assert err.message == f"query.create: 'over' must be one of 'sent', 'read', got {value!r}"
        assert err.recoverable and err.reply_to == "e-1" and err.session_id == "s-1"
    err = fail({**base, "over": 1}, P.INVALID_FIELD, param="over")
    assert err.message == "query.create: 'over' must be a string, got 1"


def test_str_field_type():
    err = fail({"type": "input.text.append", "session_id": "s", "text": 5}, P.INVALID_FIELD, param="text")
    assert err.message == "input.text.append: 'text' must be a string, got 5"
    assert parse({"type": "input.text.append", "session_id": "s", "text": ""})["text"] == ""


@pytest.mark.parametrize("kind,name", [(k, n) for k, n in ALL_FIELDS if SCHEMAS[k][n].kind == "id"])
def test_id_fields(kind, name):
    proto = ServerProtocol(ProtocolLimits(max_id_chars=8))
    msg = full(kind)
    for value in ("a", "12345678", "a b", "ü-✓", "x.y:z/1"):
        msg[name] = value
        cmd = parse(msg, proto)
        assert (cmd.session_id if name == "session_id" else cmd[name]) == value
    for value in ("123456789", "", "a\nb", "\x1b[0m", 7):
        msg[name] = value
        err = fail(msg, P.INVALID_FIELD, proto, param=name)
        assert "must be a string of 1-8 printable characters" in err.message


def test_invalid_value_is_quoted_and_shortened_in_message():
    err = fail({"type": "input.text.append", "session_id": "s", "text": ["y" * 500]}, P.INVALID_FIELD,
               param="text")
    assert err.message.endswith("got ['" + "y" * 55 + "...")


# ---- bad event_id -------------------------------------------------------------------------------


@pytest.mark.parametrize("event_id", ["", "x" * 65, "a\nb", "\x00", "\ud800", 5, 0, 1.5, True, False, [], ["e"],
                                      {}, {"a": 1}])
def test_bad_event_id_is_rejected(event_id):
    msg = full("session.get", event_id=None)
    msg["event_id"] = event_id
    err = fail(msg, P.INVALID_FIELD, param="event_id")
    assert err.message == "event_id must be a string of 1-64 printable characters"
    assert err.reply_to is None


def test_bad_event_id_is_checked_before_everything_else():
    fail({"event_id": 5}, P.INVALID_FIELD, param="event_id")
    fail({"type": "nope", "event_id": ""}, P.INVALID_FIELD, param="event_id")
    fail({"type": "session.get", "event_id": [], "bogus": 1}, P.INVALID_FIELD, param="event_id")


def test_event_id_limits():
    proto = ServerProtocol(ProtocolLimits(max_id_chars=4))
    assert parse({"type": "session.create", "event_id": "abcd"}, proto).event_id == "abcd"
    assert parse({"type": "session.create", "event_id": "é ✓"}, proto).event_id == "é ✓"
    err = fail({"type": "session.create", "event_id": "abcde"}, P.INVALID_FIELD, proto, param="event_id")
    assert err.message == "event_id must be a string of 1-4 printable characters"


def test_bad_event_id_error_still_carries_session_id():
    err = fail({"type": "session.get", "session_id": "s-1", "event_id": 5}, P.INVALID_FIELD, param="event_id")
    assert err.session_id == "s-1"


# ---- reply_to / session_id on errors --------------------------------------------------------------


def test_errors_carry_reply_to_and_session_id():
    err = fail({"type": "query.create", "session_id": "s-9", "event_id": "e-9", "question": 1},
               P.INVALID_FIELD, param="question")
    assert (err.reply_to, err.session_id) == ("e-9", "s-9")
    err = fail({"type": "query.create", "session_id": "s-9", "question": 1}, P.INVALID_FIELD, param="question")
    assert (err.reply_to, err.session_id) == (None, "s-9")
    err = fail({"type": "query.create", "session_id": "s-9", "event_id": None, "question": 1},
               P.INVALID_FIELD, param="question")
    assert (err.reply_to, err.session_id) == (None, "s-9")


@pytest.mark.parametrize("sid", [5, 1.5, True, ["s"], {"s": 1}, None])
def test_non_string_session_id_is_not_echoed(sid):
    err = fail({"type": "session.get", "session_id": sid, "event_id": "e"},
               P.MISSING_FIELD if sid is None else P.INVALID_FIELD, param="session_id")
    assert err.session_id is None and err.reply_to == "e"
    err = fail({"type": "nope", "session_id": sid, "event_id": "e"}, P.UNKNOWN_TYPE, param="type")
    assert err.session_id is None


def test_malformed_session_id_is_not_echoed():
    err = fail({"type": "session.get", "session_id": "", "event_id": "e"}, P.INVALID_FIELD, param="session_id")
    assert (err.session_id, err.reply_to) == (None, "e")


def test_session_id_echoed_on_errors_for_types_without_session():
    err = fail({"type": "session.create", "session_id": "s", "event_id": "e", "system_prompt": 3},
               P.INVALID_FIELD, param="system_prompt")
    assert (err.session_id, err.reply_to) == ("s", "e")


# ---- message_too_large --------------------------------------------------------------------------


def test_frame_limit_is_in_bytes_and_inclusive():
    msg = json.dumps({"type": "input.text.append", "session_id": "s", "text": "abc"})
    n = len(msg.encode())
    assert parse(msg, ServerProtocol(ProtocolLimits(max_message_bytes=n))).type == "input.text.append"
    assert parse(msg.encode(), ServerProtocol(ProtocolLimits(max_message_bytes=n))).type == "input.text.append"
    for data in (msg, msg.encode(), bytearray(msg.encode())):
        err = fail(data, P.MESSAGE_TOO_LARGE, ServerProtocol(ProtocolLimits(max_message_bytes=n - 1)))
        assert err.message == f"message of {n} bytes exceeds the limit of {n - 1} bytes"
        assert (err.reply_to, err.session_id) == (None, None)


def test_frame_limit_counts_utf8_bytes_of_str_input():
    msg = json.dumps({"type": "input.text.append", "session_id": "s", "text": "é" * 10}, ensure_ascii=False)
    chars, nbytes = len(msg), len(msg.encode())
    assert nbytes == chars + 10
    err = fail(msg, P.MESSAGE_TOO_LARGE, ServerProtocol(ProtocolLimits(max_message_bytes=chars)))
    assert f"message of {nbytes} bytes" in err.message
    assert parse(msg, ServerProtocol(ProtocolLimits(max_message_bytes=nbytes)))["text"] == "é" * 10


def test_frame_limit_is_checked_before_decoding_and_parsing():
    proto = ServerProtocol(ProtocolLimits(max_message_bytes=4))
    fail(b"\xff\xff\xff\xff\xff", P.MESSAGE_TOO_LARGE, proto)
    fail("[[[[[", P.MESSAGE_TOO_LARGE, proto)
    fail("12345", P.MESSAGE_TOO_LARGE, proto)
    fail("[" * 5, P.MESSAGE_TOO_LARGE, proto)


def test_default_frame_limit():
    big = "x" * ((1 << 20) + 1)
    err = fail(big, P.MESSAGE_TOO_LARGE)
    assert err.message == f"message of {(1 << 20) + 1} bytes exceeds the limit of {1 << 20} bytes"
    fail(big[:-1], P.INVALID_JSON)


@pytest.mark.parametrize("kind,name,limit", [
    ("input.text.append", "text", "max_text_chars"),
    ("input.text.revise", "text", "max_text_chars"),
    ("query.create", "question", "max_question_chars"),
    ("session.create", "system_prompt", "max_system_prompt_chars"),
    ("action.rule", "pattern", "max_pattern_chars"),
])
def test_per_field_character_limits(kind, name, limit):
    assert SCHEMAS[kind][name].limit == limit
    proto = ServerProtocol(ProtocolLimits(**{limit: 5}))
    msg = full(kind)
    msg[name] = "ééééé"  # 5 characters, 10 bytes: the limit counts characters
    assert parse(msg, proto)[name] == "ééééé"
    msg[name] = "abcdef"
    err = fail(msg, P.LIMIT_CODES[limit], proto, param=name)
    assert err.message == f"'{name}' has 6 characters; the limit is 5"
    assert (err.reply_to, err.session_id) == ("e-1", "s-1")


def test_flash_list_limit_has_its_own_code():
    proto = ServerProtocol(ProtocolLimits(max_flash_at_create=2))
    assert len(parse({"type": "session.create", "flash": [{"question": "q"}] * 2}, proto)["flash"]) == 2
    err = fail({"type": "session.create", "flash": [{"question": "q"}] * 3}, P.FLASH_LIMIT, proto, param="flash")
    assert "3 flash questions; the limit is 2" in err.message


def test_per_field_default_limits():
    proto = ServerProtocol()
    base = {"type": "query.create", "session_id": "s"}
    assert len(parse({**base, "question": "q" * 8192}, proto)["question"]) == 8192
    fail({**base, "question": "q" * 8193}, P.QUESTION_TOO_LONG, proto, param="question")
    base = {"type": "input.text.append", "session_id": "s"}
    assert len(parse({**base, "text": "t" * 256 * 1024}, proto)["text"]) == 256 * 1024
    fail({**base, "text": "t" * (256 * 1024 + 1)}, P.TEXT_TOO_LONG, proto, param="text")
    fail({"type": "session.create", "system_prompt": "p" * (16 * 1024 + 1)}, P.SYSTEM_PROMPT_TOO_LONG, proto,
         param="system_prompt")


# ---- binary media frames ------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"", b"abc", json.dumps(full("session.get")).encode(), bytes(range(256))])
def test_binary_frames_are_refused_without_media(data):
    proto = ServerProtocol()
    with pytest.raises(ProtocolError) as info:
        proto.refuse_binary(data)
    err = info.value
    assert err.code == P.UNEXPECTED_BINARY and err.recoverable is True
    assert f"binary frame of {len(data)} bytes not expected" in err.message
    assert (err.reply_to, err.session_id, err.param) == (None, None, None)


MEDIA = {"session_id": "s-1", "kind": "audio", "format": "pcm_s16le", "seq": 3, "ts": 12.5, "sample_rate": 48000,
         "channels": 2, "end": False, "live": True}


def test_media_frame_roundtrip():
    cmd = ServerProtocol().receive_binary(P.media_frame(MEDIA, b"\x01\x02\x03"))
    assert cmd.type == "media" and cmd.session_id == "s-1" and cmd.event_id is None
    assert cmd.fields == {**{k: v for k, v in MEDIA.items() if k != "session_id"}, "payload": b"\x01\x02\x03"}
    for kind, formats in P.MEDIA_FORMATS.items():
        for fmt in formats:
            head = {"session_id": "s", "kind": kind, "format": fmt, "seq": 0, "ts": 0}
            if fmt == "pcm_s16le":
                head.update(sample_rate=16000, channels=1)
            assert ServerProtocol().receive_binary(P.media_frame(head, b"x"))["format"] == fmt
    end = ServerProtocol().receive_binary(P.media_frame({**MEDIA, "end": True}, b""))
    assert end["end"] is True and end["payload"] == b""


@pytest.mark.parametrize("data, code, needle", [
    (b"", P.MEDIA_HEADER_INVALID, "no header length"),
    (b"\x00\x00\x00", P.MEDIA_HEADER_INVALID, "no header length"),
    (b"\x00\x00\x00\x00abc", P.MEDIA_HEADER_INVALID, "header length 0"),
    (b"\x00\x00\x00\x09{}", P.MEDIA_HEADER_INVALID, "header length 9"),
    (b"\x00\x01\x00\x00" + b" " * 70000, P.MEDIA_HEADER_INVALID, "header length 65536"),
    (b"\x00\x00\x00\x02\xff\xfe", P.MEDIA_HEADER_INVALID, "not UTF-8 JSON"),
    (b"\x00\x00\x00\x03NaN", P.MEDIA_HEADER_INVALID, "not UTF-8 JSON"),
    (b"\x00\x00\x00\x02[]", P.MEDIA_HEADER_INVALID, "JSON object"),
    (P.media_frame({**MEDIA, "seq": None}, b"x"), P.MEDIA_HEADER_INVALID, "needs 'seq'"),
    (P.media_frame({**MEDIA, "seq": -1}, b"x"), P.MEDIA_HEADER_INVALID, "'seq'"),
    (P.media_frame({**MEDIA, "ts": "now"}, b"x"), P.MEDIA_HEADER_INVALID, "'ts'"),
    (P.media_frame({**MEDIA, "colour": 1}, b"x"), P.MEDIA_HEADER_INVALID, "colour"),
    (P.media_frame({**MEDIA, "sample_rate": None}, b"x"), P.MEDIA_HEADER_INVALID, "sample_rate"),
    (P.media_frame({**MEDIA, "channels": 9}, b"x"), P.MEDIA_HEADER_INVALID, "channels"),
    (P.media_frame({**MEDIA, "kind": "smell"}, b"x"), P.UNSUPPORTED_MEDIA, "smell"),
    (P.media_frame({**MEDIA, "format": "flac"}, b"x"), P.UNSUPPORTED_MEDIA, "flac"),
    (P.media_frame({**MEDIA, "kind": "video"}, b"x"), P.UNSUPPORTED_MEDIA, "pcm_s16le"),
    (P.media_frame(MEDIA, b""), P.MEDIA_HEADER_INVALID, "empty payload"),
    (P.media_frame(MEDIA, b"x" * 1025), P.MEDIA_TOO_LARGE, "1025 bytes"),
])
def test_bad_media_frames(data, code, needle):
    proto = ServerProtocol(ProtocolLimits(max_media_bytes=1024))
    with pytest.raises(ProtocolError) as info:
        proto.receive_binary(data)
    err = info.value
    assert err.code == code and err.recoverable is True and needle in err.message, err.message
    assert err.session_id in (None, "s-1")


# ---- outbound -----------------------------------------------------------------------------------


def test_event_shape_and_increasing_ids():
    proto = ServerProtocol()
    before = time.time()
    outs = [proto.event("session.created", session_id="s", n=i) for i in range(3)]
    after = time.time()
    bodies = [json.loads(o) for o in outs]
    assert [b["event_id"] for b in bodies] == ["evt_1", "evt_2", "evt_3"]
    for i, b in enumerate(bodies):
        assert list(b)[:3] == ["type", "event_id", "ts"]
        assert b["type"] == "session.created" and b["session_id"] == "s" and b["n"] == i
        assert type(b["ts"]) is float and before <= b["ts"] <= after
    assert json.loads(ServerProtocol().event("x"))["event_id"] == "evt_1"  # per connection


def test_event_compact_drops_none_and_keeps_unicode():
    proto = ServerProtocol()
    out = proto.event("answer.delta", text="héllo 日本 🙂", gone=None, zero=0, empty="", false=False,
                      nested={"a": None, "b": [1, "ü"]})
    body = json.loads(out)
    assert "gone" not in body
    assert body["zero"] == 0 and body["empty"] == "" and body["false"] is False
    assert body["nested"] == {"a": None, "b": [1, "ü"]}  # only top-level None is dropped
    assert "héllo 日本 🙂" in out and "\\u" not in out
    assert ", " not in out and '": ' not in out
    assert out == out.strip() and "\n" not in out
    assert set(body) == {"type", "event_id", "ts", "text", "zero", "empty", "false", "nested"}


def test_error_shape():
    proto = ServerProtocol()
    body = json.loads(proto.error("session_not_found", "no such session", reply_to="e-1", session_id="s-1",
                                  param="session_id"))
    assert body["type"] == "error" and body["event_id"] == "evt_1" and type(body["ts"]) is float
    assert body["error"] == {"code": "session_not_found", "message": "no such session", "recoverable": True,
                             "param": "session_id"}
    assert (body["reply_to"], body["session_id"]) == ("e-1", "s-1")
    assert set(body) == {"type", "event_id", "ts", "error", "reply_to", "session_id"}

    body = json.loads(proto.error("internal_error", "boom", recoverable=False))
    assert body["event_id"] == "evt_2"
    assert body["error"] == {"code": "internal_error", "message": "boom", "recoverable": False}
    assert set(body) == {"type", "event_id", "ts", "error"}
    body = json.loads(proto.error("x", "y", param=""))
    assert "param" not in body["error"]


def test_protocol_error_roundtrip():
    proto = ServerProtocol()
    with pytest.raises(ProtocolError) as info:
        proto.receive_text(json.dumps({"type": "query.create", "session_id": "s-1", "event_id": "e-1",
                                       "question": "q", "top_k": -1}))
    body = json.loads(proto.protocol_error(info.value))
    assert body["type"] == "error" and body["event_id"] == "evt_1"
    assert body["error"]["code"] == P.INVALID_FIELD and body["error"]["param"] == "top_k"
    assert body["error"]["recoverable"] is True and "top_k" in body["error"]["message"]
    assert (body["reply_to"], body["session_id"]) == ("e-1", "s-1")

    with pytest.raises(ProtocolError) as info:
        proto.receive_text("nope")
    body = json.loads(proto.protocol_error(info.value))
    assert body["event_id"] == "evt_2"
    assert set(body) == {"type", "event_id", "ts", "error"}
    assert set(body["error"]) == {"code", "message", "recoverable"}
    assert body["error"]["code"] == P.INVALID_JSON

    body = json.loads(proto.protocol_error(ServerProtocol.invalid_utf8()))
    assert body["error"] == {"code": P.INVALID_UTF8, "message": "text frame is not valid UTF-8",
                             "recoverable": True}


def test_inbound_parsing_does_not_consume_event_ids():
    proto = ServerProtocol()
    parse(full("session.get"), proto)
    with pytest.raises(ProtocolError):
        proto.receive_text("[]")
    assert json.loads(proto.event("x"))["event_id"] == "evt_1"


# ---- fixed bugs (regressions) ---------------------------------------------------------------------


def test_huge_integer_in_float_field_is_invalid_field():
    data = '{"type":"query.create","session_id":"s","question":"q","temperature":1' + "0" * 400 + "}"
    fail(data, P.INVALID_FIELD, param="temperature")


def test_str_input_with_lone_surrogate_raises_protocol_error():
    with pytest.raises(ProtocolError) as info:
        ServerProtocol().receive_text('{"type":"session.get","session_id":"\ud800"}')
    assert info.value.code in CODES


def test_error_event_for_surrogate_session_id_is_utf8_encodable():
    proto = ServerProtocol()
    with pytest.raises(ProtocolError) as info:
        proto.receive_text(b'{"type":"session.get","session_id":"\\ud800"}')
    assert info.value.code == P.INVALID_FIELD
    proto.protocol_error(info.value).encode("utf-8")


# ---- randomized robustness ----------------------------------------------------------------------

_FIELD_NAMES = sorted({n for s in SCHEMAS.values() for n in s} | {"type", "event_id", "bogus", ""})
_INTERESTING = [b'"', b"{", b"}", b"[", b"]", b",", b":", b"\\", b"\\u", b"\\ud800", b"null", b"true", b"-",
                b"1e999", b"NaN", b"Infinity", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b" ", b"\xe2\x9c\x93"]


def _rand_str(rng: random.Random) -> str:
    pool = "ab z09._-\n\t\x00\x1f\x7f\u2028é✓🙂\"\\/"  # lone surrogates have their own tests above
    n = rng.choice([0, 1, 2, 5, 20, 70])
    return "".join(rng.choice(pool) for _ in range(n))


def _rand_value(rng: random.Random, depth: int = 0):
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:  # huge ints have their own regression test above
        return rng.choice([0, 1, -1, 2**63 - 1, 2**63, -2**63, 10**300, rng.randrange(-10**6, 10**6)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 0.5, 1.0, 10.0, 10.5, -1e-9, 1e308, rng.uniform(-20, 20)])
    if pick == 4:
        return rng.choice(sorted(SCHEMAS)) if rng.random() < 0.3 else _rand_str(rng)
    if pick == 5:
        return _rand_str(rng) * rng.choice([1, 1000])
    if pick == 6:
        return [_rand_value(rng, depth + 1) for _ in range(rng.randrange(10))]
    if pick == 7:
        return [_rand_str(rng) for _ in range(rng.randrange(11))]
    return {rng.choice(_FIELD_NAMES): _rand_value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _rand_input(rng: random.Random) -> bytes:
    kind = rng.choice(sorted(SCHEMAS))
    msg = full(kind) if rng.random() < 0.5 else minimal(kind)
    style = rng.randrange(5)
    if style == 0:  # random value of a random type in random fields
        for _ in range(rng.randint(1, 3)):
            msg[rng.choice(_FIELD_NAMES)] = _rand_value(rng)
        return json.dumps(msg, ensure_ascii=rng.random() < 0.5).encode()
    if style == 1:  # delete a field
        if msg:
            del msg[rng.choice(sorted(msg))]
        return json.dumps(msg).encode()
    if style == 2:  # not an object at all / raw junk
        if rng.random() < 0.5:
            return json.dumps(_rand_value(rng)).encode()
        return bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
    data = bytearray(json.dumps(msg, ensure_ascii=rng.random() < 0.5).encode())
    for _ in range(rng.randint(1, 4)):  # byte mutations
        op = rng.randrange(3)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:
            del data[pos:pos + rng.randint(1, 8)]
        elif op == 1 and data:
            pos = min(pos, len(data) - 1)
            data[pos] = rng.randrange(256)
        else:
            ins = rng.choice(_INTERESTING) if rng.random() < 0.6 else bytes([rng.randrange(256)])
            data[pos:pos] = ins
    return bytes(data)


def _check_outcome(proto: ServerProtocol, call, data) -> str:
    try:
        cmd = call(data)
    except ProtocolError as err:
        assert err.code in CODES, err.code
        assert err.recoverable is True
        assert isinstance(err.message, str) and err.message
        assert err.param is None or isinstance(err.param, str)
        assert err.reply_to is None or isinstance(err.reply_to, str)
        assert err.session_id is None or isinstance(err.session_id, str)
        body = json.loads(proto.protocol_error(err))
        assert body["type"] == "error" and body["error"]["code"] == err.code
        return err.code
    assert isinstance(cmd, Command) and cmd.type in SCHEMAS
    assert set(cmd.fields) <= set(SCHEMAS[cmd.type]) - {"session_id"}
    assert cmd.session_id is None or isinstance(cmd.session_id, str)
    for name, spec in SCHEMAS[cmd.type].items():
        if spec.required and name != "session_id":
            assert cmd.fields.get(name) is not None
    return "ok"


def test_randomized_inputs_only_raise_protocol_error():
    rng = random.Random(20240601)
    proto = ServerProtocol(ProtocolLimits(max_message_bytes=64 * 1024, max_text_chars=4096,
                                          max_question_chars=512, max_system_prompt_chars=1024))
    seen: dict[str, int] = {}
    for _ in range(2000):
        data = _rand_input(rng)
        outcomes = [_check_outcome(proto, proto.receive_text, data),
                    _check_outcome(proto, proto.receive_binary, data)]
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            assert outcomes[0] in (P.INVALID_UTF8, P.MESSAGE_TOO_LARGE)
        else:
            assert _check_outcome(proto, proto.receive_text, text) == outcomes[0]
        assert outcomes[1] in (P.MEDIA_HEADER_INVALID, P.UNSUPPORTED_MEDIA, P.MEDIA_TOO_LARGE)
        seen[outcomes[0]] = seen.get(outcomes[0], 0) + 1
    # the generator reaches the success path and most error codes
    assert seen.get("ok", 0) > 50
    assert {P.INVALID_JSON, P.INVALID_UTF8, P.NOT_AN_OBJECT, P.UNKNOWN_TYPE, P.MISSING_FIELD, P.INVALID_FIELD,
            P.UNKNOWN_FIELD, P.MESSAGE_TOO_LARGE} <= set(seen), seen
