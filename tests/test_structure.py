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


JOB_CLASSES = {"Job", "PrefillJob", "ReviseJob", "SegmentJob", "FrameJob", "QueryJob", "FlashJob", "ThinkJob",
               "ResizeJob"}


def sessions_modules():
    return [(path.relative_to(ROOT), parse(path)) for path in sorted((ROOT / "sessions").rglob("*.py"))]


def test_the_job_classes_are_named():
    """`JOB_CLASSES` is every class under sessions/ that derives from `Job`, directly or through
    another job class, so the guard below knows each of them."""
    bases = {node.name: {ast.unparse(b).split(".")[-1] for b in node.bases}
             for _, tree in sessions_modules() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}
    found = {"Job"}
    for _ in bases:  # one more generation of subclasses a turn
        found |= {name for name, of in bases.items() if of & found}
    assert found == JOB_CLASSES, f"job classes found: {sorted(found)}, named: {sorted(JOB_CLASSES)}"


def switches_on_a_job_class(node: ast.AST) -> bool:
    """`isinstance(x, SomeJob)`, `issubclass(...)`, `type(x) is SomeJob`, `x.__class__ == SomeJob`,
    `type(x).__name__ == "SomeJob"`, `case SomeJob():`."""
    def names(n):
        return {m.id for m in ast.walk(n) if isinstance(m, ast.Name)} | \
               {m.value for m in ast.walk(n) if isinstance(m, ast.Constant) and isinstance(m.value, str)}

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("isinstance", "issubclass"):
        return any(names(a) & JOB_CLASSES for a in node.args[1:])
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        asks_class = any((isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "type")
                         or (isinstance(n, ast.Attribute) and n.attr == "__class__") for side in sides for n in ast.walk(side))
        return asks_class and any(names(side) & JOB_CLASSES for side in sides)
    if isinstance(node, ast.MatchClass):
        return ast.unparse(node.cls).split(".")[-1] in JOB_CLASSES
    return False


def test_the_engine_never_switches_on_job_classes():
    """Jobs state their own lane and rules; nothing under sessions/ (the engine, scheduler,
    memory, lanes, the jobs themselves) asks a job its class: never `isinstance(job, ...)` or
    `type(job) is ...`."""
    offenders = [f"{path}:{node.lineno}: {ast.unparse(node)}"
                 for path, tree in sessions_modules() for node in ast.walk(tree) if switches_on_a_job_class(node)]
    assert not offenders, offenders
