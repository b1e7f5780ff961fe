"""The wire protocol, sans I/O: frames in, typed commands out; events in, JSON text out.

Client messages are JSON text frames `{"type": "noun.verb", ...}` (DESIGN section 9). Every
message is validated against a schema here, so the server only ever sees well-formed
commands; anything else becomes a `ProtocolError` with a stable code, a message that names
the bad value, and whether the connection can go on (it always can, for errors raised here).
Nothing here touches a socket, so it is tested and fuzzed without one.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from streamer.sessions.errors import Code

# Error codes sent in `error` events. Protocol-level ones are raised here; engine ones pass
# through from streamer.sessions.errors with the same shape.
INVALID_JSON = Code.INVALID_JSON
INVALID_UTF8 = Code.INVALID_UTF8
NOT_AN_OBJECT = Code.NOT_AN_OBJECT
UNKNOWN_TYPE = Code.UNKNOWN_TYPE
MISSING_FIELD = Code.MISSING_FIELD
INVALID_FIELD = Code.INVALID_FIELD
UNKNOWN_FIELD = Code.UNKNOWN_FIELD
MESSAGE_TOO_LARGE = Code.MESSAGE_TOO_LARGE
UNEXPECTED_BINARY = Code.UNEXPECTED_BINARY
TEXT_TOO_LONG = Code.TEXT_TOO_LONG
QUESTION_TOO_LONG = Code.QUESTION_TOO_LONG
SYSTEM_PROMPT_TOO_LONG = Code.SYSTEM_PROMPT_TOO_LONG
PATTERN_TOO_LONG = Code.PATTERN_TOO_LONG
FLASH_LIMIT = Code.FLASH_LIMIT
# Each per-field character limit has its own code (docs/limits.md lists them all).
LIMIT_CODES = {"max_text_chars": TEXT_TOO_LONG, "max_question_chars": QUESTION_TOO_LONG,
               "max_system_prompt_chars": SYSTEM_PROMPT_TOO_LONG, "max_pattern_chars": PATTERN_TOO_LONG,
               "max_id_chars": INVALID_FIELD}
MEDIA_HEADER_INVALID = Code.MEDIA_HEADER_INVALID
MEDIA_TOO_LARGE = Code.MEDIA_TOO_LARGE
UNSUPPORTED_MEDIA = Code.UNSUPPORTED_MEDIA

# Media kinds and the formats each takes on the wire ("opus": an Ogg-Opus byte stream, "aac": ADTS).
MEDIA_FORMATS: dict[str, tuple[str, ...]] = {
    "video": ("mp4", "webm", "mpegts"),
    "image": ("jpeg", "png"),
    "audio": ("pcm_s16le", "opus", "aac"),
}


class ProtocolError(Exception):
    """A message the protocol refuses. `recoverable`: the connection can go on."""

    def __init__(self, code: str, message: str, *, recoverable: bool = True,
                 reply_to: str | None = None, session_id: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code = Code(code)
        self.message = message
        self.recoverable = recoverable
        self.reply_to = reply_to
        self.session_id = session_id
        self.param = param


@dataclass(frozen=True, slots=True)
class ProtocolLimits:
    """Size limits checked before anything reaches the engine."""

    max_message_bytes: int = 1 << 20  # one text frame
    max_text_chars: int = 256 * 1024  # one input.text.append / revise
    max_question_chars: int = 8 * 1024
    max_system_prompt_chars: int = 16 * 1024
    max_pattern_chars: int = 1024  # action.rule pattern
    max_id_chars: int = 64
    max_flash_at_create: int = 64  # flash questions listed in one session.create
    max_media_bytes: int = 8 << 20  # payload of one binary media frame
    max_media_header_bytes: int = 4096


# ---- commands ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Command:
    type: str
    event_id: str | None = None
    session_id: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields.get(key)


class _Field:
    __slots__ = ("kind", "required", "lo", "hi", "limit", "schema", "nullable", "choices")

    def __init__(self, kind: str, required: bool = False, lo: float | None = None,
                 hi: float | None = None, limit: str | None = None, schema: dict | None = None,
                 nullable: bool = False, choices: tuple[str, ...] | None = None) -> None:
        self.kind, self.required, self.lo, self.hi, self.limit = kind, required, lo, hi, limit
        self.schema = schema  # for kind "object": the fields of the nested object
        self.nullable = nullable  # an explicit null is a value (kept as None), not an absent field
        self.choices = choices  # for kind "str": the only values it may take (an enumeration)


_SID = _Field("id", required=True)
# query.create `over`: what the answer reads. "sent": everything the client sent before the
# question (it waits for the session to read it); "read": what the session has read so far (it
# answers without waiting for the backlog of unread input).
QUERY_OVER = ("sent", "read")
PENALTY_FIELDS: dict[str, _Field] = {  # query.create and flash.register (sampling.Penalties)
    "repetition_penalty": _Field("float", lo=0.0, hi=10.0),
    "presence_penalty": _Field("float", lo=-2.0, hi=2.0),
    "frequency_penalty": _Field("float", lo=-2.0, hi=2.0),
    "end_bias": _Field("float", lo=-10.0, hi=10.0),
}
FLASH_FIELDS: dict[str, _Field] = {
    "question": _Field("str", True, limit="max_question_chars"),
    "flash_id": _Field("id"),
    "max_tokens": _Field("int", lo=1),
    "priority": _Field("int", lo=-100, hi=100),
    "min_interval_ms": _Field("int", lo=0, hi=86_400_000),
    "confirm": _Field("int", lo=1, hi=100),
    **PENALTY_FIELDS,
}
THINKING_FIELDS: dict[str, _Field] = {
    "mode": _Field("str", True, limit="max_id_chars"),
    "every_tokens": _Field("int", lo=0),
    "unit_tokens": _Field("int", lo=1),
    "stop": _Field("str", limit="max_id_chars"),
    "final_tokens": _Field("int", lo=0),
    "max_tokens": _Field("int", lo=1),
    "positions": _Field("str", limit="max_id_chars"),
    "offset": _Field("int", lo=0),
    "question": _Field("str", limit="max_question_chars"),
    "prompt": _Field("str", limit="max_question_chars"),
    "quote_tokens": _Field("int", lo=0),
    "repetition_penalty": PENALTY_FIELDS["repetition_penalty"],  # on the earlier notes' tokens
    "presence_penalty": PENALTY_FIELDS["presence_penalty"],
    "frequency_penalty": PENALTY_FIELDS["frequency_penalty"],
}
WINDOW_FIELDS: dict[str, _Field] = {
    "max_tokens": _Field("int", True, lo=1),
    "keep_tokens": _Field("int", lo=0),
    "sink_inputs": _Field("int", lo=0, hi=10_000),
}
SCHEMAS: dict[str, dict[str, _Field]] = {
    "session.create": {"system_prompt": _Field("str", limit="max_system_prompt_chars"),
                       "session_id": _Field("id"), "flash": _Field("flashlist"),
                       "thinking": _Field("object", schema=THINKING_FIELDS),
                       "window": _Field("object", schema=WINDOW_FIELDS, nullable=True)},
    "session.update": {"session_id": _SID, "thinking": _Field("object", schema=THINKING_FIELDS),
                       "window": _Field("object", schema=WINDOW_FIELDS, nullable=True)},
    "session.get": {"session_id": _SID},
    "session.close": {"session_id": _SID},
    "input.text.append": {"session_id": _SID, "text": _Field("str", True, limit="max_text_chars"),
                          "client_seq": _Field("int", lo=1, hi=2**53)},
    "input.text.revise": {"session_id": _SID, "text": _Field("str", True, limit="max_text_chars"),
                          "from_seq": _Field("int", lo=1), "client_seq": _Field("int", lo=1, hi=2**53)},
    "input.end": {"session_id": _SID},
    "query.create": {
        "session_id": _SID,
        "question": _Field("str", True, limit="max_question_chars"),
        "query_id": _Field("id"),
        "max_tokens": _Field("int", lo=1),
        "temperature": _Field("float", lo=0.0, hi=10.0),
        "top_p": _Field("float", lo=0.0, hi=1.0),
        "top_k": _Field("int", lo=0),
        "seed": _Field("int", lo=0, hi=2**63 - 1),
        "stop": _Field("strlist"),
        "stream": _Field("bool"),
        "over": _Field("str", choices=QUERY_OVER),
        **PENALTY_FIELDS,
    },
    "query.cancel": {"session_id": _SID, "query_id": _Field("id", required=True)},
    "flash.register": {"session_id": _SID, **FLASH_FIELDS},
    "flash.unregister": {"session_id": _SID, "flash_id": _Field("id", required=True)},
    "subscribe": {"session_id": _SID, "token": _Field("id")},  # no token: an operator (API key) watches
    "session.resume": {"session_id": _SID, "token": _Field("id", required=True),
                       "last_client_seq": _Field("int", lo=0, hi=2**53)},
    "sessions.list": {"session_id": _Field("id")},  # one session's snapshot, or all
    "unsubscribe": {"session_id": _SID},
    "action.rule": {"session_id": _SID, "flash_id": _Field("id", required=True),
                    "pattern": _Field("str", True, limit="max_pattern_chars"),
                    "command": _Field("anyobject", required=True), "debounce_ms": _Field("int", lo=0, hi=86_400_000),
                    "rule_id": _Field("id")},
    "action.rule.remove": {"session_id": _SID, "rule_id": _Field("id", required=True)},
    "action.start": {"session_id": _SID, "policy": _Field("id"), "mode": _Field("id"),
                     "dt_ms": _Field("int", lo=1, hi=10_000), "horizon": _Field("int", lo=1, hi=1000),
                     "latency_ms": _Field("numlist"), "gain": _Field("float", lo=0.0, hi=1000.0),
                     "max_speed": _Field("float", lo=0.0, hi=1e6)},
    "action.stop": {"session_id": _SID},
    "robot.state": {"session_id": _SID, "state": _Field("numlist", required=True), "ts": _Field("float", lo=0.0)},
}
# The JSON header of a binary media frame (not a text message type: see receive_binary).
MEDIA_FIELDS: dict[str, _Field] = {
    "session_id": _SID, "kind": _Field("id", required=True), "format": _Field("id", required=True),
    "seq": _Field("int", required=True, lo=0, hi=2**53), "ts": _Field("float", required=True, lo=0.0),
    "sample_rate": _Field("int", lo=1000, hi=384_000), "channels": _Field("int", lo=1, hi=8),
    "end": _Field("bool"), "live": _Field("bool"),
}


class ServerProtocol:
    """One connection's protocol state: parses client frames, formats server events."""

    def __init__(self, limits: ProtocolLimits | None = None) -> None:
        self.limits = limits or ProtocolLimits()
        self._event_ids = itertools.count(1)

    # ---- inbound --------------------------------------------------------------------------

    def receive_text(self, data: str | bytes) -> Command:
        """Parse one text frame. Raises ProtocolError (always recoverable)."""
        size = len(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        if size > self.limits.max_message_bytes:
            raise ProtocolError(MESSAGE_TOO_LARGE,
                                f"message of {size} bytes exceeds the limit of {self.limits.max_message_bytes} bytes")
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = bytes(data).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise self.invalid_utf8(exc) from exc
        try:
            msg = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(INVALID_JSON, f"message is not valid JSON: {exc}") from None
        if not isinstance(msg, dict):
            raise ProtocolError(NOT_AN_OBJECT, f"message must be a JSON object, got {type(msg).__name__}")
        return self._command(msg)

    def receive_binary(self, data: bytes) -> Command:
        """Parse one binary media frame (docs/protocol.md, "Media frames"): a 4-byte big-endian
        header length N, N bytes of UTF-8 JSON header, then the payload. Returns a `media`
        Command whose fields are the header's plus `payload` (bytes). Raises ProtocolError with
        `media_header_invalid` or `media_too_large` (both recoverable)."""
        data = bytes(data)
        if len(data) < 4:
            raise ProtocolError(MEDIA_HEADER_INVALID, f"binary frame of {len(data)} bytes has no header length "
                                "(4-byte big-endian prefix)")
        n = int.from_bytes(data[:4], "big")
        if n == 0 or n > self.limits.max_media_header_bytes or 4 + n > len(data):
            raise ProtocolError(MEDIA_HEADER_INVALID, f"binary frame header length {n} is not in "
                                f"[1, {min(self.limits.max_media_header_bytes, len(data) - 4)}]")
        try:
            header = json.loads(data[4:4 + n].decode("utf-8"), parse_constant=_reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(MEDIA_HEADER_INVALID, f"binary frame header is not UTF-8 JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ProtocolError(MEDIA_HEADER_INVALID, "binary frame header must be a JSON object")
        sid = header.get("session_id")
        session_id = sid if _is_id(sid, self.limits.max_id_chars) else None
        try:
            try:
                fields = self._validate("media", header)
            except ProtocolError as err:
                err.code = MEDIA_HEADER_INVALID
                raise
            self._check_media(fields, len(data) - 4 - n)
        except ProtocolError as err:
            err.session_id = session_id
            raise
        sid = fields.pop("session_id")
        fields["payload"] = data[4 + n:]
        return Command("media", None, sid, fields)

    def _check_media(self, f: dict[str, Any], size: int) -> None:
        kind, fmt = f["kind"], f["format"]
        known = "; ".join(f"{k}: {', '.join(v)}" for k, v in MEDIA_FORMATS.items())
        if kind not in MEDIA_FORMATS:
            raise ProtocolError(UNSUPPORTED_MEDIA, f"media kind {_short(kind)} is not supported ({known})",
                                param="kind")
        if fmt not in MEDIA_FORMATS[kind]:
            raise ProtocolError(UNSUPPORTED_MEDIA, f"format {_short(fmt)} is not supported for {kind} ({known})",
                                param="format")
        if fmt == "pcm_s16le" and (f.get("sample_rate") is None or f.get("channels") is None):
            raise ProtocolError(MEDIA_HEADER_INVALID, "pcm_s16le needs 'sample_rate' and 'channels'",
                                param="sample_rate")
        if size > self.limits.max_media_bytes:
            raise ProtocolError(MEDIA_TOO_LARGE, f"media payload of {size} bytes exceeds the limit of "
                                f"{self.limits.max_media_bytes} bytes", param="payload")
        if size == 0 and not f.get("end"):
            raise ProtocolError(MEDIA_HEADER_INVALID, "media frame has an empty payload and no 'end'",
                                param="payload")

    def refuse_binary(self, data: bytes) -> Command:
        """A server without media input refuses every binary frame."""
        raise ProtocolError(UNEXPECTED_BINARY,
                            f"binary frame of {len(data)} bytes not expected: media input is not enabled on this server")

    @staticmethod
    def invalid_utf8(exc: Exception | None = None) -> ProtocolError:
        where = f" at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else ""
        return ProtocolError(INVALID_UTF8, f"text frame is not valid UTF-8{where}")

    def _command(self, msg: dict) -> Command:
        sid = msg.get("session_id")
        session_id = sid if _is_id(sid, self.limits.max_id_chars) else None  # echoed only if well-formed
        event_id = msg.get("event_id")
        if event_id is not None and not _is_id(event_id, self.limits.max_id_chars):
            raise ProtocolError(INVALID_FIELD, f"event_id must be a string of 1-{self.limits.max_id_chars} "
                                "printable characters", param="event_id", session_id=session_id)
        kind = msg.get("type")
        try:
            if kind is None:
                raise ProtocolError(MISSING_FIELD, "message has no 'type'", param="type")
            if not isinstance(kind, str) or kind not in SCHEMAS:
                known = ", ".join(sorted(SCHEMAS))
                raise ProtocolError(UNKNOWN_TYPE, f"unknown message type {_short(kind)}; known: {known}", param="type")
            fields = self._validate(kind, msg)
        except ProtocolError as err:
            err.reply_to, err.session_id = event_id, session_id
            raise
        sid = fields.pop("session_id", None)
        return Command(kind, event_id, sid, fields)

    def _validate(self, kind: str, msg: dict, schema: dict[str, _Field] | None = None) -> dict[str, Any]:
        schema = (MEDIA_FIELDS if kind == "media" else SCHEMAS[kind]) if schema is None else schema
        extra = set(msg) - set(schema) - {"type", "event_id"}
        if extra:
            name = sorted(extra)[0]
            raise ProtocolError(UNKNOWN_FIELD, f"{kind} has no field {_short(name)}", param=name)
        out: dict[str, Any] = {}
        for name, spec in schema.items():
            if name in msg and msg[name] is None and spec.nullable:
                out[name] = None
                continue
            if name not in msg or msg[name] is None:
                if spec.required:
                    raise ProtocolError(MISSING_FIELD, f"{kind} needs '{name}'", param=name)
                continue
            out[name] = self._check(kind, name, spec, msg[name])
        return out

    def _check(self, kind: str, name: str, spec: _Field, value: Any) -> Any:
        bad = None
        if spec.kind == "str":
            if not isinstance(value, str):
                bad = "a string"
            elif not _is_unicode(value):
                bad = "valid Unicode (no lone surrogates)"
            elif spec.choices is not None and value not in spec.choices:
                bad = "one of " + ", ".join(repr(c) for c in spec.choices)
            elif spec.limit and len(value) > getattr(self.limits, spec.limit):
                raise ProtocolError(LIMIT_CODES[spec.limit], f"'{name}' has {len(value)} characters; the limit is "
                                    f"{getattr(self.limits, spec.limit)}", param=name)
        elif spec.kind == "id":
            if not _is_id(value, self.limits.max_id_chars):
                bad = f"a string of 1-{self.limits.max_id_chars} printable characters"
        elif spec.kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                bad = "an integer"
        elif spec.kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
                bad = "a finite number"
            else:
                value = float(value)
        elif spec.kind == "bool":
            if not isinstance(value, bool):
                bad = "true or false"
        elif spec.kind == "anyobject":
            if not isinstance(value, dict):
                bad = "a JSON object"
        elif spec.kind == "numlist":
            if (not isinstance(value, list) or len(value) > 64
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v) for v in value)):
                bad = "a list of at most 64 finite numbers"
            else:
                value = [float(v) for v in value]
        elif spec.kind == "object":
            if not isinstance(value, dict):
                bad = "an object"
            else:
                if "type" in value or "event_id" in value:
                    raise ProtocolError(UNKNOWN_FIELD, f"{kind}: '{name}' has no field 'type' or 'event_id'",
                                        param=name)
                value = self._validate(f"{kind} {name}", value, spec.schema)
        elif spec.kind == "flashlist":
            limit = self.limits.max_flash_at_create
            if isinstance(value, list) and len(value) > limit:
                raise ProtocolError(FLASH_LIMIT, f"{kind}: '{name}' lists {len(value)} flash questions; the limit "
                                    f"is {limit}", param=name)
            if not isinstance(value, list):
                bad = f"a list of at most {limit} flash questions"
            else:
                items = []
                for i, item in enumerate(value):
                    if not isinstance(item, dict):
                        raise ProtocolError(INVALID_FIELD, f"{kind}: '{name}[{i}]' must be an object, got "
                                            f"{_short(item)}", param=name)
                    if "type" in item or "event_id" in item:
                        raise ProtocolError(UNKNOWN_FIELD, f"{kind}: '{name}[{i}]' has no field 'type' or 'event_id'",
                                            param=name)
                    items.append(self._validate(f"{kind} {name}[{i}]", item, FLASH_FIELDS))
                value = items
        elif spec.kind == "strlist":
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value) or len(value) > 8:
                bad = "a list of at most 8 non-empty strings"
        if bad is None and spec.kind in ("int", "float"):
            if (spec.lo is not None and value < spec.lo) or (spec.hi is not None and value > spec.hi):
                bad = f"in [{spec.lo}, {spec.hi if spec.hi is not None else 'inf'}]"
        if bad:
            raise ProtocolError(INVALID_FIELD, f"{kind}: '{name}' must be {bad}, got {_short(value)}", param=name)
        return value

    # ---- outbound -------------------------------------------------------------------------

    def event(self, type: str, **fields: Any) -> str:
        """A server event as a JSON text frame, stamped with an event id and wall-clock time."""
        body = {"type": type, "event_id": f"evt_{next(self._event_ids)}", "ts": time.time()}
        body.update({k: v for k, v in fields.items() if v is not None})
        return json.dumps(body, ensure_ascii=False, separators=(",", ":"))

    def error(self, code: str, message: str, *, recoverable: bool = True, reply_to: str | None = None,
              session_id: str | None = None, param: str | None = None, media_seq: int | None = None) -> str:
        detail = {"code": code, "message": message, "recoverable": recoverable}
        if param:
            detail["param"] = param
        return self.event("error", error=detail, reply_to=reply_to, session_id=session_id, media_seq=media_seq)

    def protocol_error(self, err: ProtocolError) -> str:
        return self.error(err.code, err.message, recoverable=err.recoverable, reply_to=err.reply_to,
                          session_id=err.session_id, param=err.param)


