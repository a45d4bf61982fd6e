"""Layouts: what every rank holds of a logical tensor.

A :class:`Layout` lists a tensor's logical axes (in local dimension order)
with their global sizes and, per axis, the mesh dimensions that shard it (in
mesh order, so a compound ``a/dp-sp`` is ``("dp", "sp")``) with the split
shapes over the flattened group. Mesh dimensions that shard nothing are
either partial (listed in ``partial``) or replicated. This is DTensor's
``Shard``/``Partial``/``Replicate`` per mesh dimension, plus uneven split
shapes and compound dimensions.

Everything here is rank-independent: a rank's block is computed from a mesh
coordinate (:meth:`Layout.box`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ._cache import cached

__all__ = ["Layout", "MeshShape", "broadcast_size", "coarsen_splits", "interval_grid", "grouped"]


def broadcast_size(a: int, b: int) -> int:
    """The size two broadcast occurrences of an axis share: a size-1 one takes the other's (even 0).

    >>> broadcast_size(1, 0), broadcast_size(5, 1), broadcast_size(1, 1)
    (0, 5, 1)
    """
    return b if a == 1 else a


@dataclass(frozen=True)
class MeshShape:
    """The rank-independent part of a mesh: dimension names and sizes."""

    names: tuple[str, ...]
    shape: tuple[int, ...]

    @classmethod
    def of(cls, mesh) -> MeshShape:
        return cls(tuple(mesh.names), tuple(mesh.shape))

    def size(self, dims: Iterable[str]) -> int:
        return math.prod(self.shape[self.names.index(d)] for d in dims)

    def sort(self, dims: Iterable[str]) -> tuple[str, ...]:
        return tuple(sorted(set(dims), key=self.names.index))

    def index(self, dims: Sequence[str], coord: Sequence[int]) -> int:
        """Flat index of ``coord`` within the group of ``dims`` (mesh order)."""
        index = 0
        for d in dims:
            i = self.names.index(d)
            index = index * self.shape[i] + coord[i]
        return index

    def coords(self) -> Iterable[tuple[int, ...]]:
        return itertools.product(*(range(s) for s in self.shape))

    def group_coords(self, dims: Sequence[str], coord: Sequence[int]) -> list[tuple[int, ...]]:
        """The coordinates of ``coord``'s group over ``dims``, in block order (``index`` order)."""
        positions = [self.names.index(d) for d in dims]
        out = []
        for values in itertools.product(*(range(self.shape[p]) for p in positions)):
            c = list(coord)
            for p, v in zip(positions, values):
                c[p] = v
            out.append(tuple(c))
        return out

    @property
    def world(self) -> int:
        return math.prod(self.shape)


