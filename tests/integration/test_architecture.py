"""The package's import graph matches docs/development/architecture.md: folders are the layers.

The architecture note has one table row per layer: its number and the
package (a folder) or module it holds. This test reads every module's
imports (with ``ast``, without importing anything) and fails on

- a module in no listed folder, or a row naming no module;
- a module without a docstring (its one job);
- an import cycle between the package's modules;
- a module importing one of a higher layer, except the upward imports the
  note lists (and a listed one that is gone);
- an import inside a function, except of the optional or heavy third-party
  modules listed in the note;
- a private name (``_x``) of another module imported or read from outside it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "einshard"
NOTE = ROOT / "docs" / "development" / "architecture.md"
_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*`(einshard(?:\.\w+)*)`\s*\|")
_LAZY = re.compile(r"^Imported inside functions:(.*)$", re.M)
_UPWARD = re.compile(r"^Upward imports:(.*)$", re.M)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _rows() -> dict[str, int]:
    """The note's table: package or module -> layer."""
    rows: dict[str, int] = {}
    for line in NOTE.read_text().splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(2) not in rows, f"{m.group(2)} is listed twice in {NOTE.name}"
            rows[m.group(2)] = int(m.group(1))
    return rows


def _home(module: str, rows: dict[str, int]) -> str | None:
    """The row a module belongs to: itself, or the innermost listed package holding it."""
    name = module
    while name:
        if name in rows:
            return name
        name = name.rpartition(".")[0]
    return None


def _layers() -> dict[str, int]:
    """Every module's layer: its folder's (its home row's)."""
    rows = _rows()
    return {m: rows[h] for m in _modules() if (h := _home(m, rows)) is not None}


def _upward_allowed() -> set[tuple[str, str]]:
    m = _UPWARD.search(NOTE.read_text())
    assert m, f"{NOTE.name} must list the upward imports it allows ('Upward imports: none' if none)"
    allowed = set()
    for part in m.group(1).split(";"):
        if "→" in part:
            src, _, dsts = part.partition("→")
            (s,) = re.findall(r"`([\w.]+)`", src)
            allowed |= {(s, d) for d in re.findall(r"`([\w.]+)`", dsts)}
    return allowed


def _lazy_allowed() -> set[str]:
    m = _LAZY.search(NOTE.read_text())
    assert m, f"{NOTE.name} must list what may be imported inside functions"
    return set(re.findall(r"`([\w.]+)`", m.group(1)))


class _Imports(ast.NodeVisitor):
    """Every import of one module: ``(target, names, line, inside a function)``."""

    def __init__(self, name: str, is_package: bool, modules: dict):
        self.name, self.modules = name, modules
        self.base = name if is_package else name.rpartition(".")[0]
        self.found: list[tuple[str, tuple, int, bool]] = []
        self.aliases: dict[str, str] = {}  # local name -> package module it is bound to
        self.depth = 0

    def _absolute(self, module: str | None, level: int) -> str:
        if level == 0:
            return module or ""
        base = self.base.split(".")
        base = base[: len(base) - (level - 1)]
        return ".".join(base + ([module] if module else []))

    def _function(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node):
        for a in node.names:
            self.found.append((a.name, (), node.lineno, self.depth > 0))
            if a.asname and a.name in self.modules:
                self.aliases[a.asname] = a.name

    def visit_ImportFrom(self, node):
        target = self._absolute(node.module, node.level)
        names = tuple(a.name for a in node.names)
        for a in node.names:
            sub = f"{target}.{a.name}"
            if sub in self.modules:  # ``from . import x``: the submodule x
                self.found.append((sub, (), node.lineno, self.depth > 0))
                self.aliases[a.asname or a.name] = sub
                names = tuple(n for n in names if n != a.name)
        if names or target not in self.modules:
            self.found.append((target, names, node.lineno, self.depth > 0))

    def visit_Attribute(self, node):
        value = node.value
        if isinstance(value, ast.Name) and value.id in self.aliases and node.attr.startswith("_"):
            if not node.attr.startswith("__"):
                self.found.append((self.aliases[value.id], (node.attr,), node.lineno, False))  # a read, not an import
        self.generic_visit(node)


