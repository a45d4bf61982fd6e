"""Transitions: the primitive moves that turn one layout of a tensor into another.

``plan_transition(src, dst, mesh)`` returns the steps, chosen and ordered to
move the fewest bytes:

1. **slice** what becomes sharded from replicated (local, shrinks the data);
2. **reduce** what stops being partial: reduce-scatter where the result is
   sharded over the reduced dimensions, one all-reduce over the combined
   group of the rest;
3. **exchange** the remaining shard/replicate changes. The exchange is one
   general mechanism (every rank receives exactly the part of its new block
   it does not already hold, once; of several copies it reads its own, else
   one whose holder reads from it too, see :mod:`einshard.comm.exchange`); it runs
   as a local slice, an all-gather, an all-to-all, or the general exchange
   (point-to-point with the peers that have data), whichever its pattern is;
4. dimensions that become partial need nothing in forward (``pvary``).

Plans are rank-independent and cached; :func:`einshard.runtime.execute.compile_step`
binds one to a rank's coordinate and process groups. The backward of a transition is the
reverse transition (``dst -> src``), which is its exact adjoint under the
layouts' inner products.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm.primitives import PRIMITIVES, moved_numel
from ..core._cache import cached
from ..core.layout import Layout, MeshShape, coarsen_splits, grouped, interval_grid
from ..errors import EinshardError

__all__ = ["Step", "plan_transition", "plan_gradient"]


@dataclass(frozen=True)
class Step:
    """One move of a transition: ``kind`` over the mesh dimensions ``dims``.

    ``kind`` names a :data:`~einshard.comm.primitives.PRIMITIVES` entry: ``slice``,
    ``all_reduce``, ``reduce_scatter``, ``all_gather``, ``all_to_all``,
    ``exchange`` (and, for contributions, ``embed``, ``embed_adjoint``,
    ``keep_root``). ``axis`` (and ``to_axis`` for all-to-all) index the
    tensor dimensions involved.
    """

    kind: str
    src: Layout
    dst: Layout
    dims: tuple[str, ...] = ()
    axis: int = -1
    to_axis: int = -1

    @property
    def is_collective(self) -> bool:
        return PRIMITIVES[self.kind].communicates(self)

    def bytes_per_rank(self, mesh: MeshShape, itemsize: int) -> float:
        """Bytes each rank sends, averaged over the ranks."""
        return PRIMITIVES[self.kind].sent(self, mesh, itemsize)

    def describe(self) -> str:
        what = PRIMITIVES[self.kind].what
        assert what is not None, self.kind  # every step kind describes itself
        return what(self)


@cached(4096)
def plan_gradient(src: Layout, dst: Layout, mesh: MeshShape) -> tuple[Step, ...]:
    """Steps for a gradient whose layout ``dst`` is partial where ``src`` was not (a gradient duty).

    Like :func:`plan_transition`, except that a dimension becoming partial turns
    the value into real contributions (it is kept on group rank 0, zeros
    elsewhere) instead of marking a copy varying, so summing it gives it once.
    """
    fresh = dst.partial - src.partial
    if not fresh or src.essential(mesh) == dst.essential(mesh):
        return plan_transition(src, dst, mesh)
    mid = dst.with_partial(dst.partial & src.partial)
    dims = tuple(d for d in mesh.names if d in fresh)
    return plan_transition(src, mid, mesh) + (Step("keep_root", mid, dst, dims),)


@cached(8192)
def plan_transition(src: Layout, dst: Layout, mesh: MeshShape) -> tuple[Step, ...]:
    """The steps that turn ``src`` into ``dst`` (same axes, same order); none where they hold the same
    blocks (equal :meth:`~einshard.core.layout.Layout.essential` layouts: only mesh dimensions of size 1 differ)."""
    if src.axes != dst.axes or src.sizes != dst.sizes:
        raise EinshardError(f"transition between different tensors: '{src}' -> '{dst}'")
    if src.essential(mesh) == dst.essential(mesh):
        return ()
    steps: list[Step] = []
    cur = src

    # 1. slices: replicated dimensions that will shard an axis
    sliced = cur
    for i, want in enumerate(dst.shard):
        have = sliced.shard[i]
        added = [d for d in want if d not in have and sliced.placement(d) == ("R",)]
        if not added or not set(have) <= set(want):
            continue
        dims = mesh.sort(set(have) | set(added))
        want_splits = dst.splits[i]
        assert want_splits is not None  # dst shards axis i (over the added dims at least)
        splits = want_splits if dims == want else coarsen_splits(want_splits, want, dims, mesh)
        if splits is None:
            continue
        candidate = sliced.with_shard(i, dims, splits)
        if _contained(candidate, sliced, mesh):
            sliced = candidate
    if sliced != cur:
        steps.append(Step("slice", cur, sliced))
        cur = sliced

    # 2. reductions over the partial dimensions that go away
    vanish = [d for d in mesh.sort(cur.partial) if d not in dst.partial]
    for i, want in enumerate(dst.shard):
        group = [d for d in vanish if d in want]
        have = cur.shard[i]
        if not group or not set(have) <= set(want):
            continue
        dims = mesh.sort(set(have) | set(group))
        want_splits = dst.splits[i]
        assert want_splits is not None  # dst shards axis i (over the group at least)
        splits = want_splits if dims == want else coarsen_splits(want_splits, want, dims, mesh)
        if splits is None:
            continue
        candidate = cur.with_shard(i, dims, splits).with_partial(cur.partial - set(group))
        if _tiles(candidate, i, cur, i, tuple(group), mesh):  # reduce-scattering axis i gives it
            steps.append(Step("reduce_scatter", cur, candidate, tuple(group), axis=i))
            cur = candidate
            vanish = [d for d in vanish if d not in group]
    if vanish:
        reduced = cur.with_partial(cur.partial - set(vanish))
        steps.append(Step("all_reduce", cur, reduced, tuple(vanish)))
        cur = reduced

    # 3. exchange the remaining shard/replicate changes
    target = Layout(dst.axes, dst.sizes, dst.shard, dst.splits, cur.partial)
    if not cur.data_equal(target):
        steps.append(_exchange_step(cur, target, mesh))
        cur = target

    # 4. new partial dimensions: pvary, nothing to do in forward
    return tuple(steps)


def _contained(inner: Layout, outer: Layout, mesh: MeshShape) -> bool:
    """Every rank's block of ``inner`` lies inside its block of ``outer``."""
    i0, i1 = interval_grid(inner, mesh)
    o0, o1 = interval_grid(outer, mesh)
    return bool(np.all((i1 <= i0) | ((i0 >= o0) & (i1 <= o1))))


