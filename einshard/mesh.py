"""Meshes: named mesh dimensions, compound groups and the ambient mesh.

A :class:`Mesh` wraps a ``torch.distributed.device_mesh.DeviceMesh``. Besides
the mesh's own dimensions it resolves *compound* dimensions such as
``"dp-sp"``: the group spanning ``dp`` and ``sp`` for every fixed coordinate of
the other dimensions, ranks ordered by the mesh's own dimension order (so
``"dp-sp"`` and ``"sp-dp"`` are the same group). Compound groups are created
lazily, once, and cached on the wrapper.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence

from . import _context

__all__ = ["Mesh", "wrap_mesh", "use_mesh", "current_mesh", "resolve_mesh"]

_MESH_REQUIRED = "Distributed einshard operations require mesh=..."


class Mesh:
    """A device mesh with named (and compound) dimensions.

    Build it with :func:`wrap_mesh`. ``Mesh.virtual`` builds one without
    process groups (for planning, ``explain`` and tests).

    >>> m = Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(1, 2))
    >>> m.size("dp-tp"), m.index("tp-dp")
    (8, 6)
    """

    __slots__ = (
        "device_mesh",
        "names",
        "shape",
        "coordinate",
        "allow_compound",
        "_groups",
        "_dims_cache",
        "_rank_grid",
        "__weakref__",
    )

    def __init__(
        self,
        device_mesh,
        *,
        names: Sequence[str],
        shape: Sequence[int],
        coordinate: Sequence[int],
        allow_compound: bool = True,
        rank_grid=None,
    ):
        self.device_mesh = device_mesh
        self.names = tuple(names)
        self.shape = tuple(int(s) for s in shape)
        self.coordinate = tuple(int(c) for c in coordinate)
        self.allow_compound = allow_compound
        self._groups: dict[tuple[str, ...], object] = {}
        self._dims_cache: dict[str, tuple[str, ...]] = {}
        self._rank_grid = rank_grid

    # -- construction -----------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh, *, allow_compound: bool = True) -> "Mesh":
        names = device_mesh.mesh_dim_names
        if not names:
            raise ValueError(
                "einshard needs a DeviceMesh with mesh_dim_names, e.g. "
                "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp'))"
            )
        coordinate = device_mesh.get_coordinate()
        if coordinate is None:
            raise ValueError("this rank is not part of the given DeviceMesh")
        return cls(
            device_mesh,
            names=names,
            shape=tuple(device_mesh.mesh.shape),
            coordinate=coordinate,
            allow_compound=allow_compound,
            rank_grid=device_mesh.mesh,
        )

    @classmethod
    def virtual(cls, shape: Sequence[int], names: Sequence[str], coordinate: Sequence[int] | None = None) -> "Mesh":
        """A mesh without process groups: enough to plan and explain."""
        shape = tuple(shape)
        if coordinate is None:
            coordinate = (0,) * len(shape)
        if len(names) != len(shape) or len(coordinate) != len(shape):
            raise ValueError("virtual mesh: shape, names and coordinate must have the same length")
        return cls(None, names=names, shape=shape, coordinate=coordinate)

    # -- dimensions -------------------------------------------------------
    def dims(self, name: str) -> tuple[str, ...]:
        """The atomic dimensions of ``name`` (``"sp-dp"`` → ``("dp", "sp")``), in mesh order."""
        cached = self._dims_cache.get(name)
        if cached is not None:
            return cached
        parts = name.split("-")
        if any(p == "" for p in parts):
            raise ValueError(f"mesh dimension {name!r} has an empty component; the mesh has {list(self.names)}")
        if len(set(parts)) != len(parts):
            raise ValueError(f"mesh dimension {name!r} repeats a component; the mesh has {list(self.names)}")
        unknown = [p for p in parts if p not in self.names]
        if unknown:
            raise ValueError(
                f"mesh dimension {unknown[0]!r} (in {name!r}) is not in the mesh; it has {list(self.names)}"
            )
        if len(parts) > 1 and not self.allow_compound:
            raise ValueError(
                f"compound mesh dimension {name!r} needs a wrapped mesh: pass es.wrap_mesh(device_mesh)"
            )
        dims = tuple(sorted(parts, key=self.names.index))
        self._dims_cache[name] = dims
        return dims

    def label(self, dims: Sequence[str]) -> str:
        """The canonical name of a set of atomic dimensions (mesh order, ``-`` joined)."""
        return "-".join(sorted(dims, key=self.names.index))

    def size(self, name: str | Sequence[str]) -> int:
        dims = self.dims(name) if isinstance(name, str) else name
        return math.prod(self.shape[self.names.index(d)] for d in dims)

    def index(self, name: str | Sequence[str], coordinate: Sequence[int] | None = None) -> int:
        """This rank's index in the group of ``name`` (mesh-order flattening)."""
        dims = self.dims(name) if isinstance(name, str) else name
        coordinate = self.coordinate if coordinate is None else coordinate
        index = 0
        for d in dims:
            i = self.names.index(d)
            index = index * self.shape[i] + coordinate[i]
        return index

    def rank_of(self, coordinate: Sequence[int]) -> int:
        """The global rank at ``coordinate``."""
        if self._rank_grid is None:
            raise ValueError("a virtual mesh has no ranks")
        return int(self._rank_grid[tuple(coordinate)])

    # -- groups -----------------------------------------------------------
    def group(self, name: str | Sequence[str]):
        """The process group of a (compound) dimension, created once and cached."""
        if isinstance(name, str):
            dims = self.dims(name)
        else:
            # library-internal form (any mesh, wrapped or not): put the atomic
            # dimensions in mesh order so ("tp", "dp") and ("dp", "tp") share a group
            dims = tuple(name)
            if all(d in self.names for d in dims):
                dims = tuple(sorted(set(dims), key=self.names.index))
        group = self._groups.get(dims)
        if group is not None:
            return group
        if self.device_mesh is None:
            raise ValueError("a virtual mesh has no process groups")
        if len(dims) == 1:
            group = self.device_mesh.get_group(dims[0])
        else:
            group = self._new_compound_group(dims)
        from . import comm_stats

        comm_stats.register_group_label(group, self.label(dims))
        self._groups[dims] = group
        return group

    def _new_compound_group(self, dims: tuple[str, ...]):
        import torch.distributed as dist

        index = []
        for i, name in enumerate(self.names):
            index.append(slice(None) if name in dims else self.coordinate[i])
        ranks = self._rank_grid[tuple(index)].reshape(-1).tolist()
        if len(ranks) == dist.get_world_size() and ranks == list(range(len(ranks))):
            return dist.group.WORLD
        return dist.new_group(ranks, use_local_synchronization=True)

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))
        return f"Mesh({dims})"

    def __eq__(self, other) -> bool:
        return self is other or (
            isinstance(other, Mesh)
            and self.device_mesh is other.device_mesh
            and self.device_mesh is not None
            and self.allow_compound == other.allow_compound
        )

    def __hash__(self) -> int:
        return id(self.device_mesh) if self.device_mesh is not None else id(self)


