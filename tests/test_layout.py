"""The package's shape: rooms by concern that import one way, no import cycle between modules
(module-level or deferred), small modules, one table of settings."""
import ast
from pathlib import Path

from launch import ROOT

PKG = ROOT / "hpcsync"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _exists(module: str) -> bool:
    path = PKG.parent / module.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(top: bool = False) -> dict:
    """module -> the hpcsync modules it imports anywhere in its body, relative or absolute. The
    package ``hpcsync`` itself is left out as a target (its __init__ runs before any submodule,
    which is no dependency of the submodule), unless ``top``: then a module that takes a name from
    ``hpcsync`` (a lazy name, an old module path) lists it."""
    graph = {}
    for path in PKG.rglob("*.py"):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "hpcsync"):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    deps.add(sub if _exists(sub) else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.split(".")[0] == "hpcsync")
        graph[name] = {d for d in deps if d != name and (top or d != "hpcsync")}
    return graph


def test_no_import_cycle():
    graph = imports()
    missing = {m: sorted(d for d in deps if not _exists(d)) for m, deps in graph.items()}
    assert not any(missing.values()), {m: d for m, d in missing.items() if d}  # also deferred imports
    assert "hpcsync.observe.watchdog" in graph and "hpcsync.core.jobend" in graph["hpcsync.observe.watchdog"]
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


# Each package may import only the packages of the levels below its own (and itself); backend and
# data share a level and import neither the other. The top: the command line and the public API.
LEVELS = [["core"], ["observe"], ["backend", "data"], ["start"], ["resilience"], ["cli", "__main__", ""]]


def _room(module: str) -> str:
    """hpcsync.<room>[...] -> room ("" for hpcsync itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_packages_import_one_way():
    """Every module sits in a room (a package by concern, or the top), and imports only rooms below
    its own: the core nothing of hpcsync, the observers the core, backend and data those two (not
    each other), starting a job all of them, keeping it alive everything but the command line."""
    level = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}
    graph = imports(top=True)  # a name taken from hpcsync itself is an import of the top
    loose = sorted(m for m in graph if _room(m) not in level)
    assert not loose, f"modules outside every room: {loose}"
    wrong = []
    for module, deps in graph.items():
        mine = _room(module)
        for dep in deps:
            theirs = _room(dep)
            assert theirs in level, f"{module} imports {dep}, which is in no room"
            if theirs != mine and level[theirs] >= level[mine] and level[mine] < len(LEVELS) - 1:
                wrong.append(f"{module} -> {dep}")
    assert not wrong, "imports against the direction core < observe < backend, data < start < resilience < cli:\n" + \
        "\n".join(sorted(wrong))
    top = sorted(p.name for p in PKG.iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "__main__.py", "cli.py"], top  # nothing loose at the top


def test_every_setting_in_one_table():
    """Each HPCSYNC_* variable the code or the README names is in hpcsync.settings, and only there
    is one read from os.environ (core.topology and core.mpi take the launcher's environment as a mapping)."""
    import re

    from hpcsync import settings

    named = set()
    for path in [*PKG.rglob("*.py"), ROOT / "README.md"]:
        text = path.read_text()
        named |= set(re.findall(r"HPCSYNC_[A-Z_]*[A-Z]", text))
        if path.suffix == ".py" and path.name != "settings.py":
            assert not re.search(r"environ(\.get)?\(?\[?[\"']HPCSYNC_", text), path
    assert named - {"HPCSYNC_TEST_OUT", "HPCSYNC_TEST_STAGE_OPTS"} <= set(settings.SETTINGS), named - set(settings.SETTINGS)
    tags = [settings.TAG_REPORT_ASK, settings.TAG_REPORT_STATE, settings.TAG_REPORT_DONE, settings.TAG_STORE_REQUEST,
            settings.TAG_STORE_REPLY, settings.TAG_LOG, settings.TAG_COPY_HEAD, settings.TAG_COPY_DATA,
            settings.TAG_COPY_ASK, settings.TAG_COPY_RANGE, *range(settings.TAG_BARRIER_FIRST, settings.TAG_BARRIER_FIRST + settings.TAG_BARRIER_COUNT)]
    assert len(tags) == len(set(tags)) and max(tags) <= 32767


def test_modules_and_classes_stay_small():
    """One concept per module: no module over 600 lines, no class over 350."""
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 600, (path, len(text.splitlines()))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno - node.lineno < 350, (path, node.name, node.end_lineno - node.lineno)


def test_one_process_is_a_communicator_not_a_branch():
    """A job of one process without MPI gets ``SelfComm`` from ``core.torchcomm.world()``: code takes
    no ``comm is None`` branch (only ``comm if comm is not None else <default>`` for an argument)."""
    import re

    branch = re.compile(r"\bcomm\b\s+is\s+(not\s+)?None")
    default = re.compile(r"\bcomm\s+if\s+comm\s+is\s+not\s+None\s+else\b")
    found = []
    for path in PKG.rglob("*.py"):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if branch.search(line) and not default.search(line):
                found.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_quick_loop_covers_every_package():
    """`-m quick` (tests/conftest.py's QUICK) names every package, and each of its entries selects
    at least one test that exists: a renamed test cannot drop out of the loop unnoticed."""
    import subprocess
    import sys

    from conftest import QUICK

    rooms = {room for rooms in LEVELS[:-1] for room in rooms}
    assert rooms <= set(QUICK), sorted(rooms - set(QUICK))
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "quick",
                          "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    selected = [line.split("/", 1)[-1] for line in out.stdout.splitlines() if "::" in line]
    assert selected, out.stdout[-2000:] + out.stderr[-2000:]
    empty = [prefix for prefixes in QUICK.values() for prefix in prefixes
             if not any(test.startswith(prefix) for test in selected)]
    assert not empty, f"entries of QUICK that select no test: {empty}"
