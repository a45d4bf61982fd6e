"""Transitions: the primitive moves that turn one layout of a tensor into another.

``plan_transition(src, dst, mesh)`` returns the steps, chosen and ordered to
move the fewest bytes:

1. **slice** what becomes sharded from replicated (local, shrinks the data);
2. **reduce** what stops being partial: reduce-scatter where the result is
   sharded over the reduced dimensions, one all-reduce over the combined
   group of the rest;
3. **exchange** the remaining shard/replicate changes. The exchange is one
   general mechanism (every rank receives exactly the part of its new block
   it does not already hold, from the rank that holds it at the same
   coordinates on every other mesh dimension); it runs as a local slice, an
   all-gather, an all-to-all, or an all-to-all with per-rank split sizes,
   whichever its pattern is;
4. dimensions that become partial need nothing in forward (``pvary``).

Plans are rank-independent and cached; :meth:`Step.compile` binds one to a
rank's coordinate and process groups. The backward of a transition is the
reverse transition (``dst -> src``), which is its exact adjoint under the
layouts' inner products (SPEC §3).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..layout import Layout, MeshShape, coarsen_splits

__all__ = ["Step", "plan_transition", "transition_cost"]


@dataclass(frozen=True)
class Step:
    """One move of a transition: ``kind`` over the mesh dimensions ``dims``.

    ``kind`` is one of ``slice``, ``all_reduce``, ``reduce_scatter``,
    ``all_gather``, ``all_to_all``, ``exchange``. ``axis`` (and ``to_axis``
    for all-to-all) index the tensor dimensions involved.
    """

    kind: str
    src: Layout
    dst: Layout
    dims: tuple[str, ...] = ()
    axis: int = -1
    to_axis: int = -1

    @property
    def is_collective(self) -> bool:
        return self.kind != "slice"

    def bytes_per_rank(self, mesh: MeshShape, itemsize: int) -> float:
        """Bytes each rank sends, averaged over the ranks."""
        if self.kind == "slice":
            return 0.0
        if self.kind == "all_reduce":
            p = mesh.size(self.dims)
            return 2.0 * (p - 1) / p * self.src.mean_numel(mesh) * itemsize
        if self.kind == "reduce_scatter":
            p = mesh.size(self.dims)
            return (p - 1) / p * self.src.mean_numel(mesh) * itemsize
        return _moved_numel(self.src, self.dst, mesh) * itemsize

    def peak_numel(self, mesh: MeshShape) -> float:
        return self.src.mean_numel(mesh) + self.dst.mean_numel(mesh)

    def describe(self) -> str:
        names = self.src.axes
        what = {
            "slice": "local slice",
            "all_reduce": "all-reduce",
            "reduce_scatter": f"reduce-scatter along {names[self.axis]}" if self.axis >= 0 else "reduce-scatter",
            "all_gather": f"all-gather along {names[self.axis]}" if self.axis >= 0 else "all-gather",
            "all_to_all": (
                f"all-to-all {names[self.axis]} -> {names[self.to_axis]}" if self.axis >= 0 else "all-to-all"
            ),
            "exchange": "exchange (all-to-all, per-rank sizes)",
        }[self.kind]
        return what

    def compile(self, mesh):
        from ..execute import compile_step

        return compile_step(self, mesh)


def _moved_numel(src: Layout, dst: Layout, mesh: MeshShape) -> float:
    """Elements every rank must receive (needed, not held), averaged over ranks."""
    total = 0
    for coord in mesh.coords():
        need = 1
        own = 1
        for (a, b), (c, d) in zip(dst.box(coord, mesh), src.box(coord, mesh)):
            need *= b - a
            own *= max(0, min(b, d) - max(a, c))
        total += need - own
    return total / mesh.world


def transition_cost(steps, mesh: MeshShape, itemsize: int) -> tuple[float, int, float]:
    """``(bytes per rank, collective count, peak local elements)`` of a step list."""
    sent = sum(s.bytes_per_rank(mesh, itemsize) for s in steps)
    calls = sum(1 for s in steps if s.is_collective)
    peak = max((s.peak_numel(mesh) for s in steps), default=0.0)
    return sent, calls, peak


@lru_cache(maxsize=8192)
def plan_transition(src: Layout, dst: Layout, mesh: MeshShape) -> tuple[Step, ...]:
    """The steps that turn ``src`` into ``dst`` (same axes, same order)."""
    if src.axes != dst.axes or src.sizes != dst.sizes:
        raise ValueError(f"transition between different tensors: '{src}' -> '{dst}'")
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
        splits = dst.splits[i] if dims == want else coarsen_splits(dst.splits[i], want, dims, mesh)
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
        splits = dst.splits[i] if dims == want else coarsen_splits(dst.splits[i], want, dims, mesh)
        if splits is None:
            continue
        candidate = cur.with_shard(i, dims, splits).with_partial(cur.partial - set(group))
        if _scatters(cur, candidate, i, tuple(group), mesh):
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
    for coord in mesh.coords():
        for (a, b), (c, d) in zip(inner.box(coord, mesh), outer.box(coord, mesh)):
            if b > a and (a < c or b > d):
                return False
    return True


def _consecutive(intervals, whole) -> bool:
    """``intervals`` (in order) tile ``whole`` exactly."""
    start = whole[0]
    for a, b in intervals:
        if a != start:
            return False
        start = b
    return start == whole[1]


def _scatters(cur: Layout, new: Layout, i: int, dims: tuple, mesh: MeshShape) -> bool:
    """Reduce-scattering axis ``i`` over ``dims`` turns ``cur`` into ``new``."""
    for coord in mesh.coords():
        members = mesh.group_coords(dims, coord)
        whole = cur.interval(i, coord, mesh)
        if not _consecutive([new.interval(i, m, mesh) for m in members], whole):
            return False
    return True


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
    varying = [d for d in cur.shard[i] if d in group]
    for coord in mesh.coords():
        want = target.interval(i, coord, mesh)
        if want[1] <= want[0]:
            continue
        held = sorted(cur.interval(i, m, mesh) for m in mesh.group_coords(varying, coord))
        start = want[0]
        for a, b in held:
            if a <= start < b:
                start = b
        if start < want[1]:
            return False
    return True


def _exchange_step(cur: Layout, target: Layout, mesh: MeshShape) -> Step:
    dims = _exchange_dims(cur, target, mesh)
    if _contained(target, cur, mesh):
        return Step("slice", cur, target)
    axis = _gather_axis(cur, target, dims, mesh)
    if axis is not None:
        return Step("all_gather", cur, target, dims, axis=axis)
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
    for coord in mesh.coords():
        members = mesh.group_coords(dims, coord)
        if not _consecutive([cur.interval(i, m, mesh) for m in members], target.interval(i, coord, mesh)):
            return None
        for j in range(len(cur.axes)):
            if j != i and cur.interval(j, coord, mesh) != target.interval(j, coord, mesh):
                return None
    return i


def _all_to_all_axes(cur: Layout, target: Layout, dims: tuple, mesh: MeshShape):
    """``(i, j)`` when the exchange moves the shard over ``dims`` from axis i to axis j."""
    if len(dims) != 1:
        return None
    i, j = cur.owner(dims[0]), target.owner(dims[0])
    if i is None or j is None or i == j:
        return None
    for coord in mesh.coords():
        members = mesh.group_coords(dims, coord)
        if not _consecutive([cur.interval(i, m, mesh) for m in members], target.interval(i, coord, mesh)):
            return None
        if not _consecutive([target.interval(j, m, mesh) for m in members], cur.interval(j, coord, mesh)):
            return None
        for k in range(len(cur.axes)):
            if k not in (i, j) and cur.interval(k, coord, mesh) != target.interval(k, coord, mesh):
                return None
    return i, j
