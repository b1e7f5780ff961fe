"""The shape of the code, held by a test (docs/architecture.md states these): no class with more
than 20 methods, no mixins, and an engine that never switches on the class of a job."""

import ast
import re
from pathlib import Path

import pytest

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


# The import graph of our modules. A module's name is its import name (`sessions/jobs.py` is
# `streamer.sessions.jobs`, see pyproject's package-dir); function-level imports count as edges;
# imports under a module-level `if TYPE_CHECKING:` do not (they never run).
PACKAGE_OF = {"streamer": "streamer", "sessions": "streamer.sessions", "kernels": "streamer.kernels",
              "vision": "streamer.vision", "clients": "streamer.clients"}


def modules() -> dict[str, Path]:
    names = {}
    for folder, package in PACKAGE_OF.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join((package, *parts))] = path
    return names


def imports_of(name: str, path: Path, names: dict[str, Path]):
    """(module of ours it imports, line, inside a function?) for each import statement."""
    tree = parse(path)
    skip = set()
    for node in tree.body:
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for n in ast.walk(node))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]
        for target in targets:
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != name and target in names:
                yield target, node.lineno, id(node) in in_function


def import_cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    names = modules()
    edges = {m: sorted({t for t, _, _ in imports_of(m, p, names)}) for m, p in names.items()}
    index, low, stack, on, found, counter = {}, {}, [], set(), [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_among_our_modules():
    """Counting the imports inside functions too: a cycle cut only by a function-level import is
    still a cycle."""
    assert not import_cycles()


def test_sessions_import_ours_at_module_level():
    """No module of `sessions/` or `kernels/` (the engine and both sides of the C boundary) needs
    a function-level import of another module of ours (a lazy import that dodges a cycle hides
    it; optional heavy packages such as av may stay lazy)."""
    names = modules()
    late = [f"{path.relative_to(ROOT)}:{line} imports {target}"
            for name, path in names.items() if name.startswith(("streamer.sessions", "streamer.kernels"))
            for target, line, in_function in imports_of(name, path, names) if in_function]
    assert not late, late


# Who writes a session's state: each field of `Session` is assigned (or its container written
# through: `session.segments[k] = v`) only by the module that owns it; other modules call that
# module's functions. Fields not named here belong to sessions/session.py. A setter property of
# Session (`last_logits`) is Session's own code, so writes through it count as session.py's.
FIELD_OWNERS = {"flash": "flash", "thinking": "thinking", "window": "window", "actions": "actions",
                "queries_answered": "query", "idle_turn": "background",
                "closed": "engine", "last_active": "engine", "owner": "engine"}
# A feature's state grouped in one object (its class in sessions/session.py, which creates it):
# the object's fields are written only by the owner of the Session field that holds it, as
# `session.flash.next_id += 1`, `session.flash.questions[k] = q`, `session.flash.questions.pop(k)`.
STATE_CLASSES = {"flash": "FlashBoard", "actions": "ActionsState"}
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "append", "extend", "remove", "insert", "observe"}


def is_session(node: ast.AST) -> bool:
    return ast.unparse(node).split(".")[-1] in ("session", "s")


def init_fields(cls: ast.ClassDef) -> set[str]:
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def session_classes() -> dict[str, ast.ClassDef]:
    tree = parse(ROOT / "sessions" / "session.py")
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def session_fields() -> set[str]:
    return init_fields(session_classes()["Session"])


def state_fields() -> dict[str, set[str]]:
    """Session field -> the fields of the state object it holds."""
    classes = session_classes()
    return {name: init_fields(classes[cls]) for name, cls in STATE_CLASSES.items()}


