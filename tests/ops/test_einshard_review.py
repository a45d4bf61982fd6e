"""Adversarial review of distributed ``es.einshard``.

Two kinds of tests live here:

- **Regression tests** (pass today): the interesting cases a demanding user
  tries: factored groups with sharded factors, families, diagonals, ``...``
  with broadcasting, scalars, zero-size axes, size-1 axes over 8 ranks,
  dtypes, non-contiguous inputs, partial inputs and outputs (the documented
  contributions/pvary rule), compound dimensions with uneven ``shapes=`` in
  every form, 3 and 4 operands, cache reuse, policies, plain ``DeviceMesh``
  vs ``wrap_mesh`` vs ``use_mesh``, autograd variants, errors on every rank.
- **Bug tests** (fail today, marked in their docstrings with ``BUG``): each
  one reproduces one defect found in the review; the report lists the
  diagnosis and the suggested fix.

Multi-rank cases go through :func:`_run_cases`: every rank records the
outcome of each case and the ranks re-synchronise after each one, so a case
that raises (on every rank) does not leave the others waiting; the pytest
process then asserts on the collected outcomes.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import einshard as es
from dist_reference import check_formula
from einshard.testing import MeshSpec, local_block, run_on_ranks

MESH_8 = MeshSpec((8,), ("tp",))
MESH_2X4 = MeshSpec((2, 4), ("dp", "tp"))
MESH_2X2X2 = MeshSpec((2, 2, 2), ("dp", "sp", "tp"))


def _sync() -> None:
    flag = torch.zeros(1)
    dist.all_reduce(flag)


def _run_cases(mesh, cases):
    """``check_formula`` for each case; returns ``[(formula, error text or None)]``."""
    out = []
    for case in cases:
        try:
            check_formula(mesh, **case)
            out.append((case["formula"], None))
        except Exception as err:  # noqa: BLE001 - reported by the pytest process
            out.append((case["formula"], f"{type(err).__name__}: {err}"[:600]))
        _sync()
    return out


def _check(mesh_spec, cases, timeout=120):
    results = run_on_ranks(8, _run_cases, mesh_spec, cases, timeout=timeout)
    failures = {}
    for rank, rows in enumerate(results):
        for formula, error in rows:
            if error is not None:
                failures.setdefault(formula, f"rank {rank}: {error}")
    assert not failures, "\n".join(f"{f!r}: {e}" for f, e in failures.items())


# =====================================================================================
# Regression tests: cases that work today
# =====================================================================================

U8 = [2, 0, 3, 1, 1, 0, 2, 1]  # uneven split of 10 over dp-tp (2x4), empty blocks included

GROUPS_AND_FAMILIES = [
    # sharded outer and inner factors, groups in outputs, inference with a sharded factor
    dict(formula="(h/tp p) c -> h/tp p c", global_shapes=[(10 * 3, 2)], sizes={"p": 3}),
    dict(formula="(h p/tp) c -> h p c", global_shapes=[(3 * 10, 2)], sizes={"p": 10}),
    dict(formula="(h/tp p) c -> (h p/tp) c", global_shapes=[(8 * 8, 2)], sizes={"p": 8}),
    dict(formula="h p c -> (h/tp p) c", global_shapes=[(10, 3, 2)], sizes={"p": 3}),
    dict(formula="h p c -> (h p/tp) c", global_shapes=[(3, 10, 2)], sizes={"h": 3}),
    dict(formula="b (h/dp p/tp) -> b (p h)", global_shapes=[(2, 10 * 9)], sizes={"p": 9}),
    dict(formula="b (h/dp-tp p) -> b (h p)", global_shapes=[(2, 10 * 2)], sizes={"p": 2}),
    dict(formula="b (h/tp p) -> b (h p)", global_shapes=[(2, 10 * 2)], sizes={"h": 10}),
    dict(formula="(h/tp p) c, c d -> (p h/tp) d", global_shapes=[(10 * 3, 3), (3, 5)], sizes={"p": 3}),
    dict(formula="b (h/tp p), (h/tp p) c -> b c", global_shapes=[(2, 10 * 3), (30, 4)], sizes={"p": 3}),
    dict(formula="b (h p) -> b (h/tp p) // dp", global_shapes=[(2, 10 * 2)], sizes={"p": 2}),
    # families with sharded members, zips, family-keyed sizes
    dict(formula="b *s c, c d -> b *s d", global_shapes=[(2, 4, 5, 3), (3, 6)], families={"s": ("h/dp", "w/tp")}),
    dict(formula="b *s c -> b h w/tp c", global_shapes=[(2, 4, 5, 3)], families={"s": ("h/dp", "w")}),
    dict(formula="b *s c -> b *s", global_shapes=[(2, 4, 5, 3)], families={"s": ("h/dp", "w")}, sizes={"s": (4, 5)}),
    dict(formula="b [*s *k] c -> b h kh w kw c", global_shapes=[(2, 4 * 2, 5 * 3, 3)],
         families={"s": ("h/dp", "w/tp"), "k": ("kh", "kw")}, sizes={"kh": 2, "kw": 3}),
    dict(formula="b [*s *k] c -> b [*k *s] c", global_shapes=[(2, 4 * 2, 8 * 3, 3)],
         families={"s": ("h/dp", "w/tp"), "k": ("kh", "kw")}, sizes={"h": 4, "w": 8}),
]


def test_factored_groups_and_families_values_and_gradients():
    _check(MESH_2X4, GROUPS_AND_FAMILIES)


def _family_keyed_sizes(mesh):
    mesh = es.wrap_mesh(mesh)
    fams = {"s": ("h/dp", "w/tp"), "k": ("kh", "kw")}
    x = torch.randn(2, 4 * 2, 8 * 3, 3, generator=torch.Generator().manual_seed(0))
    xl = local_block(x, "b [*s *k] c", mesh, sizes={"kh": 2, "kw": 3}, families=fams)
    want = local_block(x.reshape(2, 4, 2, 8, 3, 3).permute(0, 1, 3, 2, 4, 5), "b h/dp w/tp kh kw c", mesh)
    ok = []
    for sizes in ({"k": (2, 3)}, {"kh": 2, "kw": 3}, {"s": (4, 8)}, {"h": 4, "w": 8}):
        y = es.einshard("b [*s *k] c -> b *s *k c", xl, mesh=mesh, families=fams, sizes=sizes)
        ok.append(torch.equal(y, want))
    return ok


@pytest.mark.ranks(8)
def test_family_keyed_sizes_match_member_sizes(mesh_2x4):
    assert all(_family_keyed_sizes(mesh_2x4))


DIAGONALS_ELLIPSIS_SCALARS = [
    dict(formula="i i b/tp -> i b/tp", global_shapes=[(3, 3, 10)]),
    dict(formula="i i b/tp -> b/dp", global_shapes=[(3, 3, 10)]),
    dict(formula="i i b/tp -> i // tp", global_shapes=[(3, 3, 10)]),
    dict(formula="i i b/tp -> // tp", global_shapes=[(3, 3, 10)]),
    dict(formula="i i b/tp, b c/dp -> i c", global_shapes=[(3, 3, 10), (10, 6)]),
    dict(formula="i i -> i // tp", global_shapes=[(3, 3)]),
    dict(formula="i i, i/tp -> ", global_shapes=[(8, 8), (8,)]),
    dict(formula="... c/tp, ... c -> ... c/dp", global_shapes=[(2, 1, 8), (3, 8)]),
    dict(formula="... c/tp, ... c -> ... // tp", global_shapes=[(2, 1, 8), (3, 8)]),
    dict(formula="a b/tp, a b -> a // tp", global_shapes=[(1, 8), (3, 8)]),
    dict(formula="... b/tp, ... c, ... -> c // tp", global_shapes=[(2, 1, 8), (3, 5), (2, 3)]),
    dict(formula="a ... b/tp -> ... a b", global_shapes=[(2, 3, 4, 10)]),
    dict(formula="a/tp b/dp -> // (dp, tp)", global_shapes=[(10, 3)]),
    dict(formula="a/tp b/dp -> // dp-tp", global_shapes=[(10, 3)]),
    dict(formula=" // tp ->", global_shapes=[()]),
    dict(formula=" -> // tp", global_shapes=[()]),
    # zero-size axes and size-1 axes over 8 ranks
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(5, 0), (0, 4)]),
    dict(formula="a b/tp, b c -> a c", global_shapes=[(0, 8), (8, 3)]),
    dict(formula="a b // tp -> a b/tp", global_shapes=[(2, 0)]),
    dict(formula="a/dp b -> a/tp b", global_shapes=[(8, 0)]),
    dict(formula="a/dp-tp b -> a b/dp-tp", global_shapes=[(1, 3)]),
    dict(formula="a b/dp-tp, b/dp-tp c -> a c/dp-tp", global_shapes=[(2, 1), (1, 1)]),
]


def test_diagonals_ellipsis_scalars_and_tiny_axes():
    _check(MESH_2X4, DIAGONALS_ELLIPSIS_SCALARS)


PARTIALS_AND_COMPOUND = [
    # partial inputs combined with contractions
    dict(formula="a b // (dp, tp), b c/tp -> a c/tp", global_shapes=[(5, 6), (6, 7)]),
    dict(formula="a b // (dp, tp), b c -> a/dp-tp c", global_shapes=[(10, 6), (6, 7)]),
    dict(formula="a b // (dp, tp), b c // tp -> a c // (dp, tp)", global_shapes=[(5, 6), (6, 7)]),
    dict(formula="a b // dp-tp, b/tp c -> a c", global_shapes=[(5, 6), (6, 7)]),
    dict(formula="a b // tp, a b // tp -> a b", global_shapes=[(5, 6), (5, 6)]),
    # outputs // d: contributions when summing or partial input, pvary otherwise
    dict(formula="a b // tp, a b -> a b // tp", global_shapes=[(5, 6), (5, 6)]),
    dict(formula="a b, a b -> a b // tp", global_shapes=[(5, 6), (5, 6)]),
    dict(formula="a b/tp, a b/tp -> a b // tp", global_shapes=[(5, 6), (5, 6)]),
    dict(formula="a b, b c -> a c // dp-tp", global_shapes=[(5, 6), (6, 7)]),
    dict(formula="a b/dp, b c -> a/tp c // dp", global_shapes=[(5, 6), (6, 7)]),
    dict(formula="a/tp b -> b // (dp, tp)", global_shapes=[(5, 6)]),
    dict(formula="a b // tp -> a b // (dp, tp)", global_shapes=[(5, 6)]),
    dict(formula="a b // (dp,tp) -> a/tp b // dp", global_shapes=[(5, 6)]),
    # compound dimensions, uneven, every dict form (compound keys in any order), list form
    dict(formula="a/tp-dp b -> a b", global_shapes=[(10, 3)], shapes={"dp-tp": U8}),
    dict(formula="a/dp-tp b -> a b", global_shapes=[(10, 3)], shapes={"tp-dp": {"a": U8}}),
    dict(formula="a/dp-tp b -> a b", global_shapes=[(10, 3)], shapes=U8),
    dict(formula="a/dp-tp b -> a/tp b", global_shapes=[(10, 3)], shapes={"dp-tp": U8}),
    dict(formula="a/dp-tp b -> a b/dp-tp", global_shapes=[(10, 9)],
         shapes={"dp-tp": {"a": U8, "b": [1, 1, 1, 1, 1, 1, 1, 2]}}),
    dict(formula="a/dp-tp b, b c -> a c/tp", global_shapes=[(10, 9), (9, 5)],
         shapes={"dp-tp": U8, "tp": [2, 0, 2, 1]}),
    dict(formula="a b/dp-tp, b/tp c -> a c/dp", global_shapes=[(4, 10), (10, 5)],
         shapes={"dp-tp": U8, "tp": [4, 0, 3, 3]}),
    dict(formula="a/dp b/tp, b/dp c/tp -> a/tp c/dp", global_shapes=[(10, 10), (10, 5)],
         shapes={"dp": {"a": [7, 3], "b": [0, 10]}, "tp": {"b": [4, 0, 3, 3], "c": [1, 1, 3, 0]}}),
    dict(formula="a b // (dp, tp) -> a/tp-dp b", global_shapes=[(10, 3)], shapes={"tp-dp": U8}),
    dict(formula="a/tp b // dp -> a/dp-tp b", global_shapes=[(10, 3)], shapes={"dp-tp": U8, "tp": [3, 3, 3, 1]}),
    dict(formula="a/dp-tp b -> b // dp", global_shapes=[(10, 3)], shapes={"dp-tp": U8}),
    # three and four operands, the same axis sharded differently in several operands
    dict(formula="a b/tp, b c/tp, c d/tp, d e/tp -> a e/tp", global_shapes=[(3, 4), (4, 5), (5, 6), (6, 10)]),
    dict(formula="a/dp b, b/tp c, c/dp d, d/tp e -> a/tp e/dp", global_shapes=[(3, 4), (4, 5), (5, 6), (6, 10)]),
    dict(formula="a b // tp, b c // dp, c d -> a d", global_shapes=[(5, 8), (8, 6), (6, 7)]),
    dict(formula="a b, b c, c d -> a d // tp", global_shapes=[(5, 8), (8, 6), (6, 7)]),
    dict(formula="a b/tp, a/tp b, a b/dp -> a/dp b/tp", global_shapes=[(5, 8), (5, 8), (5, 8)]),
    dict(formula="a/dp-tp b, a/tp b/dp -> a b", global_shapes=[(10, 9), (10, 9)]),
    dict(formula="i j/tp, j k/dp, k i -> // (dp, tp)", global_shapes=[(3, 4), (4, 5), (5, 3)]),
    dict(formula="a b c/tp, c d, d e/dp, b e -> a/tp", global_shapes=[(8, 3, 4), (4, 5), (5, 6), (3, 6)]),
    dict(formula="a/tp, b/dp, c -> a b c", global_shapes=[(3,), (4,), (5,)]),
]


def test_partials_compound_uneven_shapes_and_many_operands():
    _check(MESH_2X4, PARTIALS_AND_COMPOUND, timeout=180)


THREE_D = [
    dict(formula="a/dp b/sp, b/tp c/sp -> a/sp-tp c/dp", global_shapes=[(9, 10), (10, 7)]),
    dict(formula="a b // (dp, sp, tp) -> a/sp b/dp-tp", global_shapes=[(5, 9)]),
    dict(formula="a/dp b/sp c/tp -> a/sp b/tp c/dp", global_shapes=[(3, 4, 5)]),
    dict(formula="a b/tp, b c/dp, c d/sp, d e -> a/dp-sp e/tp", global_shapes=[(6, 4), (4, 5), (5, 6), (6, 9)]),
    dict(formula="x/dp h, h o/tp, o -> x/dp // sp", global_shapes=[(6, 5), (5, 9), (9,)]),
]


def test_three_dimensional_mesh_cases():
    _check(MESH_2X2X2, THREE_D)


def _dtypes_and_layouts(mesh):
    """bool/int/complex/bfloat16 through gathers, all-to-alls, exchanges and reductions; non-contiguous inputs."""
    mesh = es.wrap_mesh(mesh)
    bad = []
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(8, 8, generator=gen) * 4
    for dtype in (torch.bool, torch.int32, torch.complex64, torch.bfloat16):
        whole = torch.complex(base, -base).to(dtype) if dtype.is_complex else base.to(dtype)
        for formula in ("a/tp b -> a b", "a/tp b -> a b/tp", "a/dp b -> a/tp b", "a b // tp -> a/tp b",
                        "a/dp b/tp -> a/tp b/dp"):
            src, dst = (s.strip() for s in formula.split("->"))
            x = local_block(whole, src.split("//")[0], mesh)
            if "//" in src and mesh.index("tp") != 0:
                x = torch.zeros_like(x)  # contributions: rank 0 of tp holds everything
            y = es.einshard(formula, x, mesh=mesh)
            want = local_block(whole, dst, mesh)
            if y.dtype != dtype or not torch.equal(y, want):
                bad.append((str(dtype), formula))
    # non-contiguous operands (transposed storage and strided views), values and gradients
    w = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    for formula in ("a/tp b -> a b/tp", "a/dp b/tp -> a/tp b/dp", "a/tp b, b c -> a c/tp", "a b/tp, b/tp c -> a c/dp"):
        specs = [s.strip() for s in formula.split("->")[0].split(",")]
        blocks = [local_block(t, s, mesh) for t, s in zip((w, v), specs)]
        for make in (lambda b: b.t().contiguous().t(), lambda b: torch.stack([b, b], -1)[..., 0]):
            args = [make(b).requires_grad_() for b in blocks]
            assert not args[0].is_contiguous()
            y = es.einshard(formula, *args, mesh=mesh)
            whole_out = es.einshard(formula.replace("/tp", "").replace("/dp", ""), *(w, v)[: len(specs)])
            if not torch.allclose(y, local_block(whole_out, formula.split("->")[1], mesh)):
                bad.append(("noncontiguous", formula))
            y.sum().backward()
    return bad


@pytest.mark.ranks(8)
def test_dtypes_and_non_contiguous_inputs(mesh_2x4):
    assert _dtypes_and_layouts(mesh_2x4) == []


def _autograd_variants(mesh):
    mesh = es.wrap_mesh(mesh)
    gen = torch.Generator().manual_seed(3)
    X = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    W = torch.randn(6, 8, generator=gen, dtype=torch.float64)
    f = "a/tp b, b c -> a c/tp"
    out = {}
    # requires_grad on one operand only
    x = local_block(X, "a/tp b", mesh).clone()
    w = W.clone().requires_grad_()
    es.einshard(f, x, w, mesh=mesh).pow(2).sum().backward()
    Ww = W.clone().requires_grad_()
    (X @ Ww).pow(2).sum().backward()
    out["grad only w"] = torch.allclose(w.grad, Ww.grad) and x.grad is None
    # no_grad
    xg = local_block(X, "a/tp b", mesh).clone().requires_grad_()
    with torch.no_grad():
        y = es.einshard(f, xg, W, mesh=mesh)
    out["no_grad"] = not y.requires_grad and torch.allclose(y, local_block(X @ W, "a c/tp", mesh))
    # double backward through a contraction
    xg = local_block(X, "a/tp b", mesh).clone().requires_grad_()
    w = W.clone().requires_grad_()
    (gx,) = torch.autograd.grad(es.einshard(f, xg, w, mesh=mesh).pow(2).sum(), xg, create_graph=True)
    (gw,) = torch.autograd.grad(gx.pow(2).sum(), w)
    Xw, Ww = X.clone().requires_grad_(), W.clone().requires_grad_()
    (GX,) = torch.autograd.grad((Xw @ Ww).pow(2).sum(), Xw, create_graph=True)
    (GW,) = torch.autograd.grad(GX.pow(2).sum(), Ww)
    out["double backward"] = torch.allclose(gw, GW)
    # torch.func.grad through distributed einshard (forward collectives, pvary-only operands)
    for ff, xs, ws in (("a/tp b, b c -> a c/tp", "a/tp b", "b c"), ("a b/tp, b/tp c -> a c", "a b/tp", "b/tp c"),
                       ("a b, b c -> a c // tp", "a b", "b c"), ("a/tp b, b c -> a/tp c", "a/tp b", "b c")):
        xl, wl = local_block(X, xs, mesh), local_block(W, ws, mesh)

        def loss(w_, ff=ff, xl=xl):
            return es.einshard(ff, xl, w_, mesh=mesh).sum()

        gw = torch.func.grad(loss)(wl.clone())
        w2 = wl.clone().requires_grad_()
        loss(w2).backward()
        out["func.grad " + ff] = torch.allclose(gw, w2.grad)
    return out


# checks off: the 'a b/tp, b/tp c' case passes uneven blocks of b without shapes= (each rank derives
# another global size, which checks reject); the reduction is right all the same
@pytest.mark.ranks(8, checks=False)
def test_autograd_variants(mesh_2x4):
    result = _autograd_variants(mesh_2x4)
    assert all(result.values()), result


REPEATED_CALLS = [
    # the same formula again and again with other shapes, split shapes, sizes, dtypes and policies
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(10, 6), (6, 7)], shapes={"tp": {"a": [4, 0, 3, 3]}}),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(10, 6), (6, 7)], shapes={"tp": {"a": [1, 3, 3, 3]}}),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 6), (6, 7)], shapes=None),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 5), (5, 7)], shapes=None),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 5), (5, 7)], shapes=None, optimize="memory"),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 5), (5, 7)], shapes=None, optimize="latency"),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 5), (5, 7)], shapes=None, optimize="inference"),
    dict(formula="a/tp b, b c -> a c/tp", global_shapes=[(8, 5), (5, 7)], shapes=None, dtype=torch.float32, atol=1e-5),
    dict(formula="(h/tp p) c -> h/tp p c", global_shapes=[(8 * 3, 2)], sizes={"p": 3}),
    dict(formula="(h/tp p) c -> h/tp p c", global_shapes=[(8 * 3, 2)], sizes={"p": 6}),
    dict(formula="(h/tp p) c -> h/tp p c", global_shapes=[(8 * 3, 2)], sizes={"h": 8}),
    dict(formula="(h/tp p) c -> h/tp p c", global_shapes=[(8 * 3, 2)], sizes={"h": 4}),
]


def test_repeated_calls_with_other_shapes_reuse_the_right_plan():
    _check(MESH_2X4, REPEATED_CALLS)


def _mesh_forms(device_mesh):
    """A plain DeviceMesh, es.wrap_mesh and es.use_mesh give the same results (internal compound groups)."""
    wrapped = es.wrap_mesh(device_mesh)
    out = {}
    for f in ("a/dp b -> a/tp b", "a b // (dp, tp) -> a/tp b", "a/dp b/sp -> a/sp b/tp",
              "a b // (dp, sp, tp) -> a b/sp", "a/dp b/sp c/tp -> a/sp b/tp c/dp"):
        src = f.split("->")[0].split("//")[0]
        whole = torch.randn(*([8] * len(src.split())), generator=torch.Generator().manual_seed(0))
        x = local_block(whole, src, wrapped)
        y1 = es.einshard(f, x, mesh=device_mesh)
        with es.use_mesh(device_mesh):
            y2 = es.einshard(f, x)
        y3 = es.einshard(f, x, mesh=wrapped)
        out[f] = torch.equal(y1, y2) and torch.equal(y1, y3)
    return out


@pytest.mark.ranks(8)
def test_plain_device_mesh_wrap_mesh_and_use_mesh_agree(mesh_2x2x2):
    result = _mesh_forms(mesh_2x2x2)
    assert all(result.values()), result


def _argument_errors(mesh):
    mesh = es.wrap_mesh(mesh)
    x = torch.ones(4, 3)
    found = {}
    for name, call in {
        "sizes unknown axis": lambda: es.einshard("a/tp b -> a b", x, mesh=mesh, sizes={"q": 3}),
        "sizes conflict": lambda: es.einshard("a/tp b -> a b", x, mesh=mesh, sizes={"b": 4}),
        "two unknown factors": lambda: es.einshard("(h/tp p) c -> h p c", x, mesh=mesh),
        "not divisible": lambda: es.einshard("(h/tp p) c -> h p c", x, mesh=mesh, sizes={"p": 3}),
        "contracted size": lambda: es.einshard("a b, b c -> a c/tp", x, torch.ones(4, 5), mesh=mesh),
        "ellipsis rank": lambda: es.einshard("... a/tp b c -> a b c", x, mesh=mesh),
        "not a tensor": lambda: es.einshard("a/tp b, b c -> a c", x, [[1.0]], mesh=mesh),
        "output split sum": lambda: es.einshard("a b -> a/tp b", x, mesh=mesh, shapes={"tp": [1, 1, 1, 0]}),
        "negative shapes": lambda: es.einshard("a/tp b -> a b", x, mesh=mesh, shapes=[4, 4, 4, -4]),
    }.items():
        try:
            call()
            found[name] = None
        except ValueError as err:
            found[name] = str(err)
        _sync()
    return found


@pytest.mark.ranks(8)
def test_argument_errors_name_the_expression_on_every_rank(mesh_2x4):
    found = _argument_errors(mesh_2x4)
    assert all(found.values()), found
    for name, message in found.items():
        assert "'" in message and "->" in message, (name, message)  # the expression is quoted
    assert "'q'" in found["sizes unknown axis"]
    assert "'b'" in found["sizes conflict"] and "'b'" in found["contracted size"]
    assert "operand 1" in found["not a tensor"]


# =====================================================================================
# Bugs (fail today)
# =====================================================================================

BROADCAST_SHARDED = [
    # the axis is broadcast (size 1 in one plain operand) and sharded in another operand
    dict(formula="x/tp, x, x ->", global_shapes=[(8,), (8,), (1,)]),
    dict(formula="x/tp, x, x -> x/tp", global_shapes=[(8,), (8,), (1,)]),
    dict(formula="a b/tp, a b, a b -> a b", global_shapes=[(2, 16), (2, 16), (2, 1)]),
]


def test_sharded_occurrence_of_a_broadcast_axis():
    """BUG: a sharded occurrence of an axis that broadcasts elsewhere gets its *local* size as global size.

    ``resolve`` builds every occurrence of a broadcast axis with ``occ.local``,
    the sharded operand included; on 8 ranks (local size 1) the result is
    silently wrong, with larger blocks ``torch.einsum`` fails after the
    collectives ran.
    """
    _check(MESH_8, BROADCAST_SHARDED)


SIZE_ONE_AGAINST_SHARDED = [
    dict(formula="a/tp b, a b -> a b", global_shapes=[(8, 3), (1, 3)], shapes=None),
    dict(formula="a/tp b, a b -> b", global_shapes=[(8, 3), (1, 3)], shapes=None),
]


def test_size_one_operand_broadcasts_against_a_sharded_axis():
    """BUG: a size-1 dimension does not broadcast against a sharded one (torch.einsum broadcasts it).

    The plain size-1 occurrence fixes the axis' global size to 1 before the
    sharded occurrence is seen, so the split shapes become
    ``compute_split_shapes(1, 4)`` and every rank reports a bogus mismatch
    ("pass shapes= with the real split").
    """
    _check(MESH_2X4, SIZE_ONE_AGAINST_SHARDED)


UNSHARDABLE_SUM_TO_PARTIAL = [
    dict(formula="i i -> // tp", global_shapes=[(3, 3)]),
    dict(formula="i i, i/tp -> // tp", global_shapes=[(8, 8), (8,)]),
    dict(formula="... a -> a // tp", global_shapes=[(3, 4)]),
]


def test_partial_output_when_only_diagonal_or_ellipsis_axes_are_summed():
    """BUG: `// d` outputs (contributions, docs/distributed.md) fail when the summed axes are 'fixed'.

    Diagonal and ``...`` axes may not be sharded, so ``_axis_roles`` finds no
    contributing role and ``plan_contraction`` raises "nothing can be summed
    over it", although contributions exist (the replicated result on one rank
    of ``d`` and zeros elsewhere, or the diagonal taken locally first).
    """
    _check(MESH_2X4, UNSHARDABLE_SUM_TO_PARTIAL)


def test_unplannable_partial_output_error_names_the_expression():
    """BUG: the planner's ValueError lacks the expression (errors name the expression, operand and axis)."""
    mesh = es.Mesh.virtual((2, 4), ("dp", "tp"))
    for formula, shape in (("i i -> // tp", (3, 3)), ("... a -> a // tp", (3, 4))):
        try:
            es.explain(formula, shape, mesh=mesh)
        except ValueError as err:
            assert repr(formula) in str(err), str(err)