def _tiles(parts: Layout, i: int, whole: Layout, j: int, dims: tuple, mesh: MeshShape) -> bool:
    """On every group over ``dims``, the members' blocks of axis ``i`` of ``parts`` (in group
    order) tile the block of axis ``j`` of ``whole`` (which the members share)."""
    p0, p1 = interval_grid(parts, mesh)
    w0, w1 = interval_grid(whole, mesh)
    a, b = grouped(p0[i], mesh, dims), grouped(p1[i], mesh, dims)
    lo, hi = grouped(w0[j], mesh, dims), grouped(w1[j], mesh, dims)
    return bool(
        np.all(lo == lo[:, :1])
        and np.all(hi == hi[:, :1])
        and np.all(a[:, 0] == lo[:, 0])
        and np.all(a[:, 1:] == b[:, :-1])
        and np.all(b[:, -1] == hi[:, 0])
    )


def _same_elsewhere(a: Layout, b: Layout, skip: tuple, mesh: MeshShape) -> bool:
    """Every rank's blocks of ``a`` and ``b`` agree on every axis not in ``skip``."""
    a0, a1 = interval_grid(a, mesh)
    b0, b1 = interval_grid(b, mesh)
    keep = [k for k in range(len(a.axes)) if k not in skip]
    return bool(np.all(a0[keep] == b0[keep]) and np.all(a1[keep] == b1[keep]))


