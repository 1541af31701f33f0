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
    """Each HPCSYNC_* variable the code or the README names is in hpcsync.core.settings, and only there
    is one read from os.environ (core.topology and core.mpi take the launcher's environment as a mapping)."""
    import re

    from hpcsync.core import settings

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


def test_modules_stay_small():
    """One concept per module: no module over 600 lines."""
    for path in PKG.rglob("*.py"):
        lines = len(path.read_text().splitlines())
        assert lines <= 600, (path, lines)


def _top_names(tree: ast.Module) -> dict:
    """name -> 'def' (defined in the module) or 'import' (bound by an import), at module level."""
    names = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = "def"
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in [target] if isinstance(target, ast.Name) else getattr(target, "elts", []):
                    if isinstance(name, ast.Name):
                        names[name.id] = "def"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names.setdefault((alias.asname or alias.name).split(".")[0], "import")
    return names


def _declared(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def test_every_module_declares_its_surface():
    """Every module has ``__all__``, a literal list of names the module itself defines (nothing it
    only imports: no re-exports), except the package's own ``hpcsync/__init__.py``, whose names are
    the API the docs show (each imported from the module that defines it)."""
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        tree = ast.parse(path.read_text())
        declared = _declared(tree)
        rel = path.relative_to(ROOT)
        if declared is None:
            problems.append(f"{rel}: no __all__")
            continue
        names = _top_names(tree)
        for name in declared:
            if path == PKG / "__init__.py":
                continue  # test_the_package_names_what_it_imports_lazily
            if names.get(name) != "def":
                problems.append(f"{rel}: {name} in __all__ is {'imported' if name in names else 'not defined'} here")
        assert len(set(declared)) == len(declared), f"{rel}: a name twice in __all__"
    assert not problems, "\n".join(problems)


def test_the_package_names_what_it_imports_lazily():
    """``hpcsync/__init__.py`` imports its public names on first use (PEP 562: ``import hpcsync``
    imports no submodule, not even numpy) and says each one's module twice: in the table
    ``_EXPORTS`` it imports from at run time, and in the ``if TYPE_CHECKING:`` block type checkers
    and IDEs read. The two, ``__all__`` and the modules' own ``__all__`` agree."""
    import hpcsync

    tree = ast.parse((PKG / "__init__.py").read_text())
    static = {}
    for node in tree.body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1, ast.dump(imp)
                for alias in imp.names:
                    module = f"{imp.module}.{alias.name}" if _exists(f"hpcsync.{imp.module}.{alias.name}") else imp.module
                    static[alias.asname or alias.name] = module
    assert static == hpcsync._EXPORTS, set(static.items()) ^ set(hpcsync._EXPORTS.items())
    assert sorted(hpcsync.__all__) == sorted([*static, "__version__"])
    for name, module in static.items():
        if not _exists(f"hpcsync.{module}") or name in ("comm", "h5"):
            continue
        declared = _declared(ast.parse(_path(f"hpcsync.{module}").read_text()))
        assert name in declared, f"hpcsync.{name}: not in hpcsync.{module}.__all__"


def _path(module: str) -> Path:
    path = PKG.parent / module.replace(".", "/")
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else path / "__init__.py"


def _private_uses() -> list:
    """Every place a module of hpcsync uses another module's private name: ``from .x import _y``
    and ``x._y`` where ``x`` is an hpcsync module it imported (relative or absolute, at the top or
    inside a function); also a public name taken from an hpcsync module whose ``__all__`` lacks it."""
    declared = {_module(p): _declared(ast.parse(p.read_text())) or [] for p in PKG.rglob("*.py")}
    found = []
    for path in sorted(PKG.rglob("*.py")):
        name = _module(path)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        modules = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "hpcsync"):
                if node.level:
                    base = package.split(".")
                    target = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    target = node.module
                for alias in node.names:
                    if _exists(f"{target}.{alias.name}"):
                        modules[alias.asname or alias.name] = f"{target}.{alias.name}"
                    elif alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {target} import {alias.name}")
                    elif target != "hpcsync" and alias.name not in declared.get(target, []):
                        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target}.{alias.name} is not in its __all__")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {modules[node.value.id]}.{node.attr}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A private name (``_x``) is its module's own: no other module of hpcsync imports it or reaches
    it as an attribute, and what a module takes from another is in that module's ``__all__``. (It
    replaces a class-size cap, which split classes where the cap bit rather than where a concept
    ended.)"""
    found = _private_uses()
    assert not found, "\n".join(found)


def test_architecture_names_every_module_in_its_package():
    """docs/architecture.md's table of modules has one row per module of the tree, each under its
    package's heading, and no row for a module that is gone (the doc had drifted: serial.py placed
    under backend/, four modules left out)."""
    import re

    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("## Where each module is"):]
    rows, heading = {}, None
    for line in table.splitlines():
        if line.startswith("### "):
            heading = line[4:].strip().strip("`")
        match = re.match(r"\|\s*`(hpcsync/[\w/]+\.py)`\s*\|", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} twice"
            rows[match.group(1)] = heading
    tree = {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")}
    assert not tree - set(rows), f"modules docs/architecture.md leaves out: {sorted(tree - set(rows))}"
    assert not set(rows) - tree, f"rows for modules that do not exist: {sorted(set(rows) - tree)}"
    for path, heading in rows.items():
        want = _module(ROOT / path) if path.endswith("__init__.py") else _module(ROOT / path).rsplit(".", 1)[0]
        assert heading == want, f"{path} is listed under {heading!r}, its package is {want!r}"


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
