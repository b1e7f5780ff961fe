"""The C boundary, held by a test: every ctypes structure, pointer and call into the C kernels is
in `kernels/` (kernels/cpu.py's typed API); `sessions/` never imports ctypes. That both sides
import ours at module level only is test_sessions_import_ours_at_module_level in
tests/test_structure.py."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            yield node, ["." * node.level + (node.module or "")]


def test_sessions_never_import_ctypes():
    found = [f"{path.relative_to(ROOT)}:{node.lineno}" for path in sorted((ROOT / "sessions").rglob("*.py"))
             for node, names in imports(path) if any(n.split(".")[0] == "ctypes" for n in names)]
    assert not found, found