def _exchange_dims(cur: Layout, target: Layout, mesh: MeshShape) -> tuple[str, ...]:
    """The mesh dimensions the exchange must span."""
    changed = {d for d in mesh.names if _data_placement(cur, d) != _data_placement(target, d)}
    for i in range(len(cur.axes)):
        if (cur.shard[i], cur.splits[i]) == (target.shard[i], target.splits[i]):
            continue
        extra = (set(cur.shard[i]) | set(target.shard[i])) - changed
        if extra and not _covered(cur, target, i, changed, mesh):
            changed |= extra
    return mesh.sort(changed)


def _data_placement(layout: Layout, dim: str):
    p = layout.placement(dim)
    return ("R",) if p == ("P",) else p


def _covered(cur: Layout, target: Layout, i: int, group: set, mesh: MeshShape) -> bool:
    """The senders over ``group`` hold every rank's new block of axis ``i``."""
    varying = tuple(d for d in cur.shard[i] if d in group)
    c0, c1 = interval_grid(cur, mesh)
    t0, t1 = interval_grid(target, mesh)
    held0, held1 = grouped(c0[i], mesh, varying), grouped(c1[i], mesh, varying)
    want0, want1 = grouped(t0[i], mesh, varying), grouped(t1[i], mesh, varying)
    for row in range(held0.shape[0]):
        merged: list[list[int]] = []
        for a, b in sorted(zip(held0[row].tolist(), held1[row].tolist())):
            if b <= a:
                continue
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        for a, b in zip(want0[row].tolist(), want1[row].tolist()):
            if b > a and not any(x <= a and b <= y for x, y in merged):
                return False
    return True


def _exchange_step(cur: Layout, target: Layout, mesh: MeshShape) -> Step:
    dims = _exchange_dims(cur, target, mesh)
    if _contained(target, cur, mesh):
        return Step("slice", cur, target)
    axis = _gather_axis(cur, target, dims, mesh)
    if axis is not None:
        gather = Step("all_gather", cur, target, dims, axis=axis)
        # uneven blocks are padded to the largest; past a quarter more bytes, exchange exact sizes instead
        if gather.bytes_per_rank(mesh, 1) <= 1.25 * float(np.mean(moved_numel(cur, target, mesh))):
            return gather
        return Step("exchange", cur, target, dims)
    pair = _all_to_all_axes(cur, target, dims, mesh)
    if pair is not None:
        return Step("all_to_all", cur, target, dims, axis=pair[0], to_axis=pair[1])
    return Step("exchange", cur, target, dims)


def _gather_axis(cur: Layout, target: Layout, dims: tuple, mesh: MeshShape) -> int | None:
    """Axis ``i`` when the exchange is an all-gather of ``i`` over ``dims``."""
    owners = {cur.owner(d) for d in dims}
    if len(owners) != 1 or None in owners or any(target.owner(d) is not None for d in dims):
        return None
    (i,) = owners
    assert i is not None  # excluded above
    if _tiles(cur, i, target, i, dims, mesh) and _same_elsewhere(cur, target, (i,), mesh):
        return i
    return None


def _all_to_all_axes(cur: Layout, target: Layout, dims: tuple, mesh: MeshShape):
    """``(i, j)`` when the exchange moves the shard over ``dims`` from axis i to axis j."""
    if len(dims) != 1:
        return None
    i, j = cur.owner(dims[0]), target.owner(dims[0])
    if i is None or j is None or i == j:
        return None
    if (
        _tiles(cur, i, target, i, dims, mesh)
        and _tiles(target, j, cur, j, dims, mesh)
        and _same_elsewhere(cur, target, (i, j), mesh)
    ):
        return i, j
    return None