_WRAPPED: "weakref.WeakKeyDictionary[object, Mesh]" = weakref.WeakKeyDictionary()
_PLAIN: "weakref.WeakKeyDictionary[object, Mesh]" = weakref.WeakKeyDictionary()


def wrap_mesh(mesh) -> Mesh:
    """Wrap a ``DeviceMesh`` so compound dimensions (``"dp-sp"``) can be named.

    Wrapping is idempotent and cached: the same ``DeviceMesh`` always gives
    the same wrapper, so its lazily created compound groups are shared.

    >>> mesh = es.wrap_mesh(init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))  # doctest: +SKIP
    >>> es.einshard("a b/dp-tp -> a b", x, mesh=mesh)  # doctest: +SKIP
    """
    if isinstance(mesh, Mesh):
        if mesh.allow_compound:
            return mesh
        mesh = mesh.device_mesh
    if not hasattr(mesh, "mesh_dim_names"):
        raise ValueError(f"wrap_mesh needs a DeviceMesh, got {type(mesh).__name__}")
    wrapped = _WRAPPED.get(mesh)
    if wrapped is None:
        wrapped = Mesh.from_device_mesh(mesh)
        _WRAPPED[mesh] = wrapped
    return wrapped


def _as_mesh(mesh) -> Mesh:
    if isinstance(mesh, Mesh):
        return mesh
    if not hasattr(mesh, "mesh_dim_names"):
        raise ValueError(f"mesh= must be a DeviceMesh or es.wrap_mesh(...), got {type(mesh).__name__}")
    wrapped = _PLAIN.get(mesh)
    if wrapped is None:
        wrapped = Mesh.from_device_mesh(mesh, allow_compound=False)
        _PLAIN[mesh] = wrapped
    return wrapped


@contextlib.contextmanager
def use_mesh(mesh):
    """Make ``mesh`` the ambient mesh: ops inside need no ``mesh=``.

    >>> with es.use_mesh(mesh):  # doctest: +SKIP
    ...     y = es.einshard("a/tp b -> a b", x)
    """
    mesh = _as_mesh(mesh)
    token = _context.push(mesh=mesh)
    try:
        yield mesh
    finally:
        _context.pop(token)


def current_mesh() -> Mesh | None:
    """The ambient mesh (from ``use_mesh`` or ``shard_map``), or ``None``."""
    return _context.current().mesh


def resolve_mesh(mesh) -> Mesh:
    """``mesh`` as a :class:`Mesh`, falling back to the ambient mesh."""
    if mesh is None:
        mesh = _context.current().mesh
        if mesh is None:
            raise ValueError(_MESH_REQUIRED)
        return mesh
    return _as_mesh(mesh)
