"""einhalo: values, gradients, adjointness and bytes against whole-tensor references.

Every case generates the whole tensor identically on every rank, cuts this
rank's block with ``local_block``, runs ``einhalo`` on the block and
compares with the whole tensor padded by an independent reference
(``F.pad`` for constant, modular / clamped indices for periodic /
replicate), windowed to this rank's widened block. Gradients: every block
(combination of block indices of the sharded axes) gets its own cotangent;
the reference backpropagates ``sum_blocks <window(pad(x)), cot_block>``
through the whole tensor. Errors are all-reduced before asserting, so no
rank is left waiting.

The helpers here are reused by test_window / test_conv / test_roll.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import einshard as es
from einshard.core import _context
from einshard.comm import checks
from einshard.core._split import compute_split_shapes, resolve_split_shapes
from einshard.comm.mesh import Mesh
from einshard.notation import expand
from einshard.ops.halo import einhalo
from einshard.testing import local_block

DT = torch.float64


# -- reference helpers (shared with the other stencil tests) ------------------------------------


def gen(*key) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(hash(tuple(map(str, key))) % (2**31))
    return g


def randn(shape, *key):
    return torch.randn(tuple(shape), generator=gen(*key), dtype=DT)


def ref_pad(x, widths: dict, boundary: str, fill=0.0):
    """Pad whole ``x``: ``widths`` {dim: (left, right)}; independent of the implementation."""
    for dim, (left, right) in sorted(widths.items()):
        n = x.shape[dim]
        if boundary == "constant":
            pad = [0, 0] * (x.dim() - 1 - dim) + [left, right]
            x = F.pad(x, pad, mode="constant", value=fill)
            continue
        pos = torch.arange(-left, n + right)
        idx = pos % n if boundary == "periodic" else pos.clamp(0, n - 1)
        x = x.index_select(dim, idx)
    return x


def axis_blocks(mesh, spec: str, gshape, shapes=None, families=None):
    """Per axis of ``spec``: (name, list of (start, stop) per block, this rank's block index, dims)."""
    mesh = es.wrap_mesh(mesh) if mesh is not None else None
    tensor = expand(spec, families).inputs[0]
    out = []
    for axis, n in zip(tensor.axes, gshape):
        if not axis.mesh:
            out.append((axis.name, [(0, n)], 0, ()))
            continue
        dims = mesh.dims(axis.mesh)
        label = mesh.label(dims)
        split = None
        if shapes is not None:
            try:
                split = resolve_split_shapes(shapes, label, axis.name)
            except ValueError:
                split = None
        if split is None:
            split = compute_split_shapes(n, mesh.size(dims))
        starts = [sum(split[:k]) for k in range(len(split))]
        out.append((axis.name, [(s, s + z) for s, z in zip(starts, split)], mesh.index(dims), dims))
    return out


def halo_windows(blocks, widths_by_dim):
    """``{combo: window slices}`` in padded coordinates, and this rank's combo."""
    ranges = [range(len(iv)) for _, iv, _, _ in blocks]
    windows = {}
    for combo in itertools.product(*ranges):
        sl = []
        for dim, ((_, iv, _, _), k) in enumerate(zip(blocks, combo)):
            s, e = iv[k]
            l, r = widths_by_dim.get(dim, (0, 0))
            sl.append(slice(s, e + l + r))
        windows[combo] = tuple(sl)
    mine = tuple(b[2] for b in blocks)
    return windows, mine


def max_err(a, b) -> float:
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() if a.numel() else 0.0


def assert_all(errors: list[tuple[str, float]], atol=1e-9):
    """All-reduce the worst error of each case, then assert on every rank."""
    worst = torch.tensor([e for _, e in errors] or [0.0], dtype=torch.float64)
    worst = torch.nan_to_num(worst, nan=float("inf"))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    bad = [(name, w) for (name, _), w in zip(errors, worst.tolist()) if not w <= atol]
    assert not bad, f"{len(bad)} of {len(errors)} cases failed: {bad}"


def pairs(halos: dict, names) -> dict:
    out = {}
    for k, v in halos.items():
        out[names.index(k)] = (v, v) if isinstance(v, int) else tuple(v)
    return out


# -- the einhalo check ---------------------------------------------------------------------------


def check_halo(mesh, spec, gshape, halos, boundary="constant", fill=0.0, shapes=None, families=None,
               ref_halos=None, seed=0, grad=True):
    """Returns (name, value error, grad error)."""
    name = f"{spec} {gshape} {halos} {boundary} shapes={shapes}"
    names = [a.name for a in expand(spec, families).inputs[0].axes]
    widths = pairs(ref_halos or halos, names)
    x = randn(gshape, seed, "x").requires_grad_(grad)
    x_local = local_block(x.detach(), spec, mesh, shapes=shapes, families=families).clone().requires_grad_(grad)
    y = einhalo(spec, x_local, halos, boundary=boundary, fill=fill, mesh=mesh, shapes=shapes, families=families)
    blocks = axis_blocks(mesh, spec, gshape, shapes, families)
    windows, mine = halo_windows(blocks, widths)
    x_pad = ref_pad(x, widths, boundary, fill)
    verr = max_err(y.detach(), x_pad.detach()[windows[mine]])
    gerr = 0.0
    if grad:
        loss = 0.0
        for combo, sl in windows.items():
            loss = loss + (x_pad[sl] * randn(x_pad[sl].shape, seed, "cot", combo)).sum()
        loss.backward()
        y.backward(randn(y.shape, seed, "cot", mine))
        want = local_block(x.grad, spec, mesh, shapes=shapes, families=families)
        gerr = max_err(x_local.grad, want)
    return name, verr, gerr


def run_halo_cases(mesh, cases):
    mesh = es.wrap_mesh(mesh)
    errors = []
    for k, case in enumerate(cases):
        name, verr, gerr = check_halo(mesh, seed=k, **case)
        errors += [(name + " value", verr), (name + " grad", gerr)]
    assert_all(errors)


BOUNDS = ("constant", "periodic", "replicate")


@pytest.mark.ranks(8)
def test_halo_1d_mesh(mesh_8):
    cases = []
    for b in BOUNDS:
        cases += [
            dict(spec="b h/tp w", gshape=(2, 16, 3), halos={"h": 1}, boundary=b),
            dict(spec="b h/tp w", gshape=(2, 13, 3), halos={"h": (2, 1), "w": (1, 2)}, boundary=b,
                 shapes=compute_split_shapes(13, 8)),  # uneven
            # empty shards, halos wider than a neighbour's block
            dict(spec="h/tp c", gshape=(12, 2), halos={"h": (3, 2)}, boundary=b,
                 shapes={"tp": [3, 0, 2, 0, 4, 1, 0, 2]}),
            # halo wider than the whole axis (periodic wraps several times)
            dict(spec="h/tp", gshape=(5,), halos={"h": (7, 6)}, boundary=b, shapes=[1, 1, 0, 1, 0, 1, 1, 0]),
            dict(spec="h/tp", gshape=(3,), halos={"h": (0, 4)}, boundary=b, shapes=[0, 0, 0, 0, 0, 0, 0, 3]),
        ]
    cases += [
        dict(spec="b h/tp", gshape=(2, 16), halos={"h": 2}, fill=2.5),
        dict(spec="b h/tp", gshape=(2, 0), halos={"h": (1, 2)}, fill=-1.0),  # empty axis, constant
        dict(spec="b h/tp", gshape=(2, 16), halos={"h": 0, "b": 1}),  # zero width on the sharded axis
    ]
    run_halo_cases(mesh_8, cases)


@pytest.mark.ranks(8)
def test_halo_2d_mesh_corners(mesh_2x4):
    cases = []
    for b in BOUNDS:
        cases += [
            dict(spec="h/dp w/tp c", gshape=(8, 8, 2), halos={"h": 1, "w": 1}, boundary=b),
            dict(spec="h/dp w/tp c", gshape=(9, 10, 2), halos={"h": (2, 1), "w": (1, 3)}, boundary=b,
                 shapes={"dp": [5, 4], "tp": [3, 0, 4, 3]}),
            dict(spec="c w/tp h/dp", gshape=(1, 7, 3), halos={"h": (3, 4), "w": (5, 1)}, boundary=b,
                 shapes={"dp": [0, 3], "tp": [2, 1, 0, 4]}),
        ]
    cases += [
        dict(spec="h/dp-tp w", gshape=(11, 3), halos={"h": 2, "w": 1}, boundary="periodic",
             shapes=compute_split_shapes(11, 8)),
        dict(spec="b h w/tp", gshape=(2, 4, 9), halos={"h": 1, "w": (2, 2)}, boundary="replicate",
             shapes=[3, 3, 3, 0]),  # dp replicated
        dict(spec="b/dp h w/tp", gshape=(2, 4, 8), halos={"w": (1, 2)}, boundary="periodic"),  # b sharded, no halo
        dict(spec="w/tp-dp", gshape=(13,), halos={"w": (3, 2)}, boundary="constant", fill=1.5,
             shapes={"dp-tp": compute_split_shapes(13, 8)}),
    ]
    run_halo_cases(mesh_2x4, cases)


@pytest.mark.ranks(8)
def test_halo_3d_mesh_corners(mesh_2x2x2):
    fam = {"s": ("a/dp", "b/sp")}
    cases = []
    for b in BOUNDS:
        cases += [
            dict(spec="a/dp b/sp c/tp", gshape=(4, 6, 6), halos={"a": 1, "b": 1, "c": 1}, boundary=b),
            dict(spec="a/dp b/sp c/tp", gshape=(5, 4, 3), halos={"a": (2, 1), "b": (1, 2), "c": (3, 0)},
                 boundary=b, shapes={"dp": [5, 0], "sp": [1, 3], "tp": [2, 1]}),
            dict(spec="*s c/tp", gshape=(4, 4, 4), families=fam, halos={"s": (1, (0, 2)), "c": 1},
                 ref_halos={"a": 1, "b": (0, 2), "c": 1}, boundary=b),
        ]
    cases += [
        dict(spec="a/sp-tp b c/dp", gshape=(7, 2, 3), halos={"a": 2, "c": (1, 0)}, boundary="periodic",
             shapes={"sp-tp": [2, 2, 2, 1], "dp": [2, 1]}),
        dict(spec="x/tp y", gshape=(6, 3), halos={"x": 1, "y": 2}, boundary="replicate"),  # dp, sp replicated
    ]
    run_halo_cases(mesh_2x2x2, cases)


def _halo_reference_torch_pad(mesh):
    """Direct comparisons with F.pad's own modes on a 4-D tensor (replicate / circular)."""
    errors = []
    x = randn((2, 3, 8, 8), "fpad")
    for mode, boundary in [("replicate", "replicate"), ("circular", "periodic"), ("constant", "constant")]:
        y = einhalo("n c h/dp w/tp", local_block(x, "n c h/dp w/tp", mesh), {"h": (1, 2), "w": 1},
                    boundary=boundary, mesh=mesh)
        full = F.pad(x, (1, 1, 1, 2), mode=mode)
        blocks = axis_blocks(mesh, "n c h/dp w/tp", x.shape)
        windows, mine = halo_windows(blocks, {2: (1, 2), 3: (1, 1)})
        errors.append((mode, max_err(y, full[windows[mine]])))
    return errors


@pytest.mark.ranks(8)
def test_halo_matches_f_pad_modes(mesh_2x4):
    assert_all(_halo_reference_torch_pad(mesh_2x4))


# -- adjoint and double backward of the exchange ---------------------------------------------------


def _dot(a, b):
    return (a.detach() * b.detach()).sum()


@pytest.mark.ranks(8)
def test_halo_adjoint_and_double_backward(mesh_2x2x2):
    """<A x, y> == <x, Aᵀ y> summed over ranks (specs sharded over every mesh dim), and A z from double backward."""
    cases = [
        ("a/dp b/sp c/tp", (4, 6, 6), {"a": 1, "b": (2, 1), "c": 2}, None),
        ("a/dp-sp b/tp", (7, 5), {"a": (3, 2), "b": 1}, {"dp-sp": [3, 0, 1, 3], "tp": [2, 3]}),
    ]
    mesh_2x2x2 = es.wrap_mesh(mesh_2x2x2)
    lhs, rhs, dbl = [], [], []
    for k, (spec, gshape, halos, shapes) in enumerate(cases):
        for boundary in BOUNDS:
            x = local_block(randn(gshape, k, "ax"), spec, mesh_2x2x2, shapes=shapes).requires_grad_()
            ax = einhalo(spec, x, halos, boundary=boundary, mesh=mesh_2x2x2, shapes=shapes)
            y = randn(ax.shape, k, "ay", dist.get_rank()).requires_grad_()
            (aty,) = torch.autograd.grad(ax, x, y, create_graph=True)
            lhs.append(_dot(ax, y))
            rhs.append(_dot(x, aty))
            # double backward: d<Aᵀy, z>/dy = A z
            z = randn(x.shape, k, "az", dist.get_rank())
            (az,) = torch.autograd.grad(aty, y, z)
            want = einhalo(spec, z, halos, boundary=boundary, mesh=mesh_2x2x2, shapes=shapes)
            dbl.append(max_err(az, want))
    sums = torch.stack([torch.stack(lhs), torch.stack(rhs)])
    dist.all_reduce(sums)
    errors = [(f"adjoint {i}", abs(a - b) / (1 + abs(a))) for i, (a, b) in enumerate(zip(*sums.tolist()))]
    errors += [(f"double backward {i}", e) for i, e in enumerate(dbl)]
    assert_all(errors)


# -- bytes: every remote ghost cell moves exactly once ----------------------------------------------


def must_send(mesh, spec, gshape, halos, boundary, shapes=None):
    """Elements this rank must send: for every other rank of its exchange group, the distinct
    cells of this rank's block that the other's widened block reads (set arithmetic on the split)."""
    mesh = es.wrap_mesh(mesh)
    blocks = axis_blocks(mesh, spec, gshape, shapes)
    names = [b[0] for b in blocks]
    widths = pairs(halos, names)

    def reads(dim, s, e):
        n = gshape[dim]
        l, r = widths.get(dim, (0, 0))
        out = set()
        for p in range(s - l, e + r):
            if 0 <= p < n:
                out.add(p)
            elif boundary == "periodic":
                out.add(p % n)
            elif boundary == "replicate":
                out.add(min(max(p, 0), n - 1))
        return out

    total = 0
    combos = itertools.product(*(range(len(iv)) for _, iv, _, _ in blocks))
    mine = tuple(b[2] for b in blocks)
    for combo in combos:
        # peers differ from this rank only in the block indices of halo axes
        if any(c != m and (dim not in widths or widths[dim] == (0, 0)) for dim, (c, m) in enumerate(zip(combo, mine))):
            continue
        if combo == mine:
            continue
        cells = 1
        for dim, (_, iv, _, _) in enumerate(blocks):
            a, b = iv[mine[dim]]
            if dim in widths and widths[dim] != (0, 0):
                s, e = iv[combo[dim]]
                cells *= len(reads(dim, s, e) & set(range(a, b)))
            else:
                cells *= b - a
        total += cells
    return total


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_halo_moves_each_ghost_cell_once(mesh_2x4):
    cases = [
        ("h/dp w/tp c", (9, 10, 2), {"h": (2, 1), "w": (1, 3)}, "periodic", {"dp": [5, 4], "tp": [3, 0, 4, 3]}),
        ("h/dp w/tp", (8, 8), {"h": 1, "w": 1}, "constant", None),
        ("h/tp w", (5, 4), {"h": (7, 6)}, "periodic", {"tp": [1, 1, 0, 3]}),
        ("h/tp w", (6, 4), {"h": (3, 3)}, "replicate", {"tp": [0, 1, 0, 5]}),
    ]
    errors = []
    for spec, gshape, halos, boundary, shapes in cases:
        x = local_block(randn(gshape, "bytes"), spec, mesh_2x4, shapes=shapes).requires_grad_()
        with es.count_communication() as stats:
            y = einhalo(spec, x, halos, boundary=boundary, mesh=mesh_2x4, shapes=shapes)
            y.backward(torch.ones_like(y))
        want = must_send(mesh_2x4, spec, gshape, halos, boundary, shapes) * 8
        stats = stats.data  # (a call with shapes= also agrees across ranks: a 'check', not data)
        errors.append((f"{spec} forward bytes", abs(stats.forward.sent_bytes - want)))
        errors.append((f"{spec} backward bytes", abs(stats.backward.received_bytes - want)))
        errors.append((f"{spec} calls", abs(stats.forward.calls - 1)))
    assert_all(errors, atol=0)


# -- ambient mesh and split shapes -----------------------------------------------------------------


@pytest.mark.ranks(8)
def test_halo_ambient_mesh_and_shapes(mesh_8):
    shapes = (3, 0, 2, 0, 4, 1, 0, 2)
    x = randn((12, 2), "amb")
    x_local = local_block(x, "h/tp c", mesh_8, shapes={"tp": list(shapes)})
    want = einhalo("h/tp c", x_local, {"h": 2}, mesh=mesh_8, shapes={"tp": list(shapes)}, boundary="periodic")
    wrapped = es.wrap_mesh(mesh_8)
    token = _context.push(mesh=wrapped, shapes={(("tp",), "h"): shapes})
    try:
        got = einhalo("h/tp c", x_local, {"h": 2}, boundary="periodic")
    finally:
        _context.pop(token)
    with es.use_mesh(mesh_8):
        even = local_block(x[:8], "h/tp c", mesh_8)
        got2 = einhalo("h/tp c", even, {"h": 1})
    ref2 = einhalo("h/tp c", even, {"h": 1}, mesh=mesh_8)
    assert_all([("ambient shapes", max_err(got, want)), ("use_mesh", max_err(got2, ref2))])


# -- local and error cases (pytest process) --------------------------------------------------------


def test_halo_local_matches_f_pad():
    x = torch.randn(2, 3, 5, 4, dtype=DT, requires_grad=True)
    for mode, boundary in [("replicate", "replicate"), ("circular", "periodic"), ("constant", "constant")]:
        y = einhalo("n c h w", x, {"h": (2, 1), "w": (1, 3)}, boundary=boundary)
        r = F.pad(x, (1, 3, 2, 1), mode=mode)
        assert torch.equal(y, r)
        g = torch.randn_like(y)
        (gy,) = torch.autograd.grad(y, x, g)
        (gr,) = torch.autograd.grad(r, x, g)
        assert torch.allclose(gy, gr)
    y = einhalo("n c h w", x, {"h": 1}, fill=7.0)
    assert y[:, :, 0].eq(7).all() and y.shape == (2, 3, 7, 4)


def test_halo_errors():
    x = torch.zeros(2, 4)
    vmesh = Mesh.virtual((4,), ("sp",))
    with pytest.raises(ValueError, match="'q'"):
        einhalo("b h", x, {"q": 1})
    with pytest.raises(ValueError, match="'q'"):
        einhalo("b h/sp", x, {"q": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match=r"factored.*'h'"):
        einhalo("(h w)", torch.zeros(8), {"h": 1})
    with pytest.raises(ValueError, match=r"\.\.\."):
        einhalo("... h", x, {"h": 1})
    with pytest.raises(ValueError, match="'h' appears twice"):
        einhalo("h h", x, {"h": 1})
    with pytest.raises(ValueError, match=r"axis 'h' is empty.*periodic"):
        einhalo("b h", torch.zeros(2, 0), {"h": 1}, boundary="periodic")
    with pytest.raises(ValueError, match=r"axis 'h' is empty.*replicate"):
        einhalo("b h", torch.zeros(2, 0), {"h": 1}, boundary="replicate")
    with pytest.raises(ValueError, match="boundary"):
        einhalo("b h", x, {"h": 1}, boundary="reflect")
    with pytest.raises(ValueError, match="'h'"):
        einhalo("b h", x, {"h": -1})
    with pytest.raises(ValueError, match="'h'"):
        einhalo("b h", x, {"h": (1, 2, 3)})
    with pytest.raises(ValueError, match="one tensor spec"):
        einhalo("b h -> b h", x, {"h": 1})
    with pytest.raises(ValueError, match="partial"):
        einhalo("b h // sp", x, {"h": 1}, mesh=vmesh)
    with pytest.raises(ValueError, match="require mesh"):
        einhalo("b h/sp", x, {"h": 1})
    with pytest.raises(ValueError, match="family 's'"):
        einhalo("*s", x, {"s": 1}, families={"s": ("b", "h")})
    with pytest.raises(ValueError, match="2 dimensions"):
        einhalo("b h", torch.zeros(2, 3, 4), {"h": 1})


def test_halo_families_local():
    x = torch.randn(3, 4, 5, dtype=DT)
    y = einhalo("*s c", x, {"s": ((1, 0), 2)}, families={"s": ("h", "w")}, boundary="periodic")
    assert torch.equal(y, ref_pad(x, {0: (1, 0), 1: (2, 2)}, "periodic"))


@pytest.mark.ranks(8)
def test_halo_rank_local_error_agreed(mesh_8):
    """A local size that disagrees with shapes= on one rank: with checks on, every rank raises."""
    rank = dist.get_rank()
    shapes = [2] * 8
    x = torch.zeros(3 if rank == 5 else 2, 4)
    checks.set_checks(True)
    try:
        with pytest.raises(ValueError, match="rank 5:.*'h'"):
            einhalo("h/tp w", x, {"h": 1}, mesh=mesh_8, shapes=shapes)
    finally:
        checks.set_checks(False)
    # the pool is still in step: a normal exchange works afterwards
    y = einhalo("h/tp w", torch.ones(2, 4), {"h": 1}, mesh=mesh_8, shapes=shapes)
    assert_all([("after error", max_err(y[1:-1], torch.ones(2, 4)))])


def test_docstring_examples():
    import doctest

    import einshard.ops.conv
    import einshard.ops.halo
    import einshard.ops.roll
    import einshard.ops.window
    import einshard.plan.halo

    for module in (einshard.ops.halo, einshard.ops.window, einshard.ops.conv, einshard.ops.roll, einshard.plan.halo):
        result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
        assert result.failed == 0, module.__name__
        assert result.attempted > 0, module.__name__


@pytest.mark.ranks(8)
def test_stencils_inside_shard_map(mesh_8):
    """Inside shard_map the ambient mesh and split shapes apply (uneven, with empty blocks)."""
    from einshard.spmd.shard_map import shard_map
    from einshard.ops.conv import einconv
    from einshard.ops.roll import einroll
    from einshard.ops.window import einwindow

    mesh = es.wrap_mesh(mesh_8)
    shapes = {"tp": [3, 0, 2, 0, 4, 1, 0, 2]}
    x = randn((12, 3), "shard_map")
    w = randn((2, 3, 3), "shard_map w")

    def ops(t, **kw):
        p = einhalo("h/tp c", t, {"h": 1}, boundary="periodic", **kw)
        win = einwindow("h/tp c -> h/tp k c", t, {"h": "k"}, {"h": 2}, **kw)
        conv = einconv("h/tp c, o c k -> h/tp o", t, w, {"h": "k"}, **kw)
        return p[2:] + p[:-2] - 2 * t + win.sum(1) + einroll("h/tp c", t, {"h": 5}, **kw) + conv.sum(1, True)

    errors = []
    for check_vma in (False, True):
        xa = local_block(x, "h/tp c", mesh, shapes=shapes).requires_grad_()
        xb = xa.detach().clone().requires_grad_()
        y = shard_map(ops, in_specs="h/tp c", out_specs="h/tp c", mesh=mesh, shapes=shapes, check_vma=check_vma)(xa)
        want = ops(xb, mesh=mesh, shapes=shapes)
        cot = randn(want.shape, "cot", dist.get_rank())
        y.backward(cot)
        want.backward(cot)
        errors += [(f"value vma={check_vma}", max_err(y.detach(), want.detach())),
                   (f"grad vma={check_vma}", max_err(xa.grad, xb.grad))]
    assert_all(errors)
