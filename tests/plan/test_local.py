"""Local (single-process) einshard: property tests against torch.einsum, errors, options.

The property test draws random formulas structurally (permutations,
contractions, diagonals, outer products, reductions, ``...``, several
operands, factored groups with ``sizes=``), evaluates the formula with
``es.einshard`` on grouped tensors and with ``torch.einsum`` on the expanded
ones, and compares values and gradients.
"""

from __future__ import annotations

import math
import string

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import einshard as es
from einshard.plan.local import build_local_plan
from einshard.notation import parse_sharding

# valid axis names: underscores, digits after the first character, Unicode letters
NAMES = ["a", "b", "c", "d_1", "_e", "é", "ζeta", "long_name", "x2", "Ab", "ß", "日"]


# -- random local formulas ------------------------------------------------------------


@st.composite
def local_problems(draw):
    """A random local formula with its operands and the equivalent torch.einsum."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=5, unique=True))
    size = {n: draw(st.integers(1, 4)) for n in names}
    ell_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n_operands = draw(st.integers(1, 3))
    letters = {n: string.ascii_letters[i] for i, n in enumerate(names)}

    operands = []  # per operand: (items, atomic axes with None for '...')
    for _ in range(n_operands):
        axes = draw(st.lists(st.sampled_from(names), min_size=0, max_size=len(names), unique=True))
        axes = draw(st.permutations(axes))
        # a diagonal: repeat one axis somewhere
        if axes and draw(st.booleans()) and draw(st.booleans()):
            axes.insert(draw(st.integers(0, len(axes))), draw(st.sampled_from(axes)))
        if draw(st.booleans()):
            axes.insert(draw(st.integers(0, len(axes))), None)
        # factored groups: runs of consecutive axes that occur once in this operand
        items, k = [], 0
        while k < len(axes):
            run = 0
            while (
                k + run < len(axes)
                and axes[k + run] is not None
                and axes.count(axes[k + run]) == 1
            ):
                run += 1
            if run and draw(st.booleans()):
                width = draw(st.integers(1, run))
                items.append(tuple(axes[k : k + width]))
                k += width
            else:
                items.append(axes[k])
                k += 1
        operands.append((items, axes))

    used = [n for _, axes in operands for n in axes if n is not None]
    used = list(dict.fromkeys(used))
    out_axes = draw(st.permutations(draw(st.lists(st.sampled_from(used), unique=True)) if used else []))
    any_ellipsis = any(None in axes for _, axes in operands)
    if any_ellipsis and draw(st.booleans()):
        out_axes.insert(draw(st.integers(0, len(out_axes))), None)
    out_items, k = [], 0
    while k < len(out_axes):
        if out_axes[k] is not None and draw(st.booleans()):
            width = 1
            while k + width < len(out_axes) and out_axes[k + width] is not None and draw(st.booleans()):
                width += 1
            out_items.append(tuple(out_axes[k : k + width]))
            k += width
        else:
            out_items.append(out_axes[k])
            k += 1

    # sizes=: every factor of an input group but one (randomly chosen) per group
    sizes = {}
    for items, _ in operands:
        for item in items:
            if isinstance(item, tuple) and len(item) > 1:
                skip = draw(st.sampled_from(item))
                sizes.update({n: size[n] for n in item if n != skip})
    plain = [n for items, _ in operands for n in items if isinstance(n, str)]
    if plain and draw(st.booleans()):
        extra = draw(st.sampled_from(plain))
        sizes[extra] = size[extra]
    seed = draw(st.integers(0, 2**31 - 1))
    return names, size, ell_shape, operands, out_items, out_axes, sizes, letters, seed


def _spec(items) -> str:
    parts = []
    for item in items:
        if item is None:
            parts.append("...")
        elif isinstance(item, tuple):
            parts.append("(" + " ".join(item) + ")")
        else:
            parts.append(item)
    return " ".join(parts)


def _term(axes, letters) -> str:
    return "".join("..." if n is None else letters[n] for n in axes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(local_problems())
def test_random_local_formulas_match_torch_einsum(problem):
    names, size, ell_shape, operands, out_items, out_axes, sizes, letters, seed = problem
    gen = torch.Generator().manual_seed(seed)
    formula = ", ".join(_spec(items) for items, _ in operands) + " -> " + _spec(out_items)
    equation = ",".join(_term(axes, letters) for _, axes in operands) + "->" + _term(out_axes, letters)

    atomic, grouped = [], []
    for items, axes in operands:
        shape = []
        for n in axes:
            shape.extend(ell_shape if n is None else [size[n]])
        x = torch.randn(shape, generator=gen, dtype=torch.float64)
        merged = []
        for item in items:
            if item is None:
                merged.extend(ell_shape)
            elif isinstance(item, tuple):
                merged.append(math.prod(size[n] for n in item))
            else:
                merged.append(size[item])
        atomic.append(x.requires_grad_())
        grouped.append(x.detach().reshape(merged).requires_grad_())

    expected = torch.einsum(equation, *atomic)
    out_shape = []
    for item in out_items:
        if item is None:
            out_shape.extend(ell_shape)
        elif isinstance(item, tuple):
            out_shape.append(math.prod(size[n] for n in item))
        else:
            out_shape.append(size[item])
    expected_grouped = expected.reshape(out_shape)

    got = es.einshard(formula, *grouped, sizes=sizes or None)
    assert got.shape == expected_grouped.shape, formula
    torch.testing.assert_close(got, expected_grouped, msg=lambda m: f"{formula}: {m}")

    cotangent = torch.randn(out_shape, generator=gen, dtype=torch.float64)
    want = torch.autograd.grad(expected_grouped, atomic, cotangent, allow_unused=True)
    have = torch.autograd.grad(got, grouped, cotangent, allow_unused=True)
    for i, (w, h, x) in enumerate(zip(want, have, atomic)):
        w = torch.zeros_like(x) if w is None else w
        h = torch.zeros(x.shape, dtype=x.dtype) if h is None else h.reshape(x.shape)
        torch.testing.assert_close(h, w, msg=lambda m: f"{formula}: gradient of operand {i}: {m}")

    # a second call replays the cached plan and gives the same result
    torch.testing.assert_close(es.einshard(formula, *grouped, sizes=sizes or None), got)


# -- the operations, one by one ---------------------------------------------------------


def _randn(*shape):
    return torch.randn(shape, dtype=torch.float64)


@pytest.mark.parametrize(
    "formula, equation, shapes",
    [
        ("i j, j k -> i k", "ij,jk->ik", [(3, 4), (4, 5)]),  # contraction
        ("a b c d -> d b a c", "abcd->dbac", [(2, 3, 4, 5)]),  # permutation
        ("i i -> i", "ii->i", [(4, 4)]),  # diagonal
        ("i i ->", "ii->", [(4, 4)]),  # trace
        ("a, b -> a b", "a,b->ab", [(3,), (4,)]),  # outer product
        ("a b c -> b", "abc->b", [(2, 3, 4)]),  # reduction
        ("a b c -> c a", "abc->ca", [(2, 3, 4)]),  # reduction + permutation
        ("... i j -> ... j i", "...ij->...ji", [(2, 3, 4, 5)]),  # batched transpose
        ("b ... c, c d -> b ... d", "b...c,cd->b...d", [(2, 3, 4, 5), (5, 6)]),
        ("... c -> c", "...c->c", [(2, 3, 4)]),  # ellipsis summed away
        ("a b, b c, c d -> a d", "ab,bc,cd->ad", [(2, 3), (3, 4), (4, 5)]),  # N operands
        ("a b, b c, c d, d e -> e a", "ab,bc,cd,de->ea", [(2, 3), (3, 4), (4, 5), (5, 2)]),
        ("->", "->", [()]),  # scalar
        ("a ->", "a->", [(5,)]),
        ("a b, a b -> a b", "ab,ab->ab", [(3, 4), (3, 4)]),  # elementwise
        ("a b, b -> a", "ab,b->a", [(3, 4), (1,)]),  # size-1 broadcasting, like torch.einsum
    ],
)
def test_operations_match_torch(formula, equation, shapes):
    xs = [_randn(*s) for s in shapes]
    torch.testing.assert_close(es.einshard(formula, *xs), torch.einsum(equation, *xs))


@pytest.mark.parametrize(
    "formula, equation, shapes, kind",
    [
        ("b n c, f c -> b n f", "bnc,fc->bnf", [(2, 3, 4), (5, 4)], "linear"),  # nn.Linear's weight layout
        ("f c, b n c -> b n f", "fc,bnc->bnf", [(5, 4), (2, 3, 4)], "linear"),
        ("c, f c -> f", "c,fc->f", [(4,), (5, 4)], "linear"),
        ("b c, c f -> b f", "bc,cf->bf", [(2, 4), (4, 5)], "matmul"),
        ("c f, b n c -> b n f", "cf,bnc->bnf", [(4, 5), (2, 3, 4)], "matmul"),
        ("b c, c -> b", "bc,c->b", [(2, 4), (4,)], "matmul"),
        ("c, c ->", "c,c->", [(4,), (4,)], "matmul"),
        ("b n c, f c -> b f n", "bnc,fc->bfn", [(2, 3, 4), (5, 4)], "einsum"),  # output not in product order
        ("b n c, n c -> b n", "bnc,nc->bn", [(2, 3, 4), (3, 4)], "einsum"),  # a batch axis
        ("b c, f c -> b f", "bc,fc->bf", [(2, 1), (5, 4)], "einsum"),  # the contracted axis broadcasts
        ("b c, f c -> b f", "bc,fc->bf", [(0, 4), (5, 4)], "linear"),  # zero-size rows
        ("b c, f c -> b f", "bc,fc->bf", [(2, 0), (5, 0)], "linear"),  # zero-size contraction
    ],
)
def test_matrix_products_lower_to_linear_or_matmul(formula, equation, shapes, kind):
    plan = build_local_plan(parse_sharding(formula), [tuple(s) for s in shapes])
    assert plan.contraction.kind == kind
    assert plan.contraction.fresh  # a product: a new tensor that a sum over ranks may be reduced into
    for dtype in (torch.float64, torch.complex128, torch.int64):
        xs = [_randn(*s).mul(3).to(dtype) for s in shapes]
        torch.testing.assert_close(es.einshard(formula, *xs), torch.einsum(equation, *xs))
    xs = [_randn(*s).requires_grad_() for s in shapes]
    want = torch.autograd.grad(torch.einsum(equation, *xs).square().sum(), xs)
    got = torch.autograd.grad(es.einshard(formula, *xs).square().sum(), xs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("formula, shapes", [("a b -> b a", [(2, 3)]), ("a b -> a b", [(2, 3)]),
                                             ("i i -> i", [(3, 3)]), ("a b -> a", [(2, 3)])])
def test_single_operand_results_are_not_fresh(formula, shapes):
    # views of the caller's tensor (or sums the planner never reduces into): never reduced in place
    assert not build_local_plan(parse_sharding(formula), shapes).contraction.fresh


def test_factored_split_and_merge():
    x = _randn(2, 12, 5)
    y = es.einshard("b (h p) c -> b h p c", x, sizes={"p": 4})
    assert y.shape == (2, 3, 4, 5)
    torch.testing.assert_close(y, x.reshape(2, 3, 4, 5))
    z = es.einshard("b h p c -> b (p h) c", y)
    torch.testing.assert_close(z, y.permute(0, 2, 1, 3).reshape(2, 12, 5))
    # the unknown factor may be any one of them
    torch.testing.assert_close(es.einshard("b (h p) c -> b h p c", x, sizes={"h": 3}), y)
    # a group of factors of sizes known from another operand
    w = _randn(3, 7)
    out = es.einshard("b (h p) c, h k -> b p k c", x, w, sizes={"p": 4})
    torch.testing.assert_close(out, torch.einsum("bhpc,hk->bpkc", x.reshape(2, 3, 4, 5), w))


def test_factored_contraction_inside_group():
    q = _randn(2, 8, 6)  # b n (h d)
    k = _randn(2, 5, 6)
    s = es.einshard("b n (h d), b m (h d) -> b h n m", q, k, sizes={"h": 2})
    want = torch.einsum("bnhd,bmhd->bhnm", q.reshape(2, 8, 2, 3), k.reshape(2, 5, 2, 3))
    torch.testing.assert_close(s, want)


def test_window_partition_with_families():
    x = _randn(2, 8, 12, 3)  # b (h kh) (w kw) c
    families = {"s": ("h", "w"), "w": ("kh", "kw")}
    y = es.einshard("b [*s *w] c -> b *s *w c", x, families=families, sizes={"w": (2, 3)})
    want = x.reshape(2, 4, 2, 4, 3, 3).permute(0, 1, 3, 2, 4, 5)
    assert y.shape == (2, 4, 4, 2, 3, 3)
    torch.testing.assert_close(y, want)
    back = es.einshard("b *s *w c -> b [*s *w] c", y, families=families)
    torch.testing.assert_close(back, x)
    # per-family sizes may be given for the other family instead
    torch.testing.assert_close(
        es.einshard("b [*s *w] c -> b *s *w c", x, families=families, sizes={"s": (4, 4)}), want
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3), st.integers(1, 3)), min_size=1, max_size=3),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_random_window_partitions_with_families(dims, sizes_on_window, seed):
    """``b [*s *w] c -> b *s *w c`` for 1-3 spatial dims equals reshape + permute."""
    n = len(dims)
    families = {"s": tuple(f"s_{i}" for i in range(n)), "w": tuple(f"wé{i}" for i in range(n))}
    shape = [2] + [outer * inner for outer, inner in dims] + [3]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    sizes = {"w": tuple(i for _, i in dims)} if sizes_on_window else {"s": tuple(o for o, _ in dims)}
    x.requires_grad_()
    y = es.einshard("b [*s *w] c -> b *s *w c", x, families=families, sizes=sizes)
    split = x.reshape([2] + [d for pair in dims for d in pair] + [3])
    order = [0] + [1 + 2 * i for i in range(n)] + [2 + 2 * i for i in range(n)] + [2 * n + 1]
    want = split.permute(order)
    torch.testing.assert_close(y, want)
    cot = torch.randn(want.shape, dtype=torch.float64)
    (g,) = torch.autograd.grad(y, x, cot)
    (g_want,) = torch.autograd.grad(want, x, cot)
    torch.testing.assert_close(g, g_want)
    back = es.einshard("b *s *w c -> b [*s *w] c", y, families=families)
    torch.testing.assert_close(back, x)


def test_family_entries_and_sizes_by_member():
    x = _randn(6, 4)
    families = {"sp": ["h", "w"]}
    torch.testing.assert_close(es.einshard("*sp -> w h", x, families=families), x.T)
    y = es.einshard("(h w) -> *sp", _randn(24), families=families, sizes={"sp": (6, 4)})
    assert y.shape == (6, 4)
    y = es.einshard("(h w) -> *sp", _randn(24), families=families, sizes={"h": 6})
    assert y.shape == (6, 4)
    with pytest.raises(ValueError, match="one size per member"):
        es.einshard("(h w) -> *sp", _randn(24), families=families, sizes={"sp": 6})


def test_plan_cache_distinguishes_shapes_and_sizes():
    x = _randn(2, 12)
    assert es.einshard("b (h p) -> b h p", x, sizes={"p": 4}).shape == (2, 3, 4)
    assert es.einshard("b (h p) -> b h p", x, sizes={"p": 3}).shape == (2, 4, 3)
    assert es.einshard("b (h p) -> b h p", _randn(2, 8), sizes={"p": 4}).shape == (2, 2, 4)
    parsed = es.parse_sharding("b (h p) -> b h p")
    assert es.parse_sharding("b (h p) -> b h p") is parsed


def test_double_backward():
    a, b = _randn(3, 4).requires_grad_(), _randn(4, 2).requires_grad_()
    out = es.einshard("i j, j k -> i k", a, b)
    (ga,) = torch.autograd.grad(out.pow(2).sum(), a, create_graph=True)
    (gb,) = torch.autograd.grad(ga.sum(), b)
    a2, b2 = a.detach().requires_grad_(), b.detach().requires_grad_()
    (ga2,) = torch.autograd.grad((a2 @ b2).pow(2).sum(), a2, create_graph=True)
    (gb2,) = torch.autograd.grad(ga2.sum(), b2)
    torch.testing.assert_close(gb, gb2)


# -- malformed inputs --------------------------------------------------------------------


@pytest.mark.parametrize(
    "formula, tensors, kwargs, reason",
    [
        ("(a b -> a b", [(6,)], {}, "never closed"),  # unbalanced parentheses
        ("a b) -> a b", [(2, 3)], {}, "no matching '('"),
        ("... a ... -> a", [(2, 3)], {}, "at most one '...'"),  # two ellipses
        ("(a (b c)) -> a b c", [(8,)], {}, "cannot be nested"),  # nested groups
        ("*s c -> c", [(2, 3, 4)], {"families": {"t": ("h", "w")}}, "unknown family 's'"),
        ("[*s *w] -> *s *w", [(4, 4)], {"families": {"s": ("h", "w"), "w": ("kh",)}}, "equal lengths"),
        ("a b, b c -> a c", [(2, 3)], {}, "2 operand(s) but 1 tensor(s)"),  # operand count
        ("a b -> b a", [(2, 3), (3,)], {}, "1 operand(s) but 2 tensor(s)"),
        ("a b c -> a", [(2, 3)], {}, "names 3 dimensions but the tensor has 2"),  # rank mismatch
        ("a b ... c -> a", [(2, 3)], {}, "besides '...'"),
        ("(a b) c -> a b c", [(6, 2)], {}, "Cannot infer multiple factor sizes: 'a', 'b'"),  # uninferable
        ("(a b) -> a b", [(7,)], {"sizes": {"b": 2}}, "cannot be factored"),
        ("(a b) -> a b", [(6,)], {"sizes": {"a": 2, "b": 2}}, "but a=2 * b=2 = 4"),
        ("a b, b c -> a c", [(2, 3), (4, 5)], {}, "axis 'b' has size 4"),
        ("a -> a", [(3,)], {"sizes": {"a": 4}}, "sizes= says 4"),
        ("a -> a", [(3,)], {"sizes": {"z": 4}}, "not in the formula"),
        ("*s -> *s", [(3,)], {"families": {"s": ("h",)}, "sizes": {"s": (1, 2)}}, "has 2 entries"),
        ("a -> b", [(3,)], {}, "Output dimension 'b' does not appear"),
        ("a b -> a a", [(3, 3)], {}, "appears more than once in the output"),
        ("a -> ...", [(3,)], {}, "no input has"),
        ("a b", [(3, 3)], {}, "needs a formula 'inputs -> output'"),
        ("a -> a", [[1.0, 2.0]], {}, "must be a torch.Tensor"),
    ],
)
def test_malformed_inputs(formula, tensors, kwargs, reason):
    args = [_randn(*t) if isinstance(t, tuple) else t for t in tensors]
    with pytest.raises(ValueError) as info:
        es.einshard(formula, *args, **kwargs)
    message = str(info.value)
    assert formula in message
    assert reason in message


def test_syntax_errors_point_at_the_position():
    with pytest.raises(ValueError) as info:
        es.einshard("b (h p -> b h p", _randn(2, 8), sizes={"p": 4})
    lines = str(info.value).splitlines()
    assert lines[0].startswith("Invalid einshard expression")
    assert lines[1].strip() == "b (h p -> b h p"
    assert lines[2].index("^") - lines[1].index("b") == 2  # under the unclosed '('


def test_distributed_formula_without_mesh():
    with pytest.raises(ValueError, match=r"Distributed einshard operations require mesh=\.\.\."):
        es.einshard("a/tp b -> a b", _randn(2, 3))


# -- optimize= and policy= ----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["training", "inference", "memory", "communication", "latency"])
def test_optimize_modes_accepted_locally(mode):
    x, w = _randn(3, 4), _randn(4, 5)
    torch.testing.assert_close(es.einshard("i j, j k -> i k", x, w, optimize=mode), x @ w)
    policy = es.PlanPolicy.from_mode(mode)
    torch.testing.assert_close(es.einshard("i j, j k -> i k", x, w, policy=policy), x @ w)
    with es.optimize(mode):
        torch.testing.assert_close(es.einshard("i j, j k -> i k", x, w), x @ w)


def test_optimize_and_policy_are_exclusive():
    x = _randn(3)
    es.einshard("a -> a", x)  # a cached plan must not skip the checks
    with pytest.raises(ValueError, match="either optimize or policy"):
        es.einshard("a -> a", x, optimize="training", policy=es.PlanPolicy())
    with pytest.raises(ValueError, match="unknown optimize mode 'fastest'"):
        es.einshard("a -> a", x, optimize="fastest")
    with pytest.raises(ValueError, match="PlanPolicy"):
        es.einshard("a -> a", x, policy="training")
    with pytest.raises(ValueError, match="unknown optimize mode"):
        es.PlanPolicy.from_mode("fastest")


def test_default_policy_precedence():
    from einshard.core.policy import resolve_policy

    try:
        es.set_default_policy("latency")
        assert resolve_policy().name == "latency"
        with es.optimize("memory"):
            assert resolve_policy().name == "memory"
            assert resolve_policy(optimize="inference").name == "inference"
            custom = es.PlanPolicy("custom", collective_weight=1.0)
            assert resolve_policy(policy=custom) is custom
        es.set_default_policy(None)
        assert resolve_policy().name == "training"
    finally:
        es.set_default_policy(None)


# -- torch_einshard ---------------------------------------------------------------------------
# torch_einshard is torch-einshard 1.0's namespace, a module of its own: tests/integration/test_torch_einshard_compat.py


# -- the examples ----------------------------------------------------------------------------


def test_local_example_runs(capsys, monkeypatch):
    import pathlib
    import runpy

    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "local_einshard.py"
    monkeypatch.setattr("sys.argv", [str(path)])  # the script reads its options (--device), not pytest's
    runpy.run_path(str(path), run_name="__main__")
    assert "local einshard example: ok" in capsys.readouterr().out
