"""The C boundary, held by a test: every ctypes structure, pointer and call into the C kernels is
in `kernels/` (kernels/cpu.py's typed API); `sessions/` never imports ctypes, and the modules on
either side of the boundary import ours at module level only (no cycle hidden in a function)."""

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


def test_the_native_path_imports_ours_at_module_level():
    files = [ROOT / "sessions" / f for f in ("native.py", "gguf_file.py", "models.py")]
    files += sorted((ROOT / "kernels").rglob("*.py"))
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("streamer")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
                elif isinstance(node, ast.Import) and any(a.name.startswith("streamer") for a in node.names):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