def coarsen_splits(splits: Sequence[int], dims: Sequence[str], keep: Sequence[str], mesh: MeshShape):
    """Split shapes over ``keep`` when ``keep`` is an outer prefix of ``dims``.

    Returns ``None`` when the coarser blocks would not be contiguous.
    """
    keep = tuple(keep)
    if keep != tuple(dims[: len(keep)]):
        return None
    inner = mesh.size(dims[len(keep) :])
    return tuple(sum(splits[j * inner : (j + 1) * inner]) for j in range(len(splits) // inner))


@dataclass(frozen=True)
class Layout:
    """What every rank holds of one logical tensor (see the module docstring)."""

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    shard: tuple[tuple[str, ...], ...]
    splits: tuple[tuple[int, ...] | None, ...]
    partial: frozenset = frozenset()

    # -- queries ------------------------------------------------------------
    def owner(self, dim: str) -> int | None:
        """Index of the axis that ``dim`` shards, or ``None``."""
        for i, dims in enumerate(self.shard):
            if dim in dims:
                return i
        return None

    def placement(self, dim: str):
        """``("S", axis)``, ``("P",)`` or ``("R",)`` for one mesh dimension."""
        i = self.owner(dim)
        if i is not None:
            return ("S", self.axes[i])
        return ("P",) if dim in self.partial else ("R",)

    def interval(self, i: int, coord: Sequence[int], mesh: MeshShape) -> tuple[int, int]:
        dims = self.shard[i]
        if not dims:
            return (0, self.sizes[i])
        splits = self.splits[i]
        assert splits is not None  # a sharded axis has its split
        b = mesh.index(dims, coord)
        start = sum(splits[:b])
        return (start, start + splits[b])

    def box(self, coord: Sequence[int], mesh: MeshShape) -> tuple[tuple[int, int], ...]:
        return tuple(self.interval(i, coord, mesh) for i in range(len(self.axes)))

    def local_shape(self, coord: Sequence[int], mesh: MeshShape) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.box(coord, mesh))

    def mean_numel(self, mesh: MeshShape) -> float:
        """Local element count averaged over the ranks (exact for uneven splits)."""
        total = 1.0
        for i, size in enumerate(self.sizes):
            total *= size / mesh.size(self.shard[i]) if self.shard[i] else size
        return total

    # -- edits --------------------------------------------------------------
    def with_shard(self, i: int, dims: tuple[str, ...], splits) -> Layout:
        shard = list(self.shard)
        spl = list(self.splits)
        shard[i] = tuple(dims)
        spl[i] = tuple(splits) if dims else None
        return replace(self, shard=tuple(shard), splits=tuple(spl))

    def with_partial(self, partial: Iterable[str]) -> Layout:
        return replace(self, partial=frozenset(partial))

    def essential(self, mesh: MeshShape) -> Layout:
        """This layout without the mesh dimensions of size 1 (sharding or summing over one rank changes nothing).

        Two layouts with equal essentials hold the same block on every rank: a transition between them is
        the identity.

        >>> mesh = MeshShape(("one", "tp"), (1, 2))
        >>> a = Layout(("f", "c"), (4, 3), (("one",), ()), ((4,), None), frozenset({"one"}))
        >>> a.essential(mesh) == Layout(("f", "c"), (4, 3), ((), ()), (None, None))
        True
        """
        ones = {d for d, n in zip(mesh.names, mesh.shape) if n == 1}
        if not ones:
            return self
        shard = tuple(tuple(d for d in dims if d not in ones) for dims in self.shard)
        splits = tuple(s if dims else None for s, dims in zip(self.splits, shard))
        return replace(self, shard=shard, splits=splits, partial=self.partial - ones)

    def data_equal(self, other: Layout) -> bool:
        """Same blocks on every rank (partial and replicated both hold whole data)."""
        return self.shard == other.shard and self.splits == other.splits

    def __repr__(self) -> str:
        # the partial dims sorted: a frozenset of strings prints in an order that depends on PYTHONHASHSEED,
        # and plan fingerprints (compared across ranks, see einshard.comm.checks) are CRCs of this text
        partial = "frozenset({" + ", ".join(map(repr, sorted(self.partial))) + "})" if self.partial else "frozenset()"
        return (f"Layout(axes={self.axes!r}, sizes={self.sizes!r}, shard={self.shard!r}, splits={self.splits!r}, "
                f"partial={partial})")

    def __str__(self) -> str:
        parts = []
        for axis, dims in zip(self.axes, self.shard):
            parts.append(f"{axis}/{'-'.join(dims)}" if dims else axis)
        text = " ".join(parts)
        if self.partial:
            names = sorted(self.partial)
            text += " // " + (names[0] if len(names) == 1 else "(" + ", ".join(names) + ")")
        return text


@cached(16384)
def interval_grid(layout: Layout, mesh: MeshShape) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's block at once: ``(starts, stops)``, each of shape ``(len(axes),) + mesh.shape``."""
    starts = np.zeros((len(layout.axes),) + mesh.shape, dtype=np.int64)
    stops = np.empty_like(starts)
    grids = np.indices(mesh.shape, dtype=np.int64) if mesh.shape else np.zeros((0,), dtype=np.int64)
    for i, (dims, size) in enumerate(zip(layout.shard, layout.sizes)):
        if not dims:
            stops[i] = size
            continue
        block = np.zeros(mesh.shape, dtype=np.int64)
        for d in dims:
            k = mesh.names.index(d)
            block = block * mesh.shape[k] + grids[k]
        splits = np.asarray(layout.splits[i], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(splits)[:-1]])
        starts[i] = offsets[block]
        stops[i] = starts[i] + splits[block]
    starts.setflags(write=False)
    stops.setflags(write=False)
    return starts, stops


def grouped(values: np.ndarray, mesh: MeshShape, dims: Sequence[str]) -> np.ndarray:
    """``values`` (shaped like the mesh) as ``(groups, group size)``, members in block order."""
    positions = [mesh.names.index(d) for d in dims]
    moved = np.moveaxis(values, positions, list(range(values.ndim - len(positions), values.ndim)))
    return moved.reshape(-1, mesh.size(dims))
