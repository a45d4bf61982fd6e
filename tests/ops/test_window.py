"""einwindow: values and gradients against Tensor.unfold on the padded whole tensor, and errors."""

from __future__ import annotations

import pytest
import torch

import einshard as es
from einshard.comm.mesh import Mesh
from einshard.notation import expand
from einshard.ops.window import einwindow
from einshard.testing import local_block
from test_halo import assert_all, max_err, randn, ref_pad


def window_reference(x, in_names, out_names, wins, boundary, fill):
    """``wins``: list of (axis, window name, (left, right)) in order."""
    widths = {in_names.index(a): lr for a, _, lr in wins}
    y = ref_pad(x, widths, boundary, fill)
    current = list(in_names)
    for axis, name, (l, r) in wins:
        y = y.unfold(in_names.index(axis), l + r + 1, 1)
        current.append(name)
    return y.permute([current.index(n) for n in out_names])


def check_window(mesh, formula, gshape, windows, radius, boundary="constant", fill=0.0, shapes=None,
                 families=None, ref=None, seed=0):
    name = f"{formula} {gshape} {radius} {boundary} shapes={shapes}"
    left, right = [s.strip() for s in formula.split("->")]
    in_names = [a.name for a in expand(left, families).inputs[0].axes]
    out_names = [a.name for a in expand(right, families).inputs[0].axes]
    wins = ref or [(a, windows[a], (radius[a], radius[a]) if isinstance(radius[a], int) else radius[a])
                   for a in windows]
    x = randn(gshape, seed, "x").requires_grad_()
    x_local = local_block(x.detach(), left, mesh, shapes=shapes, families=families).clone().requires_grad_()
    y = einwindow(formula, x_local, windows, radius, boundary=boundary, fill=fill, mesh=mesh, shapes=shapes,
                  families=families)
    want = window_reference(x, in_names, out_names, wins, boundary, fill)
    verr = max_err(y.detach(), local_block(want.detach(), right, mesh, shapes=shapes, families=families))
    cot = randn(want.shape, seed, "cot")
    want.backward(cot)
    y.backward(local_block(cot, right, mesh, shapes=shapes, families=families))
    gerr = max_err(x_local.grad, local_block(x.grad, left, mesh, shapes=shapes, families=families))
    return [(name + " value", verr), (name + " grad", gerr)]


def run_window_cases(mesh, cases):
    mesh = es.wrap_mesh(mesh)
    errors = []
    for k, case in enumerate(cases):
        errors += check_window(mesh, seed=k, **case)
    assert_all(errors)


BOUNDS = ("constant", "periodic", "replicate")


@pytest.mark.ranks(8)
def test_window_1d(mesh_8):
    cases = []
    for b in BOUNDS:
        cases += [
            dict(formula="b h/tp c -> b h/tp kh c", gshape=(2, 16, 2), windows={"h": "kh"}, radius={"h": 1},
                 boundary=b),
            dict(formula="h/tp c -> kh c h/tp", gshape=(12, 2), windows={"h": "kh"}, radius={"h": 3}, boundary=b,
                 shapes=[3, 0, 2, 0, 4, 1, 0, 2]),  # empty shards, radius wider than a shard
            dict(formula="h/tp -> h/tp k", gshape=(5,), windows={"h": "k"}, radius={"h": (4, 2)}, boundary=b,
                 shapes=[1, 1, 0, 1, 0, 1, 1, 0]),
        ]
    cases.append(dict(formula="h/tp w -> h/tp w kw", gshape=(8, 5), windows={"w": "kw"}, radius={"w": 2},
                      fill=3.0))  # window on an unsharded axis
    run_window_cases(mesh_8, cases)


@pytest.mark.ranks(8)
def test_window_2d_3d(mesh_2x4):
    cases = []
    for b in BOUNDS:
        cases += [
            dict(formula="b h/dp w/tp c -> b h/dp w/tp kh kw c", gshape=(1, 6, 8, 2),
                 windows={"h": "kh", "w": "kw"}, radius={"h": 1, "w": 1}, boundary=b),
            dict(formula="h/dp w/tp d -> kd h/dp kh w/tp kw d", gshape=(5, 7, 3),
                 windows={"h": "kh", "w": "kw", "d": "kd"}, radius={"h": 2, "w": (1, 2), "d": 1}, boundary=b,
                 shapes={"dp": [4, 1], "tp": [2, 0, 4, 1]}),
        ]
    fam = {"s": ("h/dp", "w/tp"), "k": ("kh", "kw")}
    cases.append(dict(formula="*s c -> *s *k c", gshape=(4, 8, 2), windows={"s": "k"}, radius={"s": (1, 2)},
                      families=fam, boundary="periodic",
                      ref=[("h", "kh", (1, 1)), ("w", "kw", (2, 2))]))
    run_window_cases(mesh_2x4, cases)


def test_window_local_matches_unfold():
    x = torch.randn(2, 3, 6, 5, dtype=torch.float64)
    y = einwindow("n c h w -> n c h w kh kw", x, {"h": "kh", "w": "kw"}, {"h": 1, "w": 2})
    ref = torch.nn.functional.pad(x, (2, 2, 1, 1)).unfold(2, 3, 1).unfold(3, 5, 1)
    assert torch.equal(y, ref)


def test_window_errors():
    x = torch.zeros(2, 4, 3)
    vmesh = Mesh.virtual((2, 2), ("dp", "sp"))
    with pytest.raises(ValueError, match="'kh' is sharded"):
        einwindow("b h/sp c -> b h/sp kh/dp c", x, {"h": "kh"}, {"h": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match="sharding of axis 'h'"):
        einwindow("b h/sp c -> b h kh c", x, {"h": "kh"}, {"h": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match="sharding of axis 'b'"):
        einwindow("b h/sp c -> b/dp h/sp kh c", x, {"h": "kh"}, {"h": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match="'c' is missing"):
        einwindow("b h c -> b h kh", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="'kh'.*missing"):
        einwindow("b h c -> b h c", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="'q'"):
        einwindow("b h c -> b h kh c", x, {"q": "kh"}, {"q": 1})
    with pytest.raises(ValueError, match="'h' has a window but no radius"):
        einwindow("b h c -> b h kh c", x, {"h": "kh"}, {})
    with pytest.raises(ValueError, match="radius names axis 'c'"):
        einwindow("b h c -> b h kh c", x, {"h": "kh"}, {"h": 1, "c": 1})
    with pytest.raises(ValueError, match="'z' is neither"):
        einwindow("b h c -> b h kh c z", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="factored"):
        einwindow("b (h c) -> b (h c) kh", x.reshape(2, 12), {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match=r"\.\.\."):
        einwindow("... h c -> ... h kh c", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="'h' appears twice"):
        einwindow("h h c -> h h kh c", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="'input -> output'"):
        einwindow("b h c", x, {"h": "kh"}, {"h": 1})
    with pytest.raises(ValueError, match="'h' is empty"):
        einwindow("b h c -> b h kh c", torch.zeros(2, 0, 3), {"h": "kh"}, {"h": 1}, boundary="periodic")
