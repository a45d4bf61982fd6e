"""Distributed einfft on 8 gloo ranks: values and gradients against torch.fft on the whole tensor.

Every case generates the whole input identically on every rank, cuts this
rank's block with ``einshard.testing.local_block``, runs ``einfft`` and
compares the value and the input gradient (for a random cotangent) with
``torch.fft`` on the whole tensor cut the same way. Errors are all-reduced
before asserting, so no rank is left waiting; many cases run per dispatch.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.distributed as dist

import einshard as es
from einshard.core import _context
from einshard.core._split import compute_split_shapes
from einshard.notation import expand
from einshard.ops.fft import einfft
from einshard.testing import MeshSpec, local_block, run_on_ranks

MESHES = {
    "8": ((8,), ("tp",)),
    "2x4": ((2, 4), ("dp", "tp")),
    "2x2x2": ((2, 2, 2), ("dp", "sp", "tp")),
}
XYZ = {"x": "kx", "y": "ky", "z": "kz"}
XY = {"x": "kx", "y": "ky"}


# -- the reference check (runs on the ranks) -------------------------------------------------


def _axes_of(spec: str, families):
    return [(a.name, a.mesh) for a in expand(spec, families).inputs[0].axes]


def _auto_shapes(mesh, spec, names, shape, families):
    table = {}
    for name, m in _axes_of(spec, families):
        if m:
            dims = mesh.dims(m)
            table.setdefault(mesh.label(dims), {})[name] = compute_split_shapes(shape[names.index(name)], mesh.size(dims))
    return table or None


def _reference(x, in_names, out_names, pairs, real, inverse, norm, signal):
    dims = [in_names.index(a) for a, _ in pairs]
    if real:
        dims = sorted(dims[:-1]) + [dims[-1]]
        if inverse:
            s = [x.shape[d] for d in dims[:-1]] + [signal or 2 * (x.shape[dims[-1]] - 1)]
            y = torch.fft.irfftn(x, s=s, dim=dims, norm=norm)
        else:
            y = torch.fft.rfftn(x, dim=dims, norm=norm)
    else:
        y = (torch.fft.ifftn if inverse else torch.fft.fftn)(x, dim=dims, norm=norm)
    renamed = dict(pairs)
    state = [renamed.get(n, n) for n in in_names]
    return y.permute([state.index(o) for o in out_names])


def _pairs(axes, families):
    fam = {k: [m.split("/")[0] for m in v] for k, v in (families or {}).items()}
    out = []
    for k, v in axes.items():
        if k in fam:
            v = fam[v] if isinstance(v, str) else v
            out.extend(zip(fam[k], v))
        else:
            out.append((k, v))
    return out


def check_fft(mesh, formula, shape, axes, real=False, inverse=False, norm=None, shapes="auto", signal=None,
              families=None, complex_input=None, seed=0, grad=True):
    """Run one einfft case on this rank; returns (value error, gradient error) on this rank."""
    mesh = es.wrap_mesh(mesh)
    in_spec, out_spec = (s.strip() for s in formula.split("->"))
    in_names = [n for n, _ in _axes_of(in_spec, families)]
    out_names = [n for n, _ in _axes_of(out_spec, families)]
    pairs = _pairs(axes, families)
    if shapes == "auto":
        shapes = _auto_shapes(mesh, in_spec, in_names, shape, families)
    if complex_input is None:
        complex_input = inverse
    g = torch.Generator().manual_seed(seed)
    dtype = torch.complex128 if complex_input else torch.float64
    whole = torch.randn(shape, generator=g, dtype=dtype).requires_grad_(grad)
    want = _reference(whole, in_names, out_names, pairs, real, inverse, norm, signal)
    local = local_block(whole.detach(), in_spec, mesh, shapes=shapes, families=families).clone().requires_grad_(grad)
    sig = None if signal is None else {pairs[-1][0]: signal}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got = einfft(formula, local, axes, real=real, inverse=inverse, norm=norm, mesh=mesh, shapes=shapes,
                     families=families, signal_sizes=sig)
    want_local = local_block(want.detach(), out_spec, mesh, shapes=shapes, families=families)
    assert got.shape == want_local.shape, f"{formula}: shape {tuple(got.shape)} != {tuple(want_local.shape)}"
    assert got.dtype == want.dtype, f"{formula}: dtype {got.dtype} != {want.dtype}"
    err = (got - want_local).abs().max().item() if got.numel() else 0.0
    gerr = 0.0
    if grad:
        cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=want.dtype)
        want.backward(cot)
        got.backward(local_block(cot, out_spec, mesh, shapes=shapes, families=families))
        g_want = local_block(whole.grad, in_spec, mesh, shapes=shapes, families=families)
        gerr = (local.grad - g_want).abs().max().item() if g_want.numel() else 0.0
    return err, gerr


def check_many(mesh, cases, atol=1e-9):
    """Every case; the worst errors are all-reduced so every rank asserts the same thing."""
    errors = []
    for case in cases:
        try:
            errors.append(check_fft(mesh, **case))
        except Exception as exc:  # keep the ranks in step: report, then fail after the all-reduce
            errors.append((float("inf"), float("inf")))
            bad = f"{case}: {type(exc).__name__}: {exc}"
            worst = torch.tensor([e for pair in errors for e in pair], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            raise AssertionError(bad) from exc
    worst = torch.tensor([e for pair in errors for e in pair], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.view(-1, 2).tolist()
    failed = [(c["formula"], c.get("real"), c.get("inverse"), w) for c, w in zip(cases, worst) if max(w) > atol]
    assert not failed, f"cases off by more than {atol}: {failed}"
    return worst


def _run(mesh_key, cases, timeout=240):
    shape, names = MESHES[mesh_key]
    run_on_ranks(8, check_many, MeshSpec(shape, names), cases, timeout=timeout)


def _modes(formula, shape, axes, *, signal=None, **extra):
    """The four transforms of one layout, with three norms spread over them."""
    return [
        dict(formula=formula, shape=shape, axes=axes, **extra),
        dict(formula=formula, shape=shape, axes=axes, inverse=True, norm="ortho", **extra),
        dict(formula=formula, shape=shape, axes=axes, real=True, norm="forward", **extra),
        dict(formula=formula, shape=_half(shape, formula, axes, signal), axes=axes, real=True, inverse=True,
             signal=signal, norm="backward", **extra),
    ]


def _half(shape, formula, axes, signal):
    """The half-spectrum input shape of an inverse real transform whose output is ``shape``."""
    names = [a.split("/")[0] for a in formula.split("->")[0].split()]
    last = names.index(list(axes)[-1])
    n = signal or shape[last]
    out = list(shape)
    out[last] = n // 2 + 1
    return tuple(out)


# -- cases -----------------------------------------------------------------------------------

UNEVEN_8 = {"tp": {"x": [3, 0, 2, 2, 1, 4, 2, 2], "ky": [1, 1, 0, 2, 1, 1, 0, 0]}}

CASES_8 = (
    _modes("b x/tp y -> b kx/tp ky", (3, 16, 5), XY, signal=5)  # slab, odd half axis
    + _modes("x/tp -> k/tp", (64,), {"x": "k"}, signal=64)  # lone axis: four-step (64 = 8x8)
    + _modes("x y z/tp -> kz/tp ky kx", (3, 4, 16), XYZ, signal=16)  # 3 axes, permuted output
    + [
        dict(formula="b x/tp y -> b kx ky/tp", shape=(2, 16, 6), axes=XY, shapes=UNEVEN_8),
        dict(formula="b x/tp y -> b kx ky/tp", shape=(2, 16, 6), axes=XY, real=True,
             shapes={"tp": {"x": [3, 0, 2, 2, 1, 4, 2, 2], "ky": [1, 0, 0, 2, 1, 0, 0, 0]}}),
        dict(formula="x y/tp -> kx ky/tp", shape=(6, 16), axes=XY, real=True),  # sharded half axis
        dict(formula="x y/tp -> kx ky/tp", shape=(6, 9), axes=XY, real=True, inverse=True, signal=17),
        dict(formula="a x/tp -> a/tp k", shape=(8, 12), axes={"x": "k"}),  # shard moves to another axis
        dict(formula="x/tp -> k", shape=(12,), axes={"x": "k"}),  # replicated output
        dict(formula="x y -> kx/tp ky", shape=(8, 3), axes=XY, inverse=True),  # replicated input
        dict(formula="x/tp -> k/tp", shape=(13,), axes={"x": "k"}),  # prime length: the gather path
        dict(formula="x/tp -> k/tp", shape=(33,), axes={"x": "k"}, real=True, inverse=True),  # 64 = 8x8
        # four-step with the other norms (one per stage: they compose)
        dict(formula="x/tp -> k/tp", shape=(64,), axes={"x": "k"}, norm="ortho"),
        dict(formula="x/tp -> k/tp", shape=(64,), axes={"x": "k"}, inverse=True, norm="forward"),
        # four-step with uneven blocks in and out (one extra exchange on each side)
        dict(formula="x/tp -> k/tp", shape=(64,), axes={"x": "k"}, inverse=True,
             shapes={"tp": {"x": [10, 6, 8, 8, 0, 16, 8, 8], "k": [9, 7, 8, 8, 8, 8, 8, 8]}}),
    ]
)

UNEVEN_2x4 = {"dp": {"x": [5, 2], "ky": [0, 9]}, "tp": {"y": [1, 3, 0, 5], "kz": [2, 1, 1, 1]}}

CASES_2x4 = (
    _modes("x/dp y/tp z -> kx ky/dp kz/tp", (4, 8, 6), XYZ, signal=6)  # pencil, transposed output
    + _modes("x/dp y/tp z -> kx/dp ky/tp kz", (7, 9, 5), XYZ, signal=5)  # pencil, same layout out
    + [
        dict(formula="x/dp y/tp z -> kx ky/dp kz/tp", shape=(7, 9, 5), axes=XYZ, shapes=UNEVEN_2x4),
        dict(formula="x/dp y/tp z -> kx ky/dp kz/tp", shape=(7, 9, 5), axes=XYZ, real=True,
             shapes={"dp": {"x": [5, 2], "ky": [0, 9]}, "tp": {"y": [1, 3, 0, 5], "kz": [0, 2, 1, 0]}}),
        dict(formula="x/tp -> k/dp", shape=(32,), axes={"x": "k"}),  # output on another mesh dimension
        dict(formula="x/dp-tp y -> kx ky/dp-tp", shape=(16, 8), axes=XY, real=True),
        dict(formula="b x/tp y/dp -> b kx/dp ky/tp", shape=(2, 8, 6), axes=XY, inverse=True, norm="forward"),
        dict(formula="x/tp y/dp -> ky/tp kx/dp", shape=(8, 5), axes=XY, real=True, inverse=True, signal=8),
        dict(
            formula="b *s -> b *k",
            shape=(2, 8, 6),
            axes={"s": "k"},
            families={"s": ("x/dp", "y/tp"), "k": ("kx/tp", "ky/dp")},
        ),
    ]
)

CASES_2x2x2 = (
    _modes("x/dp y/sp z/tp -> kx/dp ky/sp kz/tp", (4, 4, 6), XYZ, signal=6)
    + _modes("x/dp-sp-tp -> k/dp-sp-tp", (64,), {"x": "k"}, signal=64)
    + [
        dict(formula="b x/dp-sp y z/tp -> b kx ky/tp kz/dp-sp", shape=(2, 8, 3, 8), axes=XYZ),
        dict(formula="x/dp y/sp z/tp -> kx/tp ky/dp kz/sp", shape=(5, 3, 4), axes=XYZ, real=True),
        dict(formula="x/sp y -> kx ky/dp", shape=(6, 4), axes={"y": "ky", "x": "kx"}, real=True),
    ]
)


def _random_cases(mesh_key, n, seed):
    """Random layouts: 1-3 transform axes (+0-1 untouched), random placements, modes and sizes."""
    rng = random.Random(seed)
    _shape, names = MESHES[mesh_key]
    cases = []
    while len(cases) < n:
        k = rng.randint(1, 3)
        axes = list("xyz"[:k]) + (["b"] if rng.random() < 0.5 else [])
        sizes = {a: rng.randint(2, 9) for a in axes}
        transform = [a for a in axes if a != "b"]
        rng.shuffle(transform)
        mapping = {a: "k" + a for a in transform}

        def place(pool):
            spec = {a: [] for a in pool}
            for d in names:
                choice = rng.choice(pool + [None])
                if choice is not None:
                    spec[choice].append(d)
            return spec

        src = place(axes)
        out_axes = [mapping.get(a, a) for a in axes]
        rng.shuffle(out_axes)
        dst = place(out_axes)
        left = " ".join(f"{a}/{'-'.join(src[a])}" if src[a] else a for a in axes)
        right = " ".join(f"{a}/{'-'.join(dst[a])}" if dst[a] else a for a in out_axes)
        real = rng.random() < 0.5
        inverse = rng.random() < 0.5
        case = dict(formula=f"{left} -> {right}", axes=mapping, real=real, inverse=inverse,
                    norm=rng.choice([None, "ortho", "forward"]), seed=len(cases))
        shape = tuple(sizes[a] for a in axes)
        if real and inverse:
            signal = sizes[transform[-1]]
            case["signal"] = signal
            shape = _half(shape, case["formula"], mapping, signal)
        case["shape"] = shape
        cases.append(case)
    return cases


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_key, cases",
    [("8", CASES_8), ("2x4", CASES_2x4), ("2x2x2", CASES_2x2x2)],
    ids=["8", "2x4", "2x2x2"],
)
def test_values_and_gradients(mesh_key, cases):
    _run(mesh_key, cases)


@pytest.mark.parametrize("mesh_key", list(MESHES))
def test_random_layouts(mesh_key):
    _run(mesh_key, _random_cases(mesh_key, 12, seed=len(mesh_key)))


def roundtrip(mesh, cases):
    """einfft then the inverse einfft returns the (float32) input to 1e-5 on every rank."""
    mesh = es.wrap_mesh(mesh)
    worst = 0.0
    for formula, back, shape, axes, real in cases:
        torch.manual_seed(0)
        whole = torch.randn(shape)
        in_spec, out_spec = formula.split("->")
        names = [a.split("/")[0] for a in in_spec.split()]
        x = local_block(whole, in_spec, mesh)
        y = einfft(formula, x, axes, real=real, mesh=mesh)
        # the inverse needs the (possibly uneven) split shapes of the spectrum
        sizes = dict(zip([axes.get(n, n) for n in names], shape))
        last = list(axes)[-1]
        if real:
            sizes[axes[last]] = shape[names.index(last)] // 2 + 1
        spectrum_shape = tuple(sizes[a.split("/")[0]] for a in out_spec.split())
        shapes = _auto_shapes(mesh, out_spec, [a.split("/")[0] for a in out_spec.split()], spectrum_shape, None)
        inv_axes = {v: k for k, v in axes.items()}
        sig = {last: shape[names.index(last)]} if real else None
        z = einfft(back, y, inv_axes, real=real, inverse=True, mesh=mesh, shapes=shapes, signal_sizes=sig)
        want = local_block(whole, back.split("->")[1], mesh)
        worst = max(worst, (z.real if z.is_complex() else z).sub(want).abs().max().item() if z.numel() else 0.0)
    t = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    assert t.item() < 1e-5, t.item()
    return t.item()


# checks off: this test counts exact communication, and checks add one small collective per
# operation (counted in tests/comm/test_checks.py)
@pytest.mark.ranks(8, checks=False)
def test_explain_matches_communication(mesh_2x4):
    """explain=True runs nothing; its forward bytes are what count_communication sees (even shards)."""
    mesh = es.wrap_mesh(mesh_2x4)
    formula = "x/dp y/tp z -> kx ky/dp kz/tp"
    x = torch.randn(4, 2, 8, dtype=torch.complex64)  # the (8, 8, 8) grid, even blocks
    with es.count_communication() as stats:
        plan = einfft(formula, x, XYZ, mesh=mesh, explain=True)
    assert stats.calls == 0
    assert plan.collectives == 2 and not plan.gathered
    with es.count_communication() as stats:
        y = einfft(formula, x.requires_grad_(), XYZ, mesh=mesh)
        fwd = stats.sent_bytes
        y.abs().sum().backward()
    assert fwd == plan.forward_bytes
    assert stats.sent_bytes - fwd == plan.backward_bytes
    # the slab/pencil lower bound: one all-to-all of the local data per transposed dimension
    local = x.numel() * x.element_size()
    assert fwd == (1 - 1 / 2) * local + (1 - 1 / 4) * local


@pytest.mark.ranks(8)
def test_warning_path(mesh_8):
    """A lone sharded axis of prime length has no all-to-all plan: gather, with a RuntimeWarning."""
    mesh = es.wrap_mesh(mesh_8)
    splits = [2, 2, 2, 2, 2, 1, 1, 1]
    x = local_block(torch.arange(13.0), "x/tp", mesh, shapes=splits)
    with pytest.warns(RuntimeWarning, match="gathers transform axis 'x'"):
        y = einfft("x/tp -> k/tp", x, {"x": "k"}, mesh=mesh, shapes=splits)
    want = local_block(torch.fft.fft(torch.arange(13.0)), "k/tp", mesh, shapes=splits)
    assert torch.allclose(y, want, atol=1e-4)
    # no warning where a four-step plan exists, nor where the output is replicated anyway
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        einfft("x/tp -> k/tp", torch.randn(8), {"x": "k"}, mesh=mesh)
        einfft("x/tp -> k", x, {"x": "k"}, mesh=mesh, shapes=splits)


@pytest.mark.ranks(8)
def test_ambient_mesh_and_shapes(mesh_8):
    """Inside shard_map (here: its ambient context) the mesh and split shapes need not be passed."""
    mesh = es.wrap_mesh(mesh_8)
    splits = (3, 1, 2, 2, 1, 4, 2, 1)
    whole = torch.randn(16, 5, dtype=torch.float64)
    x = local_block(whole, "x/tp y", mesh, shapes={"tp": list(splits)})
    token = _context.push(mesh=mesh, shapes={(("tp",), "x"): splits})
    try:
        y = einfft("x/tp y -> kx/tp ky", x, XY)
    finally:
        _context.pop(token)
    # kx is a new axis: without shapes for it, it is split with compute_split_shapes (even here)
    want = local_block(torch.fft.fftn(whole), "kx/tp ky", mesh)
    assert torch.allclose(y, want)


@pytest.mark.ranks(8)
def test_errors_before_communicating(mesh_2x4):
    """Invalid requests raise the same ValueError on every rank, before any collective."""
    mesh = es.wrap_mesh(mesh_2x4)
    x = torch.randn(4, 2, 6)
    bad = [
        ("x y/tp z // dp -> kx ky kz", XYZ, "partial"),
        ("x/dp y/tp z -> kx ky kz", {"x": "kx", "w": "kw"}, "'w'"),
        ("x/dp y/tp z -> kx y kz", XYZ, "'y'"),
        ("x/dp y/tp z -> kx ky", XYZ, "'kz'"),
    ]
    with es.count_communication() as stats:
        for formula, axes, match in bad:
            with pytest.raises(ValueError, match=match):
                einfft(formula, x, axes, mesh=mesh)
    assert stats.calls == 0
    with pytest.raises(ValueError, match="require mesh"):
        einfft("x/dp y/tp z -> kx ky kz", x, XYZ)


@pytest.mark.ranks(8)
def test_checks_catch_uneven_blocks_without_shapes(mesh_8):
    """With checks on, ranks that derived different layouts (uneven input, no shapes=) all raise."""
    mesh = es.wrap_mesh(mesh_8)
    x = local_block(torch.randn(13, 4), "x/tp y", mesh)  # blocks [1, 1, 1, 1, 1, 1, 1, 6]
    es.set_checks(True)
    try:
        with pytest.raises(ValueError, match="disagree"):
            einfft("x/tp y -> kx ky/tp", x, XY, mesh=mesh)
        y = einfft("x/tp y -> kx ky/tp", x, XY, mesh=mesh, shapes={"tp": {"x": [1] * 7 + [6]}})
    finally:
        es.set_checks(False)
    assert y.shape == (13, compute_split_shapes(4, 8)[dist.get_rank()])


@pytest.mark.ranks(8)
def test_double_backward(mesh_2x4):
    """Transposes are transitions and local transforms torch.fft: second derivatives work too."""
    mesh = es.wrap_mesh(mesh_2x4)
    whole = torch.randn(8, 8, 5, dtype=torch.float64, requires_grad=True)
    x = local_block(whole.detach(), "x/dp y/tp z", mesh).requires_grad_()
    y = einfft("x/dp y/tp z -> kx ky/dp kz/tp", x, XYZ, mesh=mesh)
    (g,) = torch.autograd.grad(y.abs().pow(2).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.pow(2).sum(), x)
    want = torch.fft.fftn(whole).abs().pow(2).sum()
    (gw,) = torch.autograd.grad(want, whole, create_graph=True)
    (hw,) = torch.autograd.grad(gw.pow(2).sum(), whole)
    torch.testing.assert_close(g, local_block(gw.detach(), "x/dp y/tp z", mesh))
    torch.testing.assert_close(h, local_block(hw, "x/dp y/tp z", mesh))


@pytest.mark.ranks(8)
def test_inside_shard_map(mesh_2x4):
    """In a shard_map body the ambient mesh and split shapes apply, and outputs carry their variance."""
    from einshard.spmd.shard_map import shard_map

    mesh = es.wrap_mesh(mesh_2x4)
    # uneven input blocks (ambient in the body); the spectrum uses the default blocks of its new axes
    splits = {"dp": {"x": [5, 3], "ky": [3, 3]}, "tp": {"y": [1, 3, 0, 2], "kz": [1, 1, 1, 2]}}
    whole = torch.randn(8, 6, 5, dtype=torch.float64, requires_grad=True)
    x = local_block(whole.detach(), "x/dp y/tp z", mesh, shapes=splits).requires_grad_()

    @shard_map("x/dp y/tp z", "kx ky/dp kz/tp", mesh=mesh, shapes=splits)
    def spectrum(block):
        return einfft("x/dp y/tp z -> kx ky/dp kz/tp", block, XYZ)  # no mesh=, no shapes=

    y = spectrum(x)
    want = torch.fft.fftn(whole)
    torch.testing.assert_close(y, local_block(want.detach(), "kx ky/dp kz/tp", mesh, shapes=splits))
    cot = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(3))
    y.backward(local_block(cot, "kx ky/dp kz/tp", mesh, shapes=splits))
    want.backward(cot)
    torch.testing.assert_close(x.grad, local_block(whole.grad, "x/dp y/tp z", mesh, shapes=splits))
