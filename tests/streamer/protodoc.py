"""docs/protocol.md, read by a machine: its tables of messages, events, fields and error codes.

A fields cell is a comma-separated list: `name` is a field, `name`? one that is sometimes
absent, `name` {...} an object (or a list of objects) with the fields inside the braces, and
`name` {shape} one whose fields are the table "| shape field | ... |". Text in parentheses and
words outside backticks are prose and ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"
PUSHED = "pushed"
ANY = "any"
MEDIA_FRAME = "media"  # the request "type" of a binary media frame


@dataclass(slots=True)
class Field:
    optional: bool = False
    inner: dict[str, Field] | str | None = None  # fields, a shape name, or unchecked


@dataclass(slots=True)
class Row:
    """One row of the server table: an event, what it answers, its fields."""

    event: str
    replies_to: list[str] | str  # client message types, or PUSHED / ANY
    fields: dict[str, Field]
    line: str


@dataclass(slots=True)
class Doc:
    client: dict[str, tuple[dict[str, Field], set[str]]] = field(default_factory=dict)  # type -> (fields, replies)
    media_header: dict[str, Field] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    shapes: dict[str, dict[str, Field]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # code -> its "when" text

    def rows_of(self, event: str) -> list[Row]:
        return [r for r in self.rows if r.event == event]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table: (header cells, body rows)."""
    lines = text.splitlines()
    out = []
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.match(r"^\|(\s*-+\s*\|)+$", lines[i + 1].strip()):
            header = _cells(lines[i])
            body = []
            i += 2
            while i < len(lines) and lines[i].startswith("|"):
                body.append(_cells(lines[i]))
                i += 1
            out.append((header, body))
        else:
            i += 1
    return out


def _cells(line: str) -> list[str]:
    parts = line.strip().strip("|").replace("\\|", "\x00").split("|")
    return [p.replace("\x00", "|").strip() for p in parts]


_TOKEN = re.compile(r"`([^`]+)`(\?)?|([{}(),])|([A-Za-z_]+)")


def parse_fields(cell: str) -> dict[str, Field]:
    """The fields a cell names (see the module docstring)."""
    tokens = [m for m in _TOKEN.finditer(cell)]
    fields, _ = _items(tokens, 0, top=True)
    return fields


def _items(tokens, i: int, top: bool) -> tuple[dict[str, Field], int]:
    out: dict[str, Field] = {}
    shape: str | None = None
    last: str | None = None
    depth = 0  # parentheses: prose
    while i < len(tokens):
        name, optional, punct, word = tokens[i].groups()
        i += 1
        if punct == "(":
            depth += 1
        elif punct == ")":
            depth = max(0, depth - 1)
        elif depth:
            continue
        elif punct == "{" and last is not None:
            inner, i = _items(tokens, i, top=False)
            out[last].inner = inner
        elif punct == "}":
            if not top:
                return (shape if shape and not out else out), i  # type: ignore[return-value]
        elif name is not None:
            last = name
            out[name] = Field(optional=bool(optional))
        elif word is not None and not top and not out:
            shape = word
    return out, i


def _names(cell: str) -> list[str]:
    """Backticked names outside parentheses."""
    return list(parse_fields(cell))


def load(path: Path = DOC) -> Doc:
    doc = Doc()
    text = path.read_text(encoding="utf-8")
    for header, body in tables(text):
        key = [h.lower() for h in header]
        if key == ["type", "fields", "reply"]:
            for kind, fields, reply in body:
                name = MEDIA_FRAME if "media frame" in kind else _names(kind)[0]
                doc.client[name] = (parse_fields(fields) if name != MEDIA_FRAME else {}, set(_names(reply)))
        elif key == ["event", "in reply to", "fields"]:
            for event, replies, fields in body:
                names = _names(replies)
                if names:
                    to: list[str] | str = names
                elif "media frame" in replies:
                    to = [MEDIA_FRAME]
                elif replies.startswith("any"):
                    to = ANY
                else:
                    to = PUSHED
                doc.rows.append(Row(_names(event)[0], to, parse_fields(fields), f"| {event} | {replies} |"))
        elif key == ["code", "when"]:
            for codes, when in body:
                for code in _names(codes):
                    if code in doc.errors:
                        raise AssertionError(f"error code {code} has two rows in {path.name}")
                    doc.errors[code] = when
        elif key == ["header field", "meaning"]:
            for names, _ in body:
                doc.media_header.update(parse_fields(names))
        elif key[0].endswith(" field") and len(key) == 2:
            shape = key[0].removesuffix(" field")
            doc.shapes[shape] = {}
            for names, _ in body:
                doc.shapes[shape].update(parse_fields(names))
    return doc
