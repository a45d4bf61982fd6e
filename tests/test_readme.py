"""The README's first example runs on 8 ranks and computes the two linears."""

import pathlib
import re

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import einshard as es
from einshard.testing import local_block

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _first_python_block() -> str:
    return re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)


@pytest.mark.ranks(8)
def test_readme_example(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    g = torch.Generator().manual_seed(0)
    x_whole, w1_whole, w2_whole = (torch.randn(s, generator=g) for s in [(4, 3, 8), (12, 8), (8, 12)])
    namespace = {
        "init_device_mesh": init_device_mesh,
        "x": local_block(x_whole, "b/dp n c", mesh),
        "w1": local_block(w1_whole, "h/tp c", mesh),
        "w2": local_block(w2_whole, "c h/tp", mesh),
        "print": lambda *a, **k: None,
    }
    exec(_first_python_block(), namespace)
    want = torch.einsum("bnh,ch->bnc", torch.einsum("bnc,hc->bnh", x_whole, w1_whole), w2_whole)
    assert torch.allclose(namespace["y"], local_block(want, "b/dp n c", mesh), atol=1e-5)
