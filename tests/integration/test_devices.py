"""Every tensor the library creates is created on its operands' device: no tensor factory without device=.

The scan reads the package source (docstrings are not code, so their examples are not scanned). A
factory that deliberately makes a host tensor is listed below with the reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import einshard

PACKAGE = Path(einshard.__file__).parent

# torch functions that make a tensor from sizes, values or ranges (``*_like`` and ``x.new_*`` follow
# their argument's device and are fine)
FACTORIES = frozenset(
    "zeros ones empty full arange range tensor as_tensor asarray randn rand randint randperm normal linspace "
    "logspace eye empty_strided scalar_tensor tril_indices triu_indices frombuffer from_numpy "
    "sparse_coo_tensor".split()
)

# (file relative to the package, enclosing function, factory) -> why a host tensor is right there
HOST_TENSORS = {
    ("comm/mesh.py", "Mesh.mesh", "arange"): "rank numbers of a virtual mesh: host metadata, like DeviceMesh.mesh",
    ("comm/mesh.py", "Mesh.mesh", "as_tensor"): "rank numbers of the mesh: host metadata, like DeviceMesh.mesh",
    ("comm/checks.py", "_exchange", "frombuffer"): "host bytes of a message, copied into the device buffer at once",
}


class _Factories(ast.NodeVisitor):
    """``(enclosing function, factory, line)`` of every ``torch.<factory>(...)`` call without ``device=``."""

    def __init__(self):
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []

    def _enter(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _enter

    def visit_Call(self, node):
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr in FACTORIES and isinstance(f.value, ast.Name)
                and f.value.id == "torch"):
            named = {k.arg for k in node.keywords}
            if "device" not in named:  # (a **kwargs is no device either: it cannot be checked here)
                self.found.append((".".join(self.scope) or "<module>", f.attr, node.lineno))
        self.generic_visit(node)


def _scan():
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        v = _Factories()
        v.visit(ast.parse(path.read_text(), str(path)))
        rel = path.relative_to(PACKAGE).as_posix()
        out += [(rel, scope, name, line) for scope, name, line in v.found]
    return out


def test_every_tensor_factory_names_its_device():
    bad = [f"einshard/{rel}:{line}: torch.{name}(...) in {scope} has no device="
           for rel, scope, name, line in _scan() if (rel, scope, name) not in HOST_TENSORS]
    assert not bad, "tensor factories without device= (create them on the operands' device):\n" + "\n".join(bad)


def test_host_tensor_exceptions_are_still_there():
    found = {(rel, scope, name) for rel, scope, name, _ in _scan()}
    stale = sorted(set(HOST_TENSORS) - found)
    assert not stale, f"HOST_TENSORS entries that match no code any more: {stale}"
    assert all(reason.strip() for reason in HOST_TENSORS.values())


def test_the_scan_finds_factories():
    v = _Factories()
    v.visit(ast.parse("def f(x):\n    a = torch.zeros(3)\n    b = torch.ones(3, device=x.device)\n"
                      "    return torch.tensor(1, dtype=torch.int64)\n"))
    assert [(s, n) for s, n, _ in v.found] == [("f", "zeros"), ("f", "tensor")]
