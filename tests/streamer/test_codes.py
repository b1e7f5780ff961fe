"""One list of error codes: the `Code` enum. The server sends only its members, docs/protocol.md
documents exactly them, and the client SDK reports them as members."""

import ast
import re
from pathlib import Path

from streamer.clients.client import StreamerError
from streamer.sessions.errors import Code, EngineError

ROOT = Path(__file__).resolve().parents[2]


def documented_codes() -> set[str]:
    text = (ROOT / "docs" / "protocol.md").read_text()
    table = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    codes = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            codes.update(re.findall(r"`([a-z_0-9]+)`", line.split("|")[1]))
    return codes


def test_the_docs_list_exactly_the_codes():
    assert documented_codes() == {c.value for c in Code}


def test_every_code_in_the_library_is_a_member():
    """No code is spelled as a bare string outside the enum: each `code=` argument and `code`
    class attribute is a `Code` (the kernels, which import nothing of ours, aside)."""
    strays = []
    for folder in ("streamer", "sessions", "vision", "clients"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                values = []
                if isinstance(node, ast.keyword) and node.arg == "code":
                    values.append(node.value)
                if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "code" for t in node.targets):
                    values.append(node.value)
                strays += [f"{path.relative_to(ROOT)}:{v.lineno}" for v in values
                           if isinstance(v, ast.Constant) and isinstance(v.value, str)]
    assert not strays, strays


def test_a_code_that_is_not_a_member_is_a_bug():
    import pytest

    with pytest.raises(ValueError):
        EngineError("x", code="no_such_code")
    assert EngineError("x", code="moved").code is Code.MOVED


def test_the_sdk_reports_members():
    err = StreamerError("flash_limit", "too many")
    assert err.code is Code.FLASH_LIMIT and err.code == "flash_limit"
    assert StreamerError("connection_closed", "gone").code == "connection_closed"  # the SDK's own, not the server's


def test_the_sdk_builds_commands_from_the_servers_schema():
    """The SDK spells no field name of its own: every command goes through protocol.command,
    which refuses a name the server's schema does not have."""
    import pytest

    from streamer.protocol import SCHEMAS, command

    assert command("input.text.append", session_id="s", text="x", client_seq=None) == {
        "type": "input.text.append", "session_id": "s", "text": "x"}
    with pytest.raises(ValueError, match="has no field 'txt'"):
        command("input.text.append", session_id="s", txt="x")
    with pytest.raises(ValueError, match="unknown command type"):
        command("input.append", session_id="s")
    for path in ("clients/client.py", "clients/robot.py", "clients/cli.py", "clients/media.py"):
        source = (ROOT / path).read_text()
        literal = [t for t in re.findall(r'"type":\s*"([a-z.]+)"', source) if t in SCHEMAS]
        assert not literal, f"{path} spells commands by hand: {literal}"