def test_shapes_naming_an_unknown_mesh_dimension_is_an_error():
    """BUG: ``shapes={"tpp": [...]}`` (a typo) is silently ignored.

    Naming a dimension the mesh lacks is a ValueError listing its
    dimensions. Ignoring the key falls back to the even-split assumption, and
    on real ranks with an uneven split the ranks then disagree and hang.
    """
    mesh = es.Mesh.virtual((4,), ("tp",))  # a slice-only plan runs without process groups
    x = torch.ones(8, 3)
    with pytest.raises(ValueError, match=r"tpp.*\['tp'\]"):
        es.einshard("a b -> a/tp b", x, mesh=mesh, shapes={"tpp": [5, 1, 1, 1]})


def test_malformed_shapes_raise_value_errors_naming_the_expression():
    """BUG: ``run_distributed`` freezes ``shapes=`` for the cache key before validating it.

    ``shapes={"tp": 2}`` is a ``TypeError`` ("'int' object is not
    iterable"), ``shapes="abcd"`` a ``ValueError`` from ``int()`` without the
    expression. ``es.explain`` (which skips the cache key) reports both well.
    """
    mesh = es.Mesh.virtual((4,), ("tp",))
    x = torch.ones(8, 3)
    for shapes in ({"tp": 2}, "abcd", {"tp": {"a": 2}}):
        with pytest.raises(ValueError, match=r"'a b -> a/tp b'.*shapes"):
            es.einshard("a b -> a/tp b", x, mesh=mesh, shapes=shapes)


