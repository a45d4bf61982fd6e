"""einfft on one process: every mode against torch.fft, notation, errors, and plans on virtual meshes."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch

import einshard as es
from einshard.ops import fft as fft_module
from einshard.ops.fft import FFTExplanation, einfft
from einshard.plan.fft import FourStep, four_step_factors, plan_fft

NORMS = [None, "backward", "ortho", "forward"]


def _torch(x, dims, real, inverse, norm, n=None):
    if real and inverse:
        s = [x.shape[d] for d in dims[:-1]] + [n or 2 * (x.shape[dims[-1]] - 1)]
        return torch.fft.irfftn(x, s=s, dim=dims, norm=norm)
    if real:
        return torch.fft.rfftn(x, dim=dims, norm=norm)
    return (torch.fft.ifftn if inverse else torch.fft.fftn)(x, dim=dims, norm=norm)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("real, inverse", [(False, False), (False, True), (True, False), (True, True)])
def test_every_mode_and_norm_matches_torch(real, inverse, norm):
    """Values and gradients for 1, 2 and 3 transform axes, odd lengths included."""
    names = "bxyz"
    for k in (1, 2, 3):
        for chosen in itertools.permutations("xyz", k):
            shape = (2, 5, 4, 7)
            dims = [names.index(a) for a in chosen]
            n = None
            if real and inverse:
                n = shape[dims[-1]]  # odd lengths need signal_sizes
                shape = list(shape)
                shape[dims[-1]] = n // 2 + 1
            dtype = torch.complex128 if inverse else torch.float64
            x = torch.randn(shape, dtype=dtype, requires_grad=True)
            x2 = x.detach().clone().requires_grad_(True)
            axes = {a: "k" + a for a in chosen}
            out = " ".join("k" + a if a in chosen else a for a in names)
            sig = {"k" + chosen[-1]: n} if n is not None else None  # keyed by the output name
            y = einfft(f"b x y z -> {out}", x, axes, real=real, inverse=inverse, norm=norm, signal_sizes=sig)
            ordered = sorted(dims[:-1]) + [dims[-1]] if real else dims
            want = _torch(x2, ordered, real, inverse, norm, n)
            assert y.shape == want.shape and y.dtype == want.dtype
            torch.testing.assert_close(y, want)
            cot = torch.randn_like(want)
            y.backward(cot)
            want.backward(cot)
            torch.testing.assert_close(x.grad, x2.grad)


def test_renamed_and_permuted_output():
    x = torch.randn(2, 6, 5, dtype=torch.float64)
    y = einfft("b x y -> ky b kx", x, {"x": "kx", "y": "ky"})
    torch.testing.assert_close(y, torch.fft.fftn(x, dim=(1, 2)).permute(2, 0, 1))
    # an axis may keep its name, and two transform axes may swap names
    y = einfft("b x y -> y b x", x, {"x": "y", "y": "x"})  # output y is the spectrum of x
    torch.testing.assert_close(y, torch.fft.fftn(x, dim=(1, 2)).permute(1, 0, 2))
    # real: the half-spectrum axis is the last entry of axes, wherever it sits in the tensor
    y = einfft("b x y -> b kx ky", x, {"y": "ky", "x": "kx"}, real=True)
    torch.testing.assert_close(y, torch.fft.rfftn(x.transpose(1, 2), dim=(1, 2)).transpose(1, 2))
    assert y.shape == (2, 4, 5)


def test_odd_inverse_real_lengths_need_signal_sizes():
    x = torch.randn(3, 9, dtype=torch.float64)
    spec = einfft("a n -> a k", x, {"n": "k"}, real=True)
    back = einfft("a k -> a n", spec, {"k": "n"}, real=True, inverse=True, signal_sizes={"n": 9})
    torch.testing.assert_close(back, x)
    # without it, 2 * (m - 1) = 8 is inferred (as torch does)
    assert einfft("a k -> a n", spec, {"k": "n"}, real=True, inverse=True).shape == (3, 8)
    with pytest.raises(ValueError, match="L//2\\+1 == 5"):
        einfft("a k -> a n", spec, {"k": "n"}, real=True, inverse=True, signal_sizes={"n": 11})


def test_families_in_formula_axes_and_signal_sizes():
    fam = {"s": ("h", "w"), "f": ("kh", "kw")}
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    want = torch.fft.fftn(x, dim=(1, 2))
    torch.testing.assert_close(einfft("b *s -> b *f", x, {"s": "f"}, families=fam), want)
    torch.testing.assert_close(einfft("b *s -> b *f", x, {"s": ("kh", "kw")}, families=fam), want)
    torch.testing.assert_close(einfft("b *s -> b kh kw", x, {"s": ("kh", "kw")}, families=fam), want)
    spec = torch.fft.rfftn(torch.randn(2, 4, 7, dtype=torch.float64), dim=(1, 2))
    back = einfft("b *f -> b *s", spec, {"f": "s"}, families=fam, real=True, inverse=True, signal_sizes={"s": (4, 7)})
    torch.testing.assert_close(back, torch.fft.irfftn(spec, s=(4, 7), dim=(1, 2)))


def test_complex_dtypes_and_float32():
    x = torch.randn(4, 6)
    y = einfft("a b -> ka b", x, {"a": "ka"})
    assert y.dtype == torch.complex64
    torch.testing.assert_close(y, torch.fft.fft(x, dim=0))
    z = einfft("ka b -> a b", y, {"ka": "a"}, inverse=True)
    assert z.dtype == torch.complex64
    torch.testing.assert_close(z.real, x, atol=1e-5, rtol=0)


def test_double_backward():
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(einfft("a b -> ka b", x, {"a": "ka"}).abs().pow(2).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert torch.isfinite(h).all()


ERRORS = [
    ("a b // tp -> ka b", {"a": "ka"}, {}, "partial"),
    ("... a -> ... ka", {"a": "ka"}, {}, "'\\.\\.\\.'"),
    ("(a c) b -> ka b", {"a": "ka"}, {}, "factored axis '\\(a c\\)' \\(axis 'a'\\)"),
    ("a b -> ka b", {"q": "kq"}, {}, "axis 'q', which is not an input axis"),
    ("a b -> b b", {"a": "b"}, {}, "'b' already exists"),
    ("a b -> ka", {"a": "ka"}, {}, "input axis 'b' is missing"),
    ("a b -> b", {"a": "ka"}, {}, "'ka' \\(of 'a'\\) is missing"),
    ("a b -> ka b kq", {"a": "ka"}, {}, "output axis 'kq'"),
    ("a b -> a b", {"a": "ka"}, {}, "output axis 'a'"),
    ("a b -> ka kb", {"a": "k", "b": "k"}, {}, "'k' is the transform of two axes"),
    ("a b -> ka b", {}, {}, "non-empty dict"),
    ("a b -> ka b", {"a": "ka"}, {"norm": "half"}, "norm must be"),
    ("a b -> ka b", {"a": "ka"}, {"signal_sizes": {"a": 4}}, "inverse real"),
    ("a b, c -> ka b", {"a": "ka"}, {}, "one input"),
    ("a b", {"a": "ka"}, {}, "'input -> output'"),
    ("a b c -> ka b c", {"a": "ka"}, {}, "names 3 dimensions but the tensor has 2"),
]


@pytest.mark.parametrize("formula, axes, kwargs, match", ERRORS, ids=[e[3][:24] for e in ERRORS])
def test_invalid_requests_name_the_axis(formula, axes, kwargs, match):
    with pytest.raises(ValueError, match=match):
        einfft(formula, torch.randn(4, 3), axes, **kwargs)


def test_more_invalid_requests():
    with pytest.raises(ValueError, match="real input"):
        einfft("a -> k", torch.randn(4, dtype=torch.complex64), {"a": "k"}, real=True)
    with pytest.raises(ValueError, match="Invalid einshard expression"):
        einfft("a -> (k", torch.randn(4), {"a": "k"})
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        einfft("a -> k", [1.0, 2.0], {"a": "k"})
    with pytest.raises(ValueError, match="require mesh"):
        einfft("a/tp -> k/tp", torch.randn(4), {"a": "k"})
    mesh = es.Mesh.virtual((4,), ("tp",))
    with pytest.raises(ValueError, match="'sp' .*not in the mesh"):
        einfft("a/sp -> k/sp", (4,), {"a": "k"}, mesh=mesh, explain=True)


def test_plans_are_cached():
    x = torch.randn(3, 8)
    einfft("a b -> a kb", x, {"b": "kb"})
    size = len(fft_module._PLANS)
    for _ in range(3):
        einfft("a b -> a kb", x, {"b": "kb"})
    assert len(fft_module._PLANS) == size


def test_local_explain():
    plan = einfft("b x y -> b kx ky", torch.randn(2, 4, 4), {"x": "kx", "y": "ky"}, explain=True)
    assert isinstance(plan, FFTExplanation)
    assert plan.collectives == 0 and plan.forward_bytes == 0
    assert "local fftn over x, y" in str(plan)


# -- plans on virtual meshes (no process group needed) -----------------------------------------


def _explain(formula, local_shape, axes, mesh_shape, names, **kw):
    mesh = es.Mesh.virtual(mesh_shape, names)
    return einfft(formula, local_shape, axes, mesh=mesh, explain=True, **kw)


XYZ = {"x": "kx", "y": "ky", "z": "kz"}


def test_slab_and_pencil_plans_meet_the_lower_bound():
    """One all-to-all of the local data per transposed mesh dimension, and nothing else."""
    slab = _explain("x/tp y z -> kx ky/tp kz", (4, 32, 32), XYZ, (8,), ("tp",))
    local = 4 * 32 * 32 * 8  # complex64 after the first local FFT
    assert slab.collectives == 1 and slab.forward_bytes == pytest.approx(local * 7 / 8)
    assert slab.backward_bytes == slab.forward_bytes
    pencil = _explain("x/dp y/tp z -> kx ky/dp kz/tp", (16, 8, 32), XYZ, (2, 4), ("dp", "tp"))
    local = 16 * 8 * 32 * 8
    assert pencil.collectives == 2
    assert pencil.forward_bytes == pytest.approx(local * (1 / 2 + 3 / 4))
    # the same layout in and out costs one more transpose per dimension (any order of axes)
    back = _explain("x/dp y/tp z -> kx/dp ky/tp kz", (16, 8, 32), XYZ, (2, 4), ("dp", "tp"))
    assert not back.gathered and back.collectives <= 4
    assert "all-gather" not in str(back)


def test_lone_axis_uses_four_step():
    plan = _explain("x/tp -> k/tp", (8,), {"x": "k"}, (8,), ("tp",))
    assert not plan.gathered
    assert plan.collectives == 3 and all(s.kind == "four-step" for s in plan.steps)
    assert "64 = 8x8" in str(plan)
    for real, inverse in [(True, False), (True, True)]:
        shape = (4,) if inverse else (8,)  # 33 = 64 // 2 + 1 over 8 ranks: 4 x 7 + 5 (this is rank 0)
        plan = _explain("x/tp -> k/tp", shape, {"x": "k"}, (8,), ("tp",), real=real, inverse=inverse,
                        shapes=[4, 4, 4, 4, 4, 4, 4, 5] if inverse else None)
        assert not plan.gathered and "four-step" in str(plan)
    assert four_step_factors(64, 8) == [(8, 8)]
    assert four_step_factors(128, 8) == [(16, 8), (8, 16)]
    assert four_step_factors(13, 2) == []


def test_only_gather_path_warns_in_the_plan():
    plan = _explain("x/tp -> k/tp", (2,), {"x": "k"}, (8,), ("tp",), shapes=[2, 2, 2, 2, 2, 1, 1, 1])
    assert plan.gathered == ("x",)
    assert "warning: gathers transform axis x" in str(plan)
    # the output replicated over tp: gathering is what was asked for, no warning
    plan = _explain("x/tp -> k", (2,), {"x": "k"}, (8,), ("tp",), shapes=[2, 2, 2, 2, 2, 1, 1, 1])
    assert plan.gathered == ()


MESHES = [((8,), ("tp",)), ((2, 4), ("dp", "tp")), ((2, 2, 2), ("dp", "sp", "tp"))]


def test_random_layouts_never_gather_a_transform_axis():
    """Sizes that allow transposes or four-step: no warning, and all-gathers only where the output replicates."""
    rng = random.Random(0)
    for trial in range(40):
        mesh_shape, names = MESHES[trial % 3]
        k = rng.randint(1, 3)
        axes = list("xyz"[:k]) + (["b"] if rng.random() < 0.5 else [])
        transform = [a for a in axes if a != "b"]
        mapping = {a: "k" + a for a in transform}

        def place(pool):
            spec = {a: [] for a in pool}
            for d in names:
                choice = rng.choice(pool + [None])
                if choice is not None:
                    spec[choice].append(d)
            return spec

        src, out_axes = place(axes), [mapping.get(a, a) for a in axes]
        rng.shuffle(out_axes)
        dst = place(out_axes)
        left = " ".join(f"{a}/{'-'.join(src[a])}" if src[a] else a for a in axes)
        right = " ".join(f"{a}/{'-'.join(dst[a])}" if dst[a] else a for a in out_axes)
        sizes = {a: 64 for a in axes}
        mesh = es.Mesh.virtual(mesh_shape, names)
        local = tuple(sizes[a] // (mesh.size(src[a]) if src[a] else 1) for a in axes)
        real = rng.random() < 0.5
        plan = einfft(f"{left} -> {right}", local, mapping, mesh=mesh, explain=True, real=real)
        assert not plan.gathered, f"{left} -> {right}: {plan}"
        replicated_out = {d for d in names if not any(d in dst[a] for a in out_axes)}
        for step in plan.steps:
            for dims in re.findall(r"all-gather along \S+ \(([\w-]+)\)", step.what):
                assert set(dims.split("-")) <= replicated_out, f"{left} -> {right}\n{plan}"


def test_plan_is_rank_independent_and_cached():
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    a = einfft("x/dp y/tp -> kx/tp ky/dp", (8, 4), {"x": "kx", "y": "ky"}, mesh=mesh, explain=True)
    mesh2 = es.Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(1, 3))
    b = einfft("x/dp y/tp -> kx/tp ky/dp", (8, 4), {"x": "kx", "y": "ky"}, mesh=mesh2, explain=True)
    assert a.steps == b.steps
    assert plan_fft.cache_info().hits > 0


def test_four_step_layouts_are_consistent():
    """The internal layouts of a four-step transform: shard on the outer factor, then inner, then outer."""
    mesh = es.Mesh.virtual((4,), ("tp",))
    spec = fft_module._parse_cached("x/tp -> k/tp", (("x", "k"),), ())
    problem, err = fft_module._problem(spec, (8,), torch.float32, mesh, None, False, False, {})
    assert err is None
    plan = plan_fft(problem)
    (fs,) = [a for a in plan.actions if isinstance(a, FourStep)]
    assert fs.n1 * fs.n2 == 32 and min(fs.n1, fs.n2) >= 4
    assert fs.a.shard[0] == ("tp",) and fs.b.shard[1] == ("tp",) and fs.c.shard[0] == ("tp",)
    assert sum(fs.flat_d.splits[0]) == 32
