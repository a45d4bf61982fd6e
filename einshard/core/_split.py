"""Split shapes: how a logical axis is cut into per-rank blocks."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence

import torch.distributed as dist

from ..errors import EinshardError

__all__ = [
    "compute_split_shapes",
    "compute_split_shapes_for_factors",
    "resolve_split_shapes",
    "canonical_mesh_dim",
    "is_size",
    "as_sizes",
    "lookup_dim",
]


def compute_split_shapes(size: int, n: int) -> list[int]:
    """Split ``size`` elements into ``n`` contiguous blocks, remainder last.

    Blocks of ``ceil(size / n)`` with the remainder in the last block; when
    that would leave the last block empty, blocks of ``floor(size / n)`` with
    the remainder added to the last one.

    >>> compute_split_shapes(10, 4)
    [3, 3, 3, 1]
    >>> compute_split_shapes(9, 4)
    [2, 2, 2, 3]
    """
    size, n = int(size), int(n)
    if n < 1:
        raise EinshardError(f"compute_split_shapes: n must be >= 1, got {n}")
    if size < 0:
        raise EinshardError(f"compute_split_shapes: size must be >= 0, got {size}")
    if n == 1:
        return [size]
    chunk = -(-size // n)
    last = size - chunk * (n - 1)
    if last > 0:
        return [chunk] * (n - 1) + [last]
    chunk = size // n
    return [chunk] * (n - 1) + [size - chunk * (n - 1)]


def compute_split_shapes_for_factors(size: int, n: int, factor: int) -> list[int]:
    """Split ``size`` into ``n`` blocks that are multiples of ``factor``.

    ``compute_split_shapes(size // factor, n)`` scaled by ``factor``; the
    ``size % factor`` leftover is added to the last block.

    >>> compute_split_shapes_for_factors(721, 4, 4)
    [180, 180, 180, 181]
    """
    factor = int(factor)
    if factor < 1:
        raise EinshardError(f"compute_split_shapes_for_factors: factor must be >= 1, got {factor}")
    shapes = [s * factor for s in compute_split_shapes(int(size) // factor, n)]
    shapes[-1] += int(size) % factor
    return shapes


def canonical_mesh_dim(name: str, order: Sequence[str] | None = None) -> str:
    """Normalise a (possibly compound) mesh dimension name.

    Components are sorted by ``order`` (the mesh's dimension order) when it is
    given, so ``"sp-dp"`` and ``"dp-sp"`` name the same group.
    """
    parts = name.split("-")
    if order is None or len(parts) == 1:
        return name
    rank = {d: i for i, d in enumerate(order)}
    return "-".join(sorted(parts, key=lambda d: rank.get(d, len(rank))))


def _group_size(group) -> int | None:
    if group is None:
        return None
    if isinstance(group, int):
        return group
    return dist.get_world_size(group)


def resolve_split_shapes(shapes, mesh_dim: str, axis_name: str, group=None) -> list[int] | None:
    """The split shapes of one axis over one mesh dimension, from any ``shapes=`` form.

    ``shapes`` may be ``None`` (returns ``None``), a list of per-rank sizes,
    ``{mesh_dim: [...]}`` or ``{mesh_dim: {axis_name: [...]}}``. ``group`` (a
    process group or an int size) checks the list length.

    >>> resolve_split_shapes({"sp": {"a": [3, 3, 4]}}, "sp", "a", group=3)
    [3, 3, 4]
    """
    if shapes is None:
        return None
    if isinstance(shapes, Mapping):
        entry = lookup_dim(shapes, mesh_dim)
        if entry is MISSING:
            raise EinshardError(
                f"shapes has no entry for mesh dimension {mesh_dim!r} (axis {axis_name!r}); "
                f"it has {sorted(shapes)}"
            )
        if isinstance(entry, Mapping):
            if axis_name not in entry:
                raise EinshardError(f"shapes[{mesh_dim!r}] has no entry for axis {axis_name!r} on mesh dimension "
                                    f"{mesh_dim!r} (missing split shapes); it has {sorted(entry)}")
            entry = entry[axis_name]
        result = as_sizes(entry, f"shapes[{mesh_dim!r}]")
    else:
        result = as_sizes(shapes, "shapes")
    size = _group_size(group)
    if size is not None and len(result) != size:
        raise EinshardError(
            f"split shapes {result} for axis {axis_name!r} over mesh dimension {mesh_dim!r} have "
            f"{len(result)} entries but the group has {size} ranks"
        )
    return result


MISSING = object()


def lookup_dim(shapes: Mapping, mesh_dim: str):
    """``shapes``' entry for ``mesh_dim`` (a compound one in any order), or ``MISSING``."""
    if mesh_dim in shapes:
        return shapes[mesh_dim]
    wanted = frozenset(mesh_dim.split("-"))
    for key, value in shapes.items():
        if isinstance(key, str) and frozenset(key.split("-")) == wanted:
            return value
    return MISSING


def is_size(v) -> bool:
    """A non-negative integer size that a tensor can have (below 2**63): an ``int`` (or int-like, e.g.
    numpy), not a ``bool`` or a ``float``.

    >>> is_size(3), is_size(3.0), is_size(True), is_size(-1), is_size(2**70)
    (True, False, False, False, False)
    """
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        return False
    return 0 <= operator.index(v) < 1 << 63


def as_sizes(value, what: str) -> list[int]:
    """``value`` as a list of per-rank sizes (any iterable of sizes, not a string); ``what`` names it in errors."""
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise EinshardError(f"{what} must be a list of per-rank sizes, got {value!r}")
        value = list(value)
    sizes = []
    for v in value:
        if not is_size(v):
            raise EinshardError(f"{what} must hold non-negative integers (below 2**63), got {list(value)!r}")
        sizes.append(operator.index(v))
    return sizes