def test_shapes_validation_does_not_depend_on_the_plan_cache():
    """BUG: ``freeze_shapes`` truncates floats, so a cached plan skips validation.

    ``shapes=[2.5] * 4`` is rejected on a fresh call but accepted once
    ``shapes=[2, 2, 2, 2]`` was planned (both freeze to ``(2, 2, 2, 2)``).
    """
    mesh = es.Mesh.virtual((4,), ("tp",))
    x = torch.ones(8, 5)
    es.einshard("a b -> a/tp b", x, mesh=mesh, shapes=[2, 2, 2, 2])
    with pytest.raises(ValueError, match="non-negative integers"):
        es.einshard("a b -> a/tp b", x, mesh=mesh, shapes=[2.5, 2.5, 2.5, 2.5])


@pytest.mark.parametrize("value", [2.5, -2, None])
def test_bad_sizes_values_are_value_errors(value):
    """BUG: ``sizes=`` values are not validated: 2.5 is truncated to 2 silently, -2 reaches torch
    (RuntimeError: invalid shape), ``None`` is a TypeError. Both local and distributed paths."""
    with pytest.raises(ValueError, match=r"'\(h p\) -> h p'.*'p'"):
        es.einshard("(h p) -> h p", torch.ones(6), sizes={"p": value})
    mesh = es.Mesh.virtual((4,), ("tp",))
    with pytest.raises(ValueError, match=r"'p'"):
        es.einshard("(h p) c -> h p c/tp", torch.ones(6, 4), mesh=mesh, sizes={"p": value})