def command(type: str, **fields: Any) -> dict[str, Any]:
    """A client command as it goes on the wire: its `type` and fields (None values left out),
    field names checked against the server's schema, so a client built on this module spells
    them once (here). Raises ValueError for an unknown type or field."""
    schema = SCHEMAS.get(type)
    if schema is None:
        raise ValueError(f"unknown command type {type!r}; known: {', '.join(sorted(SCHEMAS))}")
    unknown = set(fields) - set(schema) - {"event_id"}
    if unknown:
        raise ValueError(f"{type} has no field {sorted(unknown)[0]!r}; its fields: {', '.join(schema)}")
    return {"type": type, **{k: v for k, v in fields.items() if v is not None}}


def media_header(**fields: Any) -> dict[str, Any]:
    """The JSON header of a binary media frame, checked like `command`."""
    unknown = set(fields) - set(MEDIA_FIELDS)
    if unknown:
        raise ValueError(f"a media frame header has no field {sorted(unknown)[0]!r}; its fields: "
                         f"{', '.join(MEDIA_FIELDS)}")
    return {k: v for k, v in fields.items() if v is not None}


def media_frame(header: dict[str, Any], payload: bytes) -> bytes:
    """Build a binary media frame: 4-byte big-endian header length, JSON header, payload."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return len(head).to_bytes(4, "big") + head + payload


def _is_id(value: Any, limit: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= limit and value.isprintable()


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")
