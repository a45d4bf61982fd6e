"""Every ```python block of the README and the docs runs as pasted, or says which example file it is from.

The first line of a block says how it runs (docs/testing.md, "Code in the docs"):

- ``# run on N processes: torchrun --nproc-per-node N <name>.py``: a whole script, run on N gloo ranks
  (here: the harness's ranks, where the process group is up); the blocks after it that start with
  ``# continued on each of the N processes`` continue that script;
- ``# save as <name>.py and run: python <name>.py``: a whole script, run as a file;
- ``# excerpt of examples/<name>.py``: lines of that example (each line of the block is one of the file,
  in order; ``...`` stands for lines left out), which the example's own test runs;
- anything else runs in one process, the blocks of a page one after another in one namespace (as
  pasted into one session); ```pycon blocks there are doctests of that namespace.
"""

from __future__ import annotations

import doctest
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest
import torch

import einshard as es
from einshard.testing import run_on_ranks
from scripts import kept_process_group, script_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))

_FENCE = re.compile(r"^([ \t]*)```(python|pycon)[ \t]*\n(.*?)^\1```", re.S | re.M)  # (indented in a list, too)
_RANKS = re.compile(r"# run on (\d+) processes: torchrun --nproc-per-node (\d+) [\w.]+\.py\b")
_CONTINUED = re.compile(r"# continued on each of the (\d+) processes\b")
_EXCERPT = re.compile(r"# excerpt of (examples/[\w/]+\.py)\b")
_SCRIPT = re.compile(r"# save as ([\w.]+\.py) and run: python \1\b")


def _blocks(page: str) -> list[tuple[str, str, int]]:
    """``(fence, code, line)`` of every python/pycon block of ``page``."""
    text = (ROOT / page).read_text()
    return [(m.group(2), textwrap.dedent(m.group(3)), text.count("\n", 0, m.start()) + 1)
            for m in _FENCE.finditer(text)]


def _kind(fence: str, code: str) -> str:
    first = code.lstrip().splitlines()[0] if code.strip() else ""
    for name, pattern in (("ranks", _RANKS), ("continued", _CONTINUED), ("excerpt", _EXCERPT),
                          ("script", _SCRIPT)):
        if pattern.match(first):
            return name
    return "pycon" if fence == "pycon" else "local"


def _sessions(page: str):
    """The page's blocks grouped: ``(kind, [(code, line), ...])``; a rank script with its continuations."""
    out = []
    for fence, code, line in _blocks(page):
        kind = _kind(fence, code)
        if kind == "continued":  # continues the page's last rank script (local blocks may stand between)
            scripts = [blocks for k, blocks in out if k == "ranks"]
            assert scripts, f"{page}:{line}: a continued block must come after a rank script"
            n = int(_CONTINUED.match(code.lstrip()).group(1))
            assert n == int(_RANKS.match(scripts[-1][0][0].lstrip()).group(1)), f"{page}:{line}: another rank count"
            scripts[-1].append((code, line))
        else:
            out.append((kind, [(code, line)]))
    return out


def _ids(kind):
    return [pytest.param(page, i, id=f"{page}:{blocks[0][1]}")
            for page in PAGES for i, (k, blocks) in enumerate(_sessions(page)) if k == kind]


def test_every_page_with_code_is_covered():
    kinds = {k for page in PAGES for k, _ in _sessions(page)}
    assert kinds <= {"ranks", "excerpt", "script", "local", "pycon"}
    assert _sessions("README.md")[0][0] == "ranks"  # the README's first example is a whole script


@pytest.mark.parametrize("page", [p for p in PAGES if any(k in ("local", "pycon") for k, _ in _sessions(p))])
def test_local_blocks_run_in_order(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # files a block writes land here
    namespace = {"__name__": "__docs__"}
    checks = es.checks_enabled()
    try:
        for kind, blocks in _sessions(page):
            (code, line), = blocks if kind in ("local", "pycon") else [(None, None)]
            if kind == "local":
                exec(compile(code, f"{page}:{line}", "exec"), namespace)
            elif kind == "pycon":
                test = doctest.DocTestParser().get_doctest(code, namespace, f"{page}:{line}", page, line)
                runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
                runner.run(test, clear_globs=False)
                assert runner.tries > 0 and runner.failures == 0, f"{page}:{line}: the doctest above failed"
    finally:
        es.set_checks(checks)


def _run_script(code: str) -> bool:
    """One rank's run of a rank script, as a module of its own (torch.compile looks functions' globals up
    by module name); the group is up, so a script's own destroy_process_group is a no-op."""
    module = types.ModuleType("docs_script")
    sys.modules[module.__name__] = module
    try:
        with kept_process_group():
            exec(compile(code, "<docs script>", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return True


@pytest.mark.parametrize("page, index", _ids("ranks"))
def test_rank_scripts_end_cleanly(page, index):
    """Every torchrun script ends by leaving the process group (else a rank may abort at teardown:
    'terminate called without an active exception', exit 1)."""
    kind, blocks = _sessions(page)[index]
    last = "\n".join(c for c, _ in blocks).strip().splitlines()[-1]
    assert re.match(r"(torch\.distributed|dist)\.destroy_process_group\(\)", last), f"{page}:{blocks[-1][1]}: {last}"


@pytest.mark.parametrize("page, index", _ids("ranks"))
def test_rank_scripts_run(page, index):
    kind, blocks = _sessions(page)[index]
    n = int(_RANKS.match(blocks[0][0].lstrip()).group(1))
    code = "\n".join(textwrap.dedent(c) for c, _ in blocks)
    assert run_on_ranks(n, _run_script, code, timeout=600) == [True] * n


@pytest.mark.parametrize("page, index", _ids("script"))
def test_scripts_run_as_files(page, index, tmp_path):
    (code, _), = _sessions(page)[index][1]
    name = _SCRIPT.match(code.lstrip()).group(1)
    (tmp_path / name).write_text(code)
    subprocess.run([sys.executable, name], cwd=tmp_path, env=script_env(), check=True, timeout=600, capture_output=True)


def _code_lines(text: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("page, index", _ids("excerpt"))
def test_excerpts_are_lines_of_their_example(page, index):
    (code, line), = _sessions(page)[index][1]
    path = ROOT / _EXCERPT.match(code.lstrip()).group(1)
    assert path.is_file(), f"{page}:{line}: {path} does not exist"
    source = iter(_code_lines(path.read_text()))
    for wanted in _code_lines(code):
        if wanted == "...":
            continue
        assert any(wanted == have for have in source), f"{page}:{line}: {wanted!r} is not (in order) in {path.name}"