def _graph():
    modules = _modules()
    out = {}
    for name, path in modules.items():
        v = _Imports(name, path.name == "__init__.py", modules)
        v.visit(ast.parse(path.read_text(), str(path)))
        out[name] = v.found
    return modules, out


def _internal(target: str, modules) -> str | None:
    """The package module an import refers to (``None``: a third-party module)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _is_ancestor(a: str, b: str) -> bool:
    return b.startswith(a + ".")


def test_every_module_is_in_a_folder_of_the_note():
    modules, rows = _modules(), _rows()
    assert sorted(m for m in modules if _home(m, rows) is None) == [], f"modules in no folder of {NOTE.name}"
    assert sorted(set(rows) - set(modules)) == [], f"{NOTE.name} names packages or modules that do not exist"


def test_every_module_states_its_job():
    modules = _modules()
    bare = [m for m, path in modules.items() if not ast.get_docstring(ast.parse(path.read_text()))]
    assert bare == [], "modules without a docstring"


def _edges(modules, graph):
    """``(module, imported package module, line)`` for every import between two of the package's modules.

    A submodule importing a package it is inside is no edge: Python runs that package first.
    """
    for m, found in graph.items():
        for target, _names, line, _lazy in found:
            t = _internal(target, modules)
            if t and t != m and not _is_ancestor(t, m):
                yield m, t, line


def test_no_import_cycles():
    modules, graph = _graph()
    edges = {m: set() for m in modules}
    for m, t, _line in _edges(modules, graph):
        edges[m].add(t)
        # importing ``a.b.c`` first runs the packages ``a.b`` (unless ``m`` is inside them)
        parent = t.rpartition(".")[0]
        while parent and not (parent == m or _is_ancestor(parent, m)):
            edges[m].add(parent)
            parent = parent.rpartition(".")[0]
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            visit(m)


def test_layers_point_down():
    modules, graph = _graph()
    layers, allowed = _layers(), _upward_allowed()
    upward = {(m, t): line for m, t, line in _edges(modules, graph) if layers.get(t, 0) > layers.get(m, 0)}
    bad = [f"{m}:{line} (layer {layers.get(m)}) imports {t} (layer {layers.get(t)})"
           for (m, t), line in sorted(upward.items()) if (m, t) not in allowed]
    assert not bad, "imports of a higher layer:\n" + "\n".join(bad)
    gone = sorted(allowed - set(upward))
    assert not gone, f"upward imports listed in {NOTE.name} that no longer exist (remove them there): {gone}"


def test_no_imports_inside_functions():
    modules, graph = _graph()
    allowed = _lazy_allowed()
    bad = []
    for m, found in graph.items():
        for target, _names, line, lazy in found:
            third_party = _internal(target, modules) is None
            if lazy and not (third_party and any(target == a or target.startswith(a + ".") for a in allowed)):
                bad.append(f"{m}:{line} imports {target} inside a function")
    assert not bad, "imports inside functions:\n" + "\n".join(bad)


def test_no_private_names_across_modules():
    modules, graph = _graph()
    bad = []
    for m, found in graph.items():
        for target, names, line, _lazy in found:
            t = _internal(target, modules)
            if t is None or t == m:
                continue
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{m}:{line} uses {t}.{n}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


TESTS = ROOT / "tests"


def test_tests_mirror_the_package():
    """Every test file lies in ``tests/<folder>/`` for a folder of ``einshard/``, or in ``tests/integration/``
    (the suites that cross folders); helpers (no ``test_`` prefix) may also lie in ``tests/`` itself. Module
    names are unique across the folders: ``tests/conftest.py`` puts every folder on ``sys.path`` and the
    ranks import test modules by their plain names."""
    folders = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"integration"}
    files = sorted(p.relative_to(TESTS) for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)
    misplaced = [str(p) for p in files
                 if (p.name.startswith("test_") and (len(p.parts) != 2 or p.parts[0] not in folders))
                 or len(p.parts) > 2 or (len(p.parts) == 2 and p.parts[0] not in folders)]
    assert misplaced == [], f"test files outside tests/<einshard folder>/ or tests/integration/: {misplaced}"
    names = [p.name for p in files]
    assert sorted({n for n in names if names.count(n) > 1}) == [], "test modules with the same name in two folders"
