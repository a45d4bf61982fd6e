"""einroll: values and gradients against torch.roll on the whole tensor, bytes moved, errors."""

from __future__ import annotations


import pytest
import torch

import einshard as es
from einshard.core import _context
from einshard.core._split import compute_split_shapes
from einshard.comm.mesh import Mesh
from einshard.notation import expand
from einshard.ops.roll import einroll
from einshard.testing import local_block
from test_halo import assert_all, axis_blocks, max_err, randn


def check_roll(mesh, spec, gshape, shifts, shapes=None, families=None, ref_shifts=None, seed=0):
    name = f"{spec} {gshape} {shifts} shapes={shapes}"
    names = [a.name for a in expand(spec, families).inputs[0].axes]
    ref = ref_shifts or shifts
    dims = tuple(names.index(k) for k in ref)
    x = randn(gshape, seed, "x").requires_grad_()
    x_local = local_block(x.detach(), spec, mesh, shapes=shapes, families=families).clone().requires_grad_()
    y = einroll(spec, x_local, shifts, mesh=mesh, shapes=shapes, families=families)
    want = torch.roll(x, tuple(ref.values()), dims)
    verr = max_err(y.detach(), local_block(want.detach(), spec, mesh, shapes=shapes, families=families))
    cot = randn(gshape, seed, "cot")
    want.backward(cot)
    y.backward(local_block(cot, spec, mesh, shapes=shapes, families=families))
    gerr = max_err(x_local.grad, local_block(x.grad, spec, mesh, shapes=shapes, families=families))
    return [(name + " value", verr), (name + " grad", gerr)]


def run_roll_cases(mesh, cases):
    mesh = es.wrap_mesh(mesh)
    errors = []
    for k, case in enumerate(cases):
        errors += check_roll(mesh, seed=k, **case)
    assert_all(errors)


@pytest.mark.ranks(8)
def test_roll_1d_mesh(mesh_8):
    cases = [
        dict(spec="b h/tp", gshape=(2, 16), shifts={"h": 3}),
        dict(spec="b h/tp", gshape=(2, 16), shifts={"h": -5, "b": 1}),
        dict(spec="b h/tp", gshape=(2, 16), shifts={"h": 16 * 3 + 2}),  # more than the axis
        dict(spec="b h/tp", gshape=(2, 16), shifts={"h": 0}),
        dict(spec="h/tp c", gshape=(12, 3), shifts={"h": 5}, shapes=[3, 0, 2, 0, 4, 1, 0, 2]),  # empty shards
        dict(spec="h/tp c", gshape=(13, 3), shifts={"h": -7, "c": 2}, shapes=compute_split_shapes(13, 8)),
        dict(spec="h/tp", gshape=(3,), shifts={"h": 1}, shapes=[0, 0, 0, 3, 0, 0, 0, 0]),  # one rank holds all
        dict(spec="h/tp", gshape=(0,), shifts={"h": 4}),  # empty axis
    ]
    run_roll_cases(mesh_8, cases)


@pytest.mark.ranks(8)
def test_roll_2d_mesh(mesh_2x4):
    cases = [
        dict(spec="h/dp w/tp", gshape=(6, 8), shifts={"h": 1, "w": 3}),
        dict(spec="h/dp w/tp c", gshape=(7, 9, 2), shifts={"h": -4, "w": 5},
             shapes={"dp": [7, 0], "tp": [2, 4, 0, 3]}),
        dict(spec="h/dp-tp w", gshape=(11, 2), shifts={"h": 6, "w": 1}, shapes={"dp-tp": compute_split_shapes(11, 8)}),
        dict(spec="b w/tp", gshape=(3, 8), shifts={"w": -1}),  # replicated over dp
        dict(spec="*s c", gshape=(4, 8, 2), families={"s": ("h/dp", "w/tp")}, shifts={"s": (1, -3)},
             ref_shifts={"h": 1, "w": -3}),
    ]
    run_roll_cases(mesh_2x4, cases)


