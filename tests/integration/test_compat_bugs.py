"""Bugs found by random and adversarial testing: each one pinned by a test."""

from __future__ import annotations

import re

import pytest
import torch

import einshard as es


def _caret(message: str) -> int:
    return message.splitlines()[2].index("^") - 4


# -- parsing -----------------------------------------------------------------------------


@pytest.mark.parametrize("text, position", [("a/ b -> a b", 2), ("a / sp b", 3), ("(a/\tsp b) -> a sp b", 3)])
def test_whitespace_after_slash_is_an_error_with_a_caret(text, position):
    with pytest.raises(ValueError, match="no space is allowed after '/'") as info:
        es.parse_sharding(text)
    assert _caret(str(info.value)) == position
    assert str(es.parse_sharding("a /sp b")) == "a/sp b"  # before '/' spaces are fine


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000"])
def test_unicode_space_is_the_unexpected_character(space):
    """Only spaces, tabs and newlines separate tokens; another space character is named, at its offset."""
    with pytest.raises(ValueError, match=re.escape(f"unexpected character {space!r}")) as info:
        es.parse_sharding(f"a{space}b -> a b")
    assert _caret(str(info.value)) == 1


def test_long_formulas_parse_and_reject():
    """A 10,000-character formula parses (and a broken one is rejected at the right offset)."""
    text = ", ".join(["a/sp (b c) ... d // tp"] * 420) + " -> a/sp"
    assert len(text) > 10_000
    assert len(es.parse_sharding(text).inputs) == 420
    broken = "a b " * 2500 + "$"
    with pytest.raises(ValueError, match=r"unexpected character '\$'") as info:
        es.parse_sharding(broken)
    assert _caret(str(info.value)) == len(broken) - 1
    with pytest.raises(ValueError, match="'\\(' is never closed"):
        es.parse_sharding("(" + " ".join(["x"] * 5000))



# -- zero-size axes ------------------------------------------------------------------------

# (formula over dp/sp/tp, global shapes with a zero-size axis): contracted, kept, sharded, partial
_ZERO_CASES = {
    "8": [
        ("d, c d, c/tp -> d // tp", [(0,), (2, 0), (2,)]),
        ("a/tp b, b c -> a/tp c", [(10, 0), (0, 7)]),
        ("a/tp b, b c -> a/tp c", [(0, 6), (6, 7)]),
        ("l f/tp, f/tp e -> l/tp e", [(10, 0), (0, 5)]),
        ("b n c/tp, h c/tp -> b n h // tp", [(3, 0, 10), (4, 10)]),
        ("a b -> a/tp b", [(0, 6)]),
        ("a/tp b -> a b", [(0, 3)]),
        ("... c, h/tp c -> ... h/tp", [(0, 3, 6), (10, 6)]),
    ],
    "2x4": [
        ("d, c d, c/dp -> d // dp", [(0,), (2, 0), (2,)]),
        ("a/tp b/dp, b/dp c -> a/tp c", [(10, 0), (0, 7)]),
        ("l/tp e/dp, e/tp f/dp -> l/tp f/dp", [(10, 0), (0, 9)]),
        ("a/dp b -> a/tp b", [(0, 4)]),
    ],
    "2x2x2": [
        ("a k/dp m/sp, k/sp m/dp b -> a/sp b/dp", [(5, 0, 7), (0, 7, 9)]),
        ("a/sp b/dp, b/dp c -> a/sp c", [(0, 6), (6, 7)]),
        ("b n c/tp, h c/tp -> b n h/dp-sp", [(0, 5, 6), (4, 6)]),
    ],
}


@pytest.mark.parametrize("mesh_id", ["8", "2x4", "2x2x2"])
def test_zero_size_axes_work_like_size_one(mesh_id):
    from dist_reference import MESHES, check_many

    from einshard.testing import MeshSpec, run_on_ranks

    cases = [dict(formula=f, global_shapes=s) for f, s in _ZERO_CASES[mesh_id]]
    reports = run_on_ranks(8, check_many, MeshSpec(*MESHES[mesh_id]), cases, timeout=240)
    assert len(reports) == 8


def test_zero_size_contraction_on_a_virtual_mesh():
    """The reported case: a plan that only slices runs without process groups."""
    mesh = es.Mesh.virtual((2,), ("dp",))
    out = es.einshard("d, c d, c/dp -> d // dp", torch.zeros(0), torch.zeros(2, 0), torch.zeros(1), mesh=mesh)
    assert out.shape == (0,)
    assert es.einshard("... d, ... c d -> ... c", torch.zeros(1, 0), torch.zeros(0, 2, 0)).shape == (0, 2)


# -- the same error whatever the call history ------------------------------------------------


class _HasShape:
    shape = (2, 2)
    dtype = torch.float32


