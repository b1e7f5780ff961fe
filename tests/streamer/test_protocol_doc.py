"""docs/protocol.md against the server: the document's tables, read by a machine
(tests/streamer/protodoc.py), against the events recorded over real websockets on a scripted
tour of the protocol (tests/streamer/protocol_tour.py).

- every client message and field the document lists is the protocol's schema, and back;
- every event the server sent matches one documented row: its required fields present, no
  field the row does not list (nested objects too, where the document lists their fields);
- every row, every optional field and every documented object field was seen at least once;
- every reply carries `reply_to`, naming a message of a type the row says it answers;
- every error code in the table was provoked, and every code the server sent (or has in its
  source) is in the table.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import protodoc
import pytest
from protocol_tour import kv_budget, tour

from streamer.protocol import MEDIA_FIELDS, SCHEMAS

ENVELOPE = {"type", "event_id", "ts", "session_id", "reply_to"}
ROOT = Path(__file__).resolve().parents[2]
# Codes that appear in the source but never on the wire, and why.
# Codes of HTTP refusals at the handshake (a JSON body with Retry-After, not an `error` event):
# docs/protocol.md names them where it describes the connection caps and the handshake rate.
HANDSHAKE_CODES = {"too_many_connections_address", "too_many_connections_key", "server_full", "server_busy"}

NOT_ON_THE_WIRE = {
    "attention_backend_unavailable": "BackendUnavailable stops `streamer serve` at start (a CLI error)",
    "engine_error": "the EngineError base class's default; every raise names its own code",
    "cancelled": "a cancelled engine future; the engine never cancels the futures it hands out",
}


@pytest.fixture(scope="module")
def doc() -> protodoc.Doc:
    return protodoc.load()


@pytest.fixture(scope="module")
def recording(tokenizer, tmp_path_factory):
    from streamer.sessions.engine import Engine, EngineLimits
    from streamer.sessions.models import build_tiny_model
    from streamer.sessions.runner import ModelRunner

    lm = build_tiny_model(tokenizer, seed=7)
    runner = ModelRunner(lm.model, tokenizer, lm.name)
    engine = Engine(runner, EngineLimits(max_context_tokens=400, max_answer_tokens=64,
                                         max_flash_per_session=3)).start()
    small = Engine(runner, EngineLimits(kv_budget_bytes=kv_budget(runner, 96), share_prefix=False,
                                        park_idle_s=600, admission="queue")).start()
    try:
        yield asyncio.run(asyncio.wait_for(tour(engine, small, tmp_path_factory.mktemp("tour")), 400))
    finally:
        engine.stop()
        small.stop()


# ---- the document against the protocol's schema (no server) -------------------------------------


def _schema_view(schema) -> dict[str, bool]:
    return {name: not spec.required for name, spec in schema.items()}


def test_client_messages_are_the_schema(doc):
    documented = {name: {f: v.optional for f, v in fields.items()} for name, (fields, _) in doc.client.items()
                  if name != protodoc.MEDIA_FRAME}
    assert documented == {name: _schema_view(schema) for name, schema in SCHEMAS.items()}
    assert {f: v.optional for f, v in doc.media_header.items()} == _schema_view(MEDIA_FIELDS)


def test_client_replies_agree_with_the_event_rows(doc):
    reply_events = {r.event for r in doc.rows if isinstance(r.replies_to, list)}
    for name, (_, replies) in doc.client.items():
        said = replies & reply_events
        rows = {r.event for r in doc.rows if isinstance(r.replies_to, list) and name in r.replies_to}
        assert said == rows, f"{name}: the client table says {sorted(said)}, the event rows {sorted(rows)}"


def test_every_shape_a_row_names_is_a_table(doc):
    def shapes(fields):
        for f in fields.values():
            if isinstance(f.inner, str):
                yield f.inner
            elif isinstance(f.inner, dict):
                yield from shapes(f.inner)

    named = {s for r in doc.rows for s in shapes(r.fields)} | {s for t in doc.shapes.values() for s in shapes(t)}
    assert named <= set(doc.shapes), named - set(doc.shapes)


def test_every_code_in_the_source_is_documented(doc):
    patterns = [r'code\s*=\s*"([a-z_]+)"', r'refuse\(cmd, "([a-z_]+)"', r'\.error\(\s*"([a-z_]+)"',
                r'\.drop\("([a-z_]+)"', r'"code": "([a-z_]+)"']
    found: dict[str, str] = {}
    for folder in ("streamer", "sessions", "vision", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            here = list(patterns)
            if path.name == "protocol.py":  # its constants are the protocol's codes
                text = text[: text.index("# Media kinds")]
                here.append(r'^[A-Z_0-9]+ = "([a-z_]+)"$')
            for pattern in here:
                for code in re.findall(pattern, text, re.MULTILINE):
                    found.setdefault(code, str(path.relative_to(ROOT)))
    undocumented = {c: where for c, where in found.items()
                    if c not in doc.errors and c not in NOT_ON_THE_WIRE and c not in HANDSHAKE_CODES}
    assert not undocumented, f"codes the server can send that docs/protocol.md does not list: {undocumented}"
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    handshake = text[text.index("Connections are capped at the handshake"):][:1000]
    assert all(f"`{code}`" in handshake for code in HANDSHAKE_CODES), "a handshake refusal's code is not documented"


# ---- the document against a real server --------------------------------------------------------


def _check(obj: dict, fields: dict, doc, where: str, seen: set, problems: list, prefix: str = "") -> bool:
    """Does `obj` have every required field and nothing else? Records seen fields (and the
    problems, when `problems` is a list)."""
    ok = True
    for name, f in fields.items():
        if not f.optional and name not in obj:
            ok = False
            problems.append(f"{where}: {prefix}{name} missing")
    for name, value in obj.items():
        if name not in fields:
            ok = False
            problems.append(f"{where}: {prefix}{name} not documented")
            continue
        seen.add(f"{where}:{prefix}{name}")
        inner = fields[name].inner
        shape = doc.shapes[inner] if isinstance(inner, str) else inner
        if not isinstance(shape, dict):
            continue
        label = f"{{{inner}}}" if isinstance(inner, str) else where
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, dict):
                sub_prefix = "" if isinstance(inner, str) else f"{prefix}{name}."
                ok &= _check(item, shape, doc, label, seen, problems, sub_prefix)
    return ok


def _match(event: dict, doc, seen: set) -> tuple[protodoc.Row | None, list[str]]:
    body = {k: v for k, v in event.items() if k not in ENVELOPE}
    problems_by_row = []
    for row in doc.rows_of(event["type"]):
        problems: list[str] = []
        attempt: set = set()
        if _check(body, row.fields, doc, row.line, attempt, problems):
            seen |= attempt
            seen.add(row.line)
            return row, []
        problems_by_row.extend(problems)
    return None, problems_by_row or [f"no row for event type {event['type']!r}"]


def test_every_event_sent_matches_a_documented_row(doc, recording):
    seen: set = set()
    bad = []
    for event in recording.events:
        assert {"type", "event_id", "ts"} <= set(event), event
        row, problems = _match(event, doc, seen)
        if row is None:
            bad.append((event["type"], problems[:3]))
    assert not bad, f"events that match no row of docs/protocol.md: {bad[:10]}"


def test_every_documented_row_and_field_is_sent(doc, recording):
    seen: set = set()
    for event in recording.events:
        _match(event, doc, seen)
    not_run = set(recording.not_run)
    missing = []
    for row in doc.rows:
        if row.event in not_run:
            continue
        if row.line not in seen:
            missing.append(row.line)
            continue
        missing += [f"{row.line} {name}" for name in _all_fields(row.fields) if f"{row.line}:{name}" not in seen]
    for shape, fields in doc.shapes.items():
        if shape == "header":
            continue
        missing += [f"{{{shape}}} {name}" for name in _all_fields(fields) if f"{{{shape}}}:{name}" not in seen]
    assert not missing, f"documented but never sent on the tour: {missing}"
    if not_run:
        pytest.skip(f"not exercised here: {recording.not_run}")


def _all_fields(fields: dict, prefix: str = ""):
    for name, f in fields.items():
        yield prefix + name
        if isinstance(f.inner, dict):
            yield from _all_fields(f.inner, f"{prefix}{name}.")


def test_every_reply_carries_reply_to(doc, recording):
    seen: set = set()
    bad = []
    for event in recording.events:
        row, _ = _match(event, doc, seen)
        if row is None or row.replies_to == protodoc.ANY:
            continue
        if row.replies_to == protodoc.PUSHED or row.replies_to == [protodoc.MEDIA_FRAME]:
            if "reply_to" in event:
                bad.append(f"{event['type']} is pushed but carries reply_to")
            continue
        asked = recording.requests.get(event.get("reply_to"))
        if asked not in row.replies_to:
            bad.append(f"{event['type']}: reply_to {event.get('reply_to')!r} answers {asked!r}, not one of "
                       f"{row.replies_to}")
    assert not bad, bad[:10]
    errors = [e for e in recording.events if e["type"] == "error"]
    for event in errors:  # an error names the message it answers, whenever that message had an id
        if "reply_to" in event:
            assert event["reply_to"] in recording.requests


def test_every_documented_error_code_is_provoked(doc, recording):
    expected = set(doc.errors) - set(recording.not_run)
    assert set(recording.provoked) >= expected, f"never provoked: {sorted(expected - set(recording.provoked))}"
    sent = {e["error"]["code"] for e in recording.events if e["type"] == "error"}
    assert sent <= set(doc.errors), f"sent but not documented: {sorted(sent - set(doc.errors))}"
    for code, event in recording.provoked.items():  # the table says which come without reply_to
        if "no `reply_to`" in doc.errors[code]:
            assert "reply_to" not in event, event
    if recording.not_run:
        pytest.skip(f"not exercised here: {recording.not_run}")
