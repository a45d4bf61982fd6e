"""``einshard.core.layout``: mesh shapes, layouts and every rank's block, against hand-computed blocks.

The layouts here are small enough to write each rank's block down by hand: a
2 x 2 mesh (``dp`` x ``tp``, rank ``2 * dp + tp``) and an axis of 7 split over
both dimensions as ``(2, 2, 2, 1)`` (block ``2 * dp + tp``: rows 0-1, 2-3, 4-5, 6).
"""

import numpy as np
import pytest

from einshard.core.layout import Layout, MeshShape, broadcast_size, coarsen_splits, grouped, interval_grid

MESH = MeshShape(("dp", "tp"), (2, 2))
#: ``a`` (7) split over dp-tp as (2, 2, 2, 1); ``b`` (4) whole
A_OVER_BOTH = Layout(("a", "b"), (7, 4), (("dp", "tp"), ()), ((2, 2, 2, 1), None))
#: the hand-written block of every coordinate: ((a start, a stop), (b start, b stop))
BLOCKS = {(0, 0): ((0, 2), (0, 4)), (0, 1): ((2, 4), (0, 4)), (1, 0): ((4, 6), (0, 4)), (1, 1): ((6, 7), (0, 4))}


def test_broadcast_size():
    assert [broadcast_size(1, 0), broadcast_size(5, 1), broadcast_size(1, 1), broadcast_size(3, 3)] == [0, 5, 1, 3]


def test_mesh_shape_sizes_order_and_indices():
    mesh = MeshShape(("dp", "tp"), (2, 3))
    assert (mesh.size(("dp", "tp")), mesh.size(("tp",)), mesh.size(()), mesh.world) == (6, 3, 1, 6)
    assert mesh.sort(["tp", "dp", "tp"]) == ("dp", "tp")
    # flat index in the group, the first dimension listed outermost
    assert mesh.index(("dp", "tp"), (1, 0)) == 3
    assert mesh.index(("tp", "dp"), (1, 0)) == 1
    assert mesh.index(("tp",), (1, 2)) == 2
    assert list(mesh.coords()) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    assert mesh.group_coords(("tp",), (1, 0)) == [(1, 0), (1, 1), (1, 2)]
    assert mesh.group_coords(("dp",), (0, 2)) == [(0, 2), (1, 2)]
    assert mesh.group_coords((), (1, 1)) == [(1, 1)]


def test_coarsen_splits_sums_inner_blocks_or_refuses_a_non_prefix():
    assert coarsen_splits((2, 2, 2, 1), ("dp", "tp"), ("dp",), MESH) == (4, 3)
    assert coarsen_splits((2, 2, 2, 1), ("dp", "tp"), ("dp", "tp"), MESH) == (2, 2, 2, 1)
    assert coarsen_splits((2, 2, 2, 1), ("dp", "tp"), (), MESH) == (7,)
    assert coarsen_splits((2, 2, 2, 1), ("dp", "tp"), ("tp",), MESH) is None  # blocks of tp are not contiguous


@pytest.mark.parametrize("coord", sorted(BLOCKS))
def test_every_rank_block_by_hand(coord):
    assert A_OVER_BOTH.box(coord, MESH) == BLOCKS[coord]
    assert A_OVER_BOTH.interval(0, coord, MESH) == BLOCKS[coord][0]
    assert A_OVER_BOTH.local_shape(coord, MESH) == tuple(b - a for a, b in BLOCKS[coord])


def test_reversed_compound_order_reorders_blocks():
    """``a/tp-dp`` numbers blocks ``2 * tp + dp``: rank (0, 1) holds the third block."""
    layout = Layout(("a",), (7,), (("tp", "dp"),), ((2, 2, 2, 1),))
    assert [layout.interval(0, c, MESH) for c in [(0, 0), (1, 0), (0, 1), (1, 1)]] == [(0, 2), (2, 4), (4, 6), (6, 7)]


def test_interval_grid_matches_every_box():
    starts, stops = interval_grid(A_OVER_BOTH, MESH)
    assert starts.shape == stops.shape == (2, 2, 2)
    for coord, box in BLOCKS.items():
        assert [(int(starts[(i, *coord)]), int(stops[(i, *coord)])) for i in range(2)] == list(box)
    with pytest.raises(ValueError):
        starts[0, 0, 0] = 1  # cached: read-only


def test_queries_placements_and_mean_numel():
    layout = A_OVER_BOTH.with_partial({"tp"})
    assert (A_OVER_BOTH.owner("dp"), A_OVER_BOTH.owner("tp"), A_OVER_BOTH.owner("sp")) == (0, 0, None)
    whole_b = Layout(("a", "b"), (7, 4), ((), ("tp",)), (None, (2, 2)), frozenset({"dp"}))
    assert (whole_b.placement("tp"), whole_b.placement("dp")) == (("S", "b"), ("P",))
    assert Layout(("a",), (7,), ((),), (None,)).placement("dp") == ("R",)
    assert layout.partial == frozenset({"tp"}) and A_OVER_BOTH.partial == frozenset()
    assert A_OVER_BOTH.mean_numel(MESH) == 7 / 4 * 4
    assert whole_b.mean_numel(MESH) == 7 * 4 / 2


def test_edits_return_new_layouts():
    moved = A_OVER_BOTH.with_shard(0, (), None).with_shard(1, ("tp",), [2, 2])
    assert moved == Layout(("a", "b"), (7, 4), ((), ("tp",)), (None, (2, 2)))
    assert A_OVER_BOTH.shard == (("dp", "tp"), ())  # unchanged
    assert moved.data_equal(moved.with_partial({"dp"})) and not moved.data_equal(A_OVER_BOTH)


def test_essential_drops_size_one_dimensions():
    mesh = MeshShape(("one", "tp"), (1, 2))
    layout = Layout(("f", "c"), (4, 3), (("one", "tp"), ()), ((2, 2), None), frozenset({"one"}))
    assert layout.essential(mesh) == Layout(("f", "c"), (4, 3), (("tp",), ()), ((2, 2), None))
    assert A_OVER_BOTH.essential(MESH) is A_OVER_BOTH


def test_text_forms():
    assert str(A_OVER_BOTH) == "a/dp-tp b"
    assert str(A_OVER_BOTH.with_shard(0, (), None).with_partial({"tp"})) == "a b // tp"
    assert str(A_OVER_BOTH.with_shard(0, (), None).with_partial({"tp", "dp"})) == "a b // (dp, tp)"
    # partial dims sorted, so the text (and the plan fingerprints made from it) is the same in every process
    assert repr(A_OVER_BOTH.with_partial({"tp", "dp"})).endswith("partial=frozenset({'dp', 'tp'}))")


def test_grouped_lists_groups_in_block_order():
    values = np.arange(4).reshape(2, 2)  # the rank numbers on the 2 x 2 mesh
    assert grouped(values, MESH, ("dp",)).tolist() == [[0, 2], [1, 3]]
    assert grouped(values, MESH, ("tp",)).tolist() == [[0, 1], [2, 3]]
    assert grouped(values, MESH, ("tp", "dp")).tolist() == [[0, 2, 1, 3]]