def test_planning_many_operands_grows_polynomially():
    """Pairwise schedules beyond four operands are chosen greedily (was: every order, exponential).

    Measured structurally, not with a timer: the number of distinct
    contraction problems the planner prices for an ``n``-operand chain grows
    by at most ``n**2`` (the pairs) per extra operand once past four.
    """
    from einshard.plan import contraction

    mesh = es.Mesh.virtual((2, 2, 2), ("dp", "sp", "tp"))
    letters = "abcdefghij"
    priced = {}
    for n in range(5, 9):
        ops = [f"{letters[i]} {letters[i + 1]}" + ("/tp" if i == 0 else "") for i in range(n)]
        formula = ", ".join(ops) + f" -> a {letters[n]}"
        contraction.plan_contraction.cache_clear()
        contraction.plan_schedule.cache_clear()
        es.explain(formula, (8, 4), *[(8, 8)] * (n - 1), mesh=mesh)
        priced[n] = contraction.plan_contraction.cache_info().misses
    for n in range(6, 9):
        assert priced[n] - priced[n - 1] <= n * n, priced


# -- planning inefficiencies (fail today) ----------------------------------------------


def _measured_bytes(mesh, formula, whole_shape, shapes):
    mesh = es.wrap_mesh(mesh)
    whole = torch.randn(whole_shape, generator=torch.Generator().manual_seed(0))
    src = formula.split("->")[0].split("//")[0]
    x = local_block(whole, src, mesh, shapes=shapes).clone().requires_grad_()
    explained = es.explain(formula, x, mesh=mesh, shapes=shapes)
    es.einshard(formula, x, mesh=mesh, shapes=shapes)  # plan and create the groups
    with es.count_communication() as stats:
        es.einshard(formula, x, mesh=mesh, shapes=shapes)
    sent = torch.tensor([float(stats.forward.sent_bytes)], dtype=torch.float64)
    dist.all_reduce(sent)
    return explained.forward_bytes, sent.item() / dist.get_world_size()