def written(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """What a statement or call writes, with how: assignment targets (through subscripts), the
    first argument of a setattr, the receiver of a mutating method call."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    out = []
    for target in targets:
        while isinstance(target, ast.Subscript):
            target = target.value
        out.append(("assign", target))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
        out.append(("setattr", node.args[0]))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        out.append(("call", node.func.value))
    return out


def session_writes():
    """(module stem, line, field, path) for each write of a Session field outside Session itself:
    an assignment to `<...session>.field` (or `s.field`), through a subscript of it, or a setattr;
    and of a state object's field (`flash.questions`): also through a mutating method call."""
    fields, grouped = session_fields(), state_fields()
    for folder in LIBRARY:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = parse(path)
            session_class = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Session"]
            inside = {id(n) for c in session_class for n in ast.walk(c)}
            for node in ast.walk(tree):
                if id(node) in inside:
                    continue
                for how, target in written(node):
                    if how == "setattr":
                        if is_session(target):
                            yield path.stem, node.lineno, "setattr", path
                        elif isinstance(target, ast.Attribute) and target.attr in grouped and is_session(target.value):
                            yield path.stem, node.lineno, f"{target.attr}.setattr", path
                    elif isinstance(target, ast.Attribute):
                        held = target.value
                        if how == "assign" and target.attr in fields and is_session(held):
                            yield path.stem, node.lineno, target.attr, path
                        elif (isinstance(held, ast.Attribute) and held.attr in grouped
                              and target.attr in grouped[held.attr] and is_session(held.value)):
                            yield path.stem, node.lineno, f"{held.attr}.{target.attr}", path


def owner_of(field: str) -> str:
    return FIELD_OWNERS.get(field.split(".")[0], "session")


def test_session_fields_are_written_by_their_owners_only():
    foreign = sorted({f"{path.relative_to(ROOT)}:{line} writes {field} (owner: {owner_of(field)})"
                      for stem, line, field, path in session_writes()
                      if path.parent.name != "sessions" or stem != owner_of(field)})
    assert not foreign, foreign


def test_feature_state_is_grouped():
    """Each grouped feature holds one Session field, and its state object's fields are not also
    Session fields."""
    fields, grouped = session_fields(), state_fields()
    assert set(grouped) <= fields and set(grouped) <= set(FIELD_OWNERS)
    assert all(inner and not inner & fields for inner in grouped.values()), grouped


# The two traces of docs/architecture.md section 2, counted from the code: the functions a text
# chunk and a video frame pass through on their way to the K/V write and back, and where they
# change threads. A call crosses threads when it is one of CROSSING's, or puts work on a queue or
# pipe another thread reads (the engine's control and tokenizer queues, an executor, a decoder's
# pipe). Each trace's handoffs are exactly the sites named here, each path function holds no
# other crossing, and the doc's table marks the same number of handoffs.
CROSSING = {"call_soon_threadsafe", "run_coroutine_threadsafe", "run_in_executor", "to_thread", "wrap_future"}
BRIDGED = {"wrap", "post"}  # streamer/loopbridge.py: bridge(loop).wrap(...) / .post(...)
QUEUES = {"_control", "_tokenizing", "executor", "pipe"}
TRACES = {
    "text chunk": {
        "heading": "### The trace of one text chunk",
        "handoffs": [("sessions/engine.py", "Engine._tokenize", "self._tokenizing.put"),
                     ("sessions/engine.py", "Engine.call", "self._control.put"),
                     ("streamer/eventlog.py", "EventLog._first", "bridge(asyncio.get_running_loop()).wrap")],
        "path": [("streamer/connection.py", "Connection.receive"), ("streamer/connection.py", "Connection.dispatch"),
                 ("streamer/handlers.py", "input_append"), ("streamer/eventlog.py", "EventLog.first"),
                 ("streamer/eventlog.py", "EventLog._log_then_apply"), ("sessions/engine.py", "Engine.append"),
                 ("sessions/jobs.py", "append"), ("sessions/jobs.py", "PrefillJob.plan_one")],
    },
    "video frame": {
        "heading": "### The trace of one video frame",
        "handoffs": [("vision/video.py", "VideoDecoder.write", "self.pipe.write"),
                     ("streamer/eventlog.py", "EventLog.from_thread", "loop.call_soon_threadsafe"),
                     ("sessions/engine.py", "Engine.call", "self._control.put"),
                     ("streamer/eventlog.py", "EventLog._after", "bridge(asyncio.get_running_loop()).wrap")],
        # MediaHub.submit is left out: its crossings are the piece's ack (decoder -> loop) and
        # the audio branch's executor, not the frame's path
        "path": [("streamer/handlers.py", "media"), ("vision/ingest.py", "VideoIngest.feed"),
                 ("vision/ingest.py", "VideoIngest._start"), ("vision/ingest.py", "VideoIngest._write"),
                 ("vision/ingest.py", "VideoIngest._decoded"), ("vision/ingest.py", "VideoIngest._offer"),
                 ("vision/ingest.py", "VideoIngest._pump"), ("vision/ingest.py", "VideoIngest._encode"),
                 ("vision/vlm.py", "EngineFrameEncoder.encode"), ("streamer/media.py", "LoggedEngine.append_frame"),
                 ("streamer/eventlog.py", "EventLog.after"), ("sessions/jobs.py", "append_frame"),
                 ("sessions/jobs.py", "FrameJob.plan_one")],
    },
}
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def function(file: str, qualname: str) -> ast.AST:
    body = parse(ROOT / file).body
    node = None
    for name in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == name), None)
        assert node is not None, f"{file}: no {qualname} (the trace in docs/architecture.md names it)"
        body = node.body
    return node


def crossings(node: ast.AST) -> list[str]:
    found = []
    for call in ast.walk(node):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute):
            receiver = ast.unparse(call.func.value).split(".")[-1]
            bridged = (call.func.attr in BRIDGED and isinstance(call.func.value, ast.Call)
                       and ast.unparse(call.func.value.func) == "bridge")
            if call.func.attr in CROSSING or bridged or (call.func.attr in ("put", "put_nowait", "submit", "write")
                                                         and receiver in QUEUES):
                found.append(ast.unparse(call.func))
    return found


@pytest.mark.parametrize("trace", list(TRACES))
def test_the_traced_paths_change_threads_where_the_map_says(trace):
    spec = TRACES[trace]
    for file, qualname, call in spec["handoffs"]:
        assert call in crossings(function(file, qualname)), f"{file} {qualname} no longer hands off with {call}"
    declared = {(file, qualname): call for file, qualname, call in spec["handoffs"]}
    extra = [f"{file} {qualname}: {c}" for file, qualname in spec["path"] + list(declared)
             for c in crossings(function(file, qualname)) if c != declared.get((file, qualname))]
    assert not extra, f"thread handoffs on the {trace}'s path beyond the map's: {extra}"
    doc = (ROOT / "docs" / "architecture.md").read_text()
    section = doc[doc.index(spec["heading"]):]
    section = section[:section.index("\n### ", 1)]
    n = len(spec["handoffs"])
    marks = re.findall(r"\*\*handoff (\d+)", section)
    assert marks == [str(i) for i in range(1, n + 1)], f"the map's {trace} table marks handoffs {marks}, the code has {n}"
    assert re.search(rf"\b{NUMBERS[n]} thread handoffs", section, re.I), f"the map's {trace} text does not say {n}"