@pytest.mark.ranks(8)
def test_roll_3d_mesh(mesh_2x2x2):
    cases = [
        dict(spec="a/dp b/sp c/tp", gshape=(4, 4, 6), shifts={"a": 1, "b": 3, "c": -2}),
        dict(spec="a/dp b/sp c/tp", gshape=(3, 5, 2), shifts={"a": 2, "b": -1, "c": 1},
             shapes={"dp": [1, 2], "sp": [5, 0], "tp": [0, 2]}),
        dict(spec="a/sp-tp b/dp", gshape=(8, 4), shifts={"a": 5}),
    ]
    run_roll_cases(mesh_2x2x2, cases)


def must_send_roll(mesh, spec, gshape, shifts, shapes=None):
    """Elements of this rank's block whose rolled position lies in another rank's block."""
    blocks = axis_blocks(mesh, spec, gshape, shapes)
    total = 1
    stay = 1
    for dim, (name, iv, k, dims) in enumerate(blocks):
        a, b = iv[k]
        total *= b - a
        n = gshape[dim]
        if name in shifts and len(iv) > 1 and n:
            stay *= sum(1 for j in range(a, b) if a <= (j + shifts[name]) % n < b)
        else:
            stay *= b - a
    return total - stay


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_roll_moves_only_crossing_slices(mesh_2x4):
    mesh = es.wrap_mesh(mesh_2x4)
    cases = [
        ("h/dp w/tp c", (7, 9, 2), {"h": -4, "w": 5}, {"dp": [7, 0], "tp": [2, 4, 0, 3]}),
        ("h/dp w/tp", (6, 8), {"h": 1, "w": 3}, None),
        ("b w/tp", (3, 8), {"w": 13, "b": 1}, None),
    ]
    errors = []
    for spec, gshape, shifts, shapes in cases:
        x = local_block(randn(gshape, "bytes"), spec, mesh, shapes=shapes).requires_grad_()
        with es.count_communication() as stats:
            y = einroll(spec, x, shifts, mesh=mesh, shapes=shapes)
            y.backward(torch.ones_like(y))
        want = must_send_roll(mesh, spec, gshape, shifts, shapes) * 8
        stats = stats.data  # (a call with shapes= also agrees across ranks: a 'check', not data)
        errors.append((f"{spec} forward", abs(stats.forward.sent_bytes - want)))
        errors.append((f"{spec} backward", abs(stats.backward.received_bytes - want)))
    assert_all(errors, atol=0)


@pytest.mark.ranks(8)
def test_roll_ambient(mesh_8):
    shapes = (3, 0, 2, 0, 4, 1, 0, 2)
    x_local = local_block(randn((12, 2), "amb"), "h/tp c", mesh_8, shapes={"tp": list(shapes)})
    want = einroll("h/tp c", x_local, {"h": 4}, mesh=mesh_8, shapes=list(shapes))
    token = _context.push(mesh=es.wrap_mesh(mesh_8), shapes={(("tp",), "h"): shapes})
    try:
        got = einroll("h/tp c", x_local, {"h": 4})
    finally:
        _context.pop(token)
    assert_all([("ambient", max_err(got, want))])


def test_roll_local_and_errors():
    x = torch.randn(3, 4, 5)
    assert torch.equal(einroll("a b c", x, {"a": -1, "c": 7}), torch.roll(x, (-1, 7), (0, 2)))
    assert torch.equal(einroll("*s c", x, {"s": (1, 2)}, families={"s": ("a", "b")}), torch.roll(x, (1, 2), (0, 1)))
    vmesh = Mesh.virtual((4,), ("sp",))
    with pytest.raises(ValueError, match="'q'"):
        einroll("a b c", x, {"q": 1})
    with pytest.raises(ValueError, match="'q'"):
        einroll("a b/sp c", x, {"q": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match="'b'"):
        einroll("a b c", x, {"b": 1.5})
    with pytest.raises(ValueError, match="factored"):
        einroll("a (b c)", x.reshape(3, 20), {"b": 1})
    with pytest.raises(ValueError, match=r"\.\.\."):
        einroll("a ...", x, {"a": 1})
    with pytest.raises(ValueError, match="'a' appears twice"):
        einroll("a a c", x, {"a": 1})
    with pytest.raises(ValueError, match="require mesh"):
        einroll("a b/sp c", x, {"b": 1})