@pytest.mark.ranks(8)
def test_uneven_all_gather_moves_what_explain_says(mesh_2x4):
    """INEFFICIENCY: uneven all-gathers pad every block to the largest, unpriced.

    ``a/tp b -> a b`` with ``shapes=[97, 1, 1, 1]``: ``explain`` promises
    19,200 B/rank, the ranks send 74,496 B/rank (3.9x): the planner picks the
    padded native all-gather although its own exchange (``all_to_all_v`` with
    exact sizes) moves exactly 19,200 B.
    """
    predicted, measured = _measured_bytes(mesh_2x4, "a/tp b -> a b", (100, 64), {"tp": [97, 1, 1, 1]})
    assert measured <= 1.1 * predicted, (predicted, measured)


def test_contributions_of_a_sharded_sum_need_no_forward_communication():
    """INEFFICIENCY: ``a/tp b -> a // tp`` all-to-alls the whole input to produce 256 bytes.

    Each rank can sum its own rows and hold them zero-padded: the sum over
    ``tp`` of those contributions is the result (forward 0 B, backward a local
    slice). The planner only knows shard->partial as an all-gather (pvary), so
    it excludes ``S a`` and all-to-alls ``a -> b``: 1,792 B/rank forward and
    backward for a 64x64 float32 input over 8 ranks, whose result is 256 B
    (the all-to-all grows with the input, the result does not).
    """
    mesh = es.Mesh.virtual((8,), ("tp",))
    plan = es.explain("a/tp b -> a // tp", (8, 64), mesh=mesh)
    assert plan.forward_bytes == 0, str(plan)
    plan = es.explain("a/tp b, b c -> a c // tp", (8, 64), (64, 64), mesh=mesh)
    assert plan.forward_bytes == 0, str(plan)