@pytest.mark.parametrize("formula", ["a b, b c -> a c", "a b -> b a", "a/dp b, b c -> a/dp c"])
@pytest.mark.parametrize("bad", [[1, 2], "x", _HasShape()], ids=["list", "str", "shape-attr"])
def test_non_tensor_operand_is_always_the_same_value_error(formula, bad):
    mesh = es.Mesh.virtual((2,), ("dp",))
    good = torch.ones(2, 2)
    n = formula.split("->")[0].count(",") + 1
    for _ in range(3):  # first call, then cached plans and the known-distributed set
        if n == 2:
            es.einshard(formula, good, good, mesh=mesh)  # warm every cache for these shapes
        args = (good, bad) if n == 2 else (bad,)
        with pytest.raises(ValueError, match=f"operand {n - 1} must be a torch.Tensor, got {type(bad).__name__}"):
            es.einshard(formula, *args, mesh=mesh)
        with pytest.raises(ValueError, match="must be a torch.Tensor"):
            es.einshard(formula, *args)  # without a mesh too


def test_local_mixed_dtypes_are_a_value_error_naming_them():
    a, b = torch.ones(2, 3), torch.ones(3, 4, dtype=torch.float64)
    for _ in range(2):
        es.einshard("i j, j k -> i k", a, a.T.contiguous())  # a cached plan for these shapes
        with pytest.raises(ValueError, match=r"different dtypes \(torch.float32, torch.float64\)"):
            es.einshard("i j, j k -> i k", a, b)


# -- shapes=, mesh dimensions and the axis-name limit -------------------------------------------


@pytest.mark.parametrize(
    "shapes",
    [[1.0, 1], {"dp": [1.0, 1.0]}, {"dp": {"a": [1, 1.0]}}, [True, 1], [2**70, 1], {"dp": [1, 1 << 63]}],
    ids=["list", "dim", "axis", "bool", "huge", "huge-dim"],
)
def test_float_and_bool_split_shapes_are_rejected(shapes):
    mesh = es.Mesh.virtual((2,), ("dp",))
    with pytest.raises(ValueError, match="must hold non-negative integers"):
        es.explain("a/dp b -> a b", (1, 3), mesh=mesh, shapes=shapes)
    assert es.explain("a/dp b -> a b", (1, 3), mesh=mesh, shapes=[1, 1]) is not None


@pytest.mark.parametrize(
    "formula, position",
    [("a/xx b -> a b", 2), ("a b // xx -> a b", 7), ("a/dp-xx b -> a b", 2), ("a b // (dp, xx) -> a b", 12)],
)
def test_unknown_mesh_dimension_shows_the_expression_and_a_caret(formula, position):
    mesh = es.Mesh.virtual((2,), ("dp",))
    with pytest.raises(ValueError, match="'xx'.*is not in the mesh; it has \\['dp'\\]") as info:
        es.explain(formula, (2, 3), mesh=mesh)
    message = str(info.value)
    assert message.splitlines()[1] == "    " + formula
    assert _caret(message) == position


def test_the_axis_name_limit_names_the_expression():
    names = " ".join(f"a{i}" for i in range(53))
    formula = f"{names} -> {names}"
    with pytest.raises(ValueError, match="at most 52 distinct axis names") as info:
        es.einshard(formula, torch.ones([1] * 53))
    assert formula in str(info.value)
    assert _caret(str(info.value)) == formula.index("a52")


def test_the_known_distributed_set_is_bounded(monkeypatch):
    import sys

    entry = sys.modules["einshard.ops.einshard"]
    monkeypatch.setattr(entry, "_MAX_DISTRIBUTED", 16)
    mesh = es.Mesh.virtual((2,), ("dp",))
    for i in range(40):
        out = es.einshard(f"a/dp b{i} -> a/dp b{i}", torch.ones(1, 3), mesh=mesh)  # no communication
        assert out.shape == (1, 3)
        assert 0 < len(entry._DISTRIBUTED) <= 17


def _zero_collectives(mesh):
    """Every named collective on blocks with a zero-size axis: the shapes of size-1 blocks with that axis at 0."""
    out = {}
    ops = {
        "psum": lambda x: es.spmd.psum(x, "tp"),
        "pmean": lambda x: es.spmd.pmean(x, "tp"),
        "pmax": lambda x: es.spmd.pmax(x, "tp"),
        "pmin": lambda x: es.spmd.pmin(x, "tp"),
        "all_gather": lambda x: es.spmd.all_gather(x, "tp", axis=1),
        "psum_scatter": lambda x: es.spmd.psum_scatter(x, "tp", axis=1),
        "all_to_all": lambda x: es.spmd.all_to_all(x, "tp", 1, 0),
        "ppermute": lambda x: es.spmd.ppermute(x, "tp", [(i, (i + 1) % 4) for i in range(4)]),
    }
    for name, op in ops.items():
        for rows in (0, 1):
            x = torch.ones(rows, 4, requires_grad=True)
            y = es.shard_map(op, "a b", "a b", mesh=mesh, check_vma=False)(x)
            (g,) = torch.autograd.grad(y.sum(), x, allow_unused=True) if y.requires_grad else (None,)
            out[name, rows] = (tuple(y.shape), None if g is None else tuple(g.shape))
    return out


@pytest.mark.ranks(8)
def test_zero_size_blocks_in_named_collectives(mesh_2x4):
    result = _zero_collectives(es.wrap_mesh(mesh_2x4))
    for (name, rows), (shape, grad) in result.items():
        if rows == 0:
            one_shape, one_grad = result[name, 1]
            assert shape == (0,) + one_shape[1:], (name, shape, one_shape)
            assert grad == (None if one_grad is None else (0,) + one_grad[1:]), (name, grad, one_grad)
