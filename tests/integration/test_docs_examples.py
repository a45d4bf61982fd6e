"""Documented examples run as written: docs/shard_map.md's first example, the pmean note, the local example."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import einshard as es

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / name).read_text(), re.S)


def _run_first_shard_map_example(code: str):
    """Runs on every rank, as the file would under torchrun (the process group is already up)."""
    namespace = {"__name__": "docs_example"}
    exec(code, namespace)
    params, x, loss = namespace["params"], namespace["x"], namespace["loss"]
    return loss.detach(), params["w"].grad, params["b"].grad, x


@pytest.mark.ranks(8)
def test_shard_map_first_example_runs_as_pasted():
    code = _python_blocks("shard_map.md")[0]
    assert '"b n c -> b/dp n c"' in code  # the block is self-contained: the whole batch, split on entry
    loss, w_grad, b_grad, x = _run_first_shard_map_example(code)
    torch.manual_seed(0)
    w = torch.randn(16, 8, requires_grad=True)
    b = torch.zeros(16, requires_grad=True)
    whole = x  # every rank drew the same whole batch
    want = (torch.tanh(whole @ w.T + b) ** 2).sum()
    want.backward()
    assert torch.allclose(loss, want.detach(), rtol=1e-5)
    assert torch.allclose(w_grad, w.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(b_grad, b.grad, rtol=1e-4, atol=1e-5)


def _uneven_mean(mesh):
    mesh = es.wrap_mesh(mesh)
    code = _python_blocks("shard_map.md")
    note = next(c for c in code if "total = es.spmd.psum(block.sum()" in c)
    namespace = {"es": es, "torch": torch, "mesh": mesh}
    exec(note, namespace)  # defines global_mean and checks it on 5 rows over dp = 2
    whole = torch.arange(5.0 * 4).reshape(5, 4) ** 2
    assert torch.allclose(namespace["global_mean"](whole), whole.mean())

    @es.shard_map("b c -> b/dp c", "", mesh=mesh)
    def naive(block):
        return es.spmd.pmean(block.mean(), "dp")

    assert not torch.allclose(naive(whole), whole.mean())  # the mean of the per-rank means is not the mean
    return True


@pytest.mark.ranks(8)
def test_pmean_note_gives_the_global_mean_of_uneven_blocks(mesh_2x4):
    assert _uneven_mean(mesh_2x4)


def test_local_example_labels_its_deliberate_error():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "local_einshard.py")], capture_output=True,
                         text=True, check=True, cwd=ROOT, timeout=300).stdout
    lines = out.splitlines()
    error = next(i for i, line in enumerate(lines) if line.startswith("Invalid einshard expression"))
    assert "deliberate error" in lines[error - 1]
    assert lines[-1].startswith("local einshard example: ok")


def test_readme_quick_start_says_how_long_tests_take_and_how_to_get_cpu_torch():
    readme = (ROOT / "README.md").read_text()
    assert "https://download.pytorch.org/whl/cpu" in readme
    assert re.search(r"test suite takes about \d+", readme)


def test_docs_do_not_cite_an_external_specification():
    offenders = [
        str(p.relative_to(ROOT))
        for pattern in ("docs/**/*.md", "einshard/**/*.py", "examples/*.py", "README.md", "benchmarks/*")
        for p in ROOT.glob(pattern)
        if p.is_file() and re.search(r"SPEC §|SPEC\.md|DESIGN\.md|PARAMS\.md", p.read_text())
    ]
    assert not offenders, offenders


def _stdout_prints(path: pathlib.Path) -> list[str]:
    """Every ``print`` call that writes to stdout and is not one JSON line."""
    import ast

    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            to_stderr = any(k.arg == "file" for k in node.keywords)
            json_line = len(node.args) == 1 and "json.dumps" in ast.unparse(node.args[0])
            if not (to_stderr or json_line):
                bad.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return bad


def test_benchmarks_print_only_json_lines_on_stdout():
    bad = [line for p in sorted((ROOT / "benchmarks").glob("bench_*.py")) for line in _stdout_prints(p)]
    assert not bad, bad


def test_bench_parse_prints_json_lines():
    import json

    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_parse.py"), "--length", "2000",
                          "--repeats", "1"], capture_output=True, text=True, check=True, cwd=ROOT, timeout=300).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows and all(r["chars"] >= 1900 and r["outcome"] in ("parsed", "rejected") for r in rows)
