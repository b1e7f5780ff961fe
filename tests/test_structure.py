"""The shape of the code, held by a test (docs/architecture.md states these): no class with more
than 20 methods, no mixins, and an engine that never switches on the class of a job."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = ("streamer", "sessions", "kernels", "vision", "clients")
MAX_METHODS = 20


def parse(path: Path) -> ast.Module:
    """`ast.parse`, once more if CPython 3.11 raises its spurious "AST constructor recursion depth
    mismatch" (the check's counter is shared by threads: another test's leftover thread compiling a
    module while this one parses trips it)."""
    try:
        return ast.parse(path.read_text(), str(path))
    except SystemError:
        return ast.parse(path.read_text(), str(path))


def classes():
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = parse(path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    yield path.relative_to(ROOT), node


def test_no_class_has_more_than_20_methods():
    big = {f"{path}:{node.name}": n for path, node in classes()
           if (n := sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body)) > MAX_METHODS}
    assert not big, f"classes over {MAX_METHODS} methods: {big}"


def test_no_mixins():
    """A class inherits from at most one class of ours (Protocols and Enums aside), and none is
    named a mixin."""
    ours = {node.name for _, node in classes()}
    mixed = []
    for path, node in classes():
        bases = [ast.unparse(b) for b in node.bases]
        if "Mixin" in node.name or sum(b.split(".")[-1] in ours for b in bases if b != "Protocol") > 1:
            mixed.append(f"{path}:{node.name}({', '.join(bases)})")
    assert not mixed, mixed


def test_the_engine_never_switches_on_job_classes():
    """Jobs state their own lane and rules; the engine, scheduler, memory and lanes ask them,
    never `isinstance(job, ...)` or `type(job) is ...`."""
    job_classes = {"Job", "PrefillJob", "ReviseJob", "SegmentJob", "QueryJob", "FlashJob", "ThinkJob", "SlideJob"}
    offenders = []
    for name in ("engine.py", "scheduler.py", "memory.py", "jobs.py"):
        path = ROOT / "sessions" / name
        for node in ast.walk(parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "type"):
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                if names & job_classes or node.func.id == "type":
                    offenders.append(f"sessions/{name}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, offenders
