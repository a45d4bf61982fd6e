"""The README's first example runs as pasted on 8 ranks, computes the two linears, and prints once."""

import contextlib
import io
import pathlib
import re

import pytest
import torch

import einshard as es
from einshard.testing import local_block

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


@pytest.mark.ranks(8)
def test_readme_example():
    namespace = {"__name__": "__main__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(_first_python_block(), namespace)
    mesh = namespace["mesh"]
    torch.manual_seed(0)
    x_whole, w1_whole, w2_whole = torch.randn(4, 3, 8), torch.randn(12, 8), torch.randn(8, 12)
    want = torch.einsum("bnh,ch->bnc", torch.einsum("bnc,hc->bnh", x_whole, w1_whole), w2_whole)
    assert torch.allclose(namespace["y"], local_block(want, "b/dp n c", mesh), atol=1e-5)
    printed = out.getvalue()
    assert ("einshard plan for" in printed) == (mesh.get_rank() == 0)  # explain is printed by one rank
    assert isinstance(mesh, es.Mesh)
