"""``einshard.plan.resolve``: one rank's shapes to layouts, against layouts written by hand.

Every case runs on a virtual mesh (no process group): 2 x 4, ``dp`` x ``tp``,
as the rank at coordinate ``(1, 2)`` (its ``tp`` block is the third).
"""

import pytest

from einshard import EinshardError, Mesh, SizeMismatchError
from einshard.core.layout import Layout
from einshard.notation import parse_sharding
from einshard.plan.resolve import ELLIPSIS_PREFIX, freeze_shapes, resolve

MESH = Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(1, 2))
TP = ("tp",)


def _resolve(formula, *shapes, **kwargs):
    return resolve(parse_sharding(formula), list(shapes), MESH, **kwargs)


def test_freeze_shapes():
    assert freeze_shapes(None) is None
    assert freeze_shapes([3, 3, 3, 1]) == (3, 3, 3, 1)
    assert freeze_shapes({"tp": [1, 2], "dp": {"a": [3, 4]}}) == ("dict", ("dp", ("dict", ("a", (3, 4)))), ("tp", (1, 2)))
    for bad in ("3,3", 3, [[1, 2]]):
        with pytest.raises(EinshardError, match="shapes="):
            freeze_shapes(bad)


def test_even_blocks_are_assumed_from_the_local_size():
    r = _resolve("a/tp b, b c -> a/tp c", (3, 5), (5, 6))
    assert r.operands == (Layout(("a", "b"), (12, 5), (TP, ()), ((3, 3, 3, 3), None)),
                          Layout(("b", "c"), (5, 6), ((), ()), (None, None)))
    assert r.output == Layout(("a", "c"), (12, 6), (TP, ()), ((3, 3, 3, 3), None))
    assert (r.in_shapes, r.out_shape, r.summed, r.fixed, r.local_error) == ((None, None), None, frozenset(),
                                                                            frozenset(), None)


def test_sizes_give_uneven_blocks():
    """``a`` of 10 over 4 ranks: blocks (3, 3, 3, 1); this rank (tp 2) holds 3."""
    r = _resolve("a/tp -> a", (3,), sizes={"a": 10})
    assert r.operands[0] == Layout(("a",), (10,), (TP,), ((3, 3, 3, 1),))
    assert r.output == Layout(("a",), (10,), ((),), (None,))
    assert r.local_error is None


def test_explicit_split_shapes():
    r = _resolve("a/tp b -> a/tp b", (3, 2), shapes={"tp": [1, 2, 3, 4]})
    assert r.operands[0].splits == ((1, 2, 3, 4), None) and r.operands[0].sizes == (10, 2)
    assert r.output.splits == ((1, 2, 3, 4), None)


def test_a_local_size_that_disagrees_is_returned_not_raised():
    """Only this rank can see it: the caller agrees on it across ranks before communicating."""
    r = _resolve("a/tp -> a", (2,), sizes={"a": 10})
    assert "operand 0 holds 2 elements of axis 'a' on this rank, but the split shapes over 'tp' are [3, 3, 3, 1]" \
        in r.local_error


def test_compound_and_partial():
    """``a/dp-tp`` splits over 8 ranks (this one is block 4 * 1 + 2 = 6); the output sums over ``tp``."""
    r = _resolve("a/dp-tp b/tp, b c -> a/dp c // tp", (2, 2), (8, 3))
    assert r.operands[0] == Layout(("a", "b"), (16, 8), (("dp", "tp"), TP), ((2,) * 8, (2, 2, 2, 2)))
    assert r.output == Layout(("a", "c"), (16, 3), (("dp",), ()), ((8, 8), None), frozenset({"tp"}))
    assert r.summed == frozenset({"tp"})  # b is summed: the partial output carries contributions


def test_groups_infer_one_factor():
    r = _resolve("(a b) -> a b", (6,), sizes={"a": 2})
    assert r.operands[0] == Layout(("a", "b"), (2, 3), ((), ()), (None, None))
    assert r.in_shapes == ((2, 3),)
    r = _resolve("a b -> (a b)", (2, 3))
    assert r.out_shape == (6,)


def test_ellipsis_and_broadcast_axes_are_fixed():
    r = _resolve("... a, a -> ... a", (4, 5, 3), (1,))
    names = (f"{ELLIPSIS_PREFIX}1", f"{ELLIPSIS_PREFIX}0")
    assert r.operands[0].axes == names + ("a",) and r.operands[0].sizes == (4, 5, 3)
    assert r.operands[1].sizes == (1,)  # the size-1 occurrence broadcasts
    assert r.output == Layout(names + ("a",), (4, 5, 3), ((), (), ()), (None, None, None))
    assert r.fixed == frozenset(names + ("a",))


@pytest.mark.parametrize("formula, shapes, kwargs, error, message", [
    ("a b, b c -> a c", [(2, 3)], {}, EinshardError, "the formula has 2 operand(s) but 1 tensor(s) were given"),
    ("a b, a c -> b c", [(2, 3), (4, 3)], {}, SizeMismatchError, "axis 'a' has global size 4 in operand 1 but 2"),
    ("(a b) -> a b", [(6,)], {}, EinshardError, "Cannot infer multiple factor sizes: 'a', 'b'"),
    ("a/sp -> a", [(2,)], {}, EinshardError, "mesh dimension 'sp' (in 'sp') is not in the mesh"),
    ("a/tp -> a", [(2,)], {"shapes": {"tp": [1, 2]}}, EinshardError, "have 2 entries but 'tp' has 4 ranks"),
])
def test_errors_name_the_expression(formula, shapes, kwargs, error, message):
    with pytest.raises(error) as info:
        resolve(parse_sharding(formula), shapes, MESH, **kwargs)
    assert message in str(info.value)
    assert info.value.expression == formula
