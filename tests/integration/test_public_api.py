"""The facade: 32 names in ``einshard``, five namespaces, and every ``es.<name>`` that the docs, examples,
benchmarks and docstrings write resolves."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

import einshard as es
from einshard.comm.entries import COLLECTIVES
from einshard.spmd import named

ROOT = Path(__file__).resolve().parents[2]
NAMESPACES = {"spmd": es.spmd, "comm": es.comm, "params": es.params, "attention": es.attention,
              "testing": es.testing}


def test_the_facade_holds_32_names_that_resolve():
    assert len(es.__all__) <= 32 and len(set(es.__all__)) == len(es.__all__)
    for name in es.__all__:
        assert getattr(es, name) is not None, name
    for ns, module in NAMESPACES.items():
        assert getattr(es, ns) is module
        for name in getattr(module, "__all__", ()):
            assert hasattr(module, name), f"es.{ns}.{name}"


def test_a_moved_name_says_where_it_went():
    assert "psum" not in es.__all__
    for name, where in es._MOVED.items():
        with pytest.raises(AttributeError, match=re.escape(f"it is {where}.{name}")):
            getattr(es, name)
        assert hasattr(NAMESPACES[where[3:]], name), f"{where}.{name}"
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'$"):
        es.no_such_name  # noqa: B018


def test_every_named_collective_is_in_es_spmd():
    for entry in COLLECTIVES.values():
        if entry.named:
            assert getattr(es.spmd, entry.named) is getattr(named, entry.named)
    for name in ("psum", "pmean", "pmax", "pmin", "pvary", "axis_index", "axis_size", "get_vma"):
        assert callable(getattr(es.spmd, name))


def test_the_parameter_names_above_the_operations_are_in_es_params_in_a_fresh_interpreter():
    code = ("from einshard.params import to_dtensor, from_dtensor, load_from_dtensor_, GatheredParameter, "
            "register_native_grad_reduction_hooks_, StoredParameter, param_specs; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


_WRITTEN = re.compile(r"(?<![\w.])es\.([A-Za-z_]\w*+)(?:\.([A-Za-z_]\w*+))?(?!\*)")  # (not a pattern: es.x.register_*)


def _written_names():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py")),
             *sorted((ROOT / "benchmarks").rglob("*.py")), *sorted((ROOT / "einshard").rglob("*.py"))]
    for path in files:
        for line in path.read_text().splitlines():
            for m in _WRITTEN.finditer(line):
                moved_to = es._MOVED.get(m.group(1))
                if moved_to is None or f"{moved_to}.{m.group(1)}" not in line:  # (not a line saying where it went)
                    yield path.relative_to(ROOT), m.group(1), m.group(2)


def test_every_name_the_docs_and_examples_write_resolves():
    bad = set()
    for path, first, second in _written_names():
        if not hasattr(es, first):
            bad.add(f"{path}: es.{first}")
        elif first in NAMESPACES and second is not None and not hasattr(NAMESPACES[first], second):
            bad.add(f"{path}: es.{first}.{second}")
    assert not bad, "\n".join(sorted(bad))
