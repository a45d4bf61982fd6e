"""Meshes: named mesh dimensions, compound groups and the ambient mesh.

A :class:`Mesh` wraps a ``torch.distributed.device_mesh.DeviceMesh``. Besides
the mesh's own dimensions it resolves *compound* dimensions such as
``"dp-sp"``: the group spanning ``dp`` and ``sp`` for every fixed coordinate of
the other dimensions, ranks ordered by the mesh's own dimension order (so
``"dp-sp"`` and ``"sp-dp"`` are the same group). Compound groups are created
lazily, once, and cached on the wrapper.

A :class:`Mesh` can stand in for the ``DeviceMesh`` it wraps: it has
``mesh_dim_names``, ``shape``, ``size()``, ``ndim``, ``device_type``,
``mesh``, ``get_group``, ``get_all_groups``, ``get_local_rank``,
``get_coordinate``, ``get_rank`` and indexing by one, several or compound
names (``mesh["dp"]``, ``mesh["dp", "tp"]``, ``mesh["dp-sp"]``), which gives
a cached sub-mesh whose groups are the parent's.

Blocks follow mesh coordinates: block ``k`` of an axis sharded over a group
lives at the member whose index in the group (mesh-order flattening, as
:meth:`Mesh.index`) is ``k``. A process group numbers its ranks in ascending
global-rank order (``torch.distributed.new_group`` sorts them), which differs
from the mesh order on meshes built from a permuted rank tensor, on sub-meshes
in another dimension order and for compound groups; :meth:`Mesh.order` gives,
per group, the group rank of each block (``None`` when they agree), and the
collectives translate through it.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core import _context, _torch_compat
from ..errors import EinshardError
from . import comm_stats

__all__ = ["Mesh", "SubMesh", "wrap_mesh", "use_mesh", "current_mesh", "resolve_mesh", "mesh_required"]

MESH_REQUIRED = "Distributed einshard operations require mesh=..."


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
        "_orders",
        "_dims_cache",
        "_rank_grid",
        "_submeshes",
        "__weakref__",
    )

    def __init__(
        self,
        device_mesh,
        *,
        names: Sequence[str],
        shape: Sequence[int],
        coordinate: Sequence[int] | None,
        allow_compound: bool = True,
        rank_grid=None,
    ):
        self.device_mesh = device_mesh
        self.names = tuple(names)
        self.shape = tuple(int(s) for s in shape)
        if coordinate is not None:  # None: found on first use (see __getattr__)
            self.coordinate = tuple(int(c) for c in coordinate)
        self.allow_compound = allow_compound
        self._groups: dict[tuple[str, ...], object] = {}
        self._orders: dict[tuple[str, ...], tuple[int, ...] | None] = {}
        self._dims_cache: dict[str, tuple[str, ...]] = {}
        self._rank_grid = rank_grid
        self._submeshes: dict = {}

    # -- construction -----------------------------------------------------
    @classmethod
    def from_device_mesh(cls, device_mesh, *, allow_compound: bool = True, names=None) -> Mesh:
        """Wrap a ``DeviceMesh``, or any object with ``mesh`` (the rank tensor) and ``mesh_dim_names``.

        Such an object needs neither ``get_coordinate`` nor process groups when it is wrapped: this
        rank's coordinate is then found on first use (from ``torch.distributed``'s rank), and its
        groups are created on first use, as compound ones are.
        """
        names = check_names(device_mesh, names)
        coordinate = None
        if hasattr(device_mesh, "get_coordinate"):
            coordinate = device_mesh.get_coordinate()
            if coordinate is None:
                raise EinshardError("this rank is not part of the given DeviceMesh")
        return cls(
            device_mesh,
            names=names,
            shape=tuple(device_mesh.mesh.shape),
            coordinate=coordinate,
            allow_compound=allow_compound,
            rank_grid=device_mesh.mesh,
        )

    def __getattr__(self, name):
        """``coordinate`` of a mesh object without ``get_coordinate``: this rank's place in the rank tensor."""
        if name != "coordinate":
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if not dist.is_initialized():
            raise EinshardError("this mesh's coordinate is this rank's place in mesh.mesh, which needs an initialised "
                                "process group (torch.distributed.init_process_group)")
        found = (torch.as_tensor(self._rank_grid, device="cpu") == dist.get_rank()).nonzero()
        if len(found) != 1:
            raise EinshardError(f"rank {dist.get_rank()} is not (once) in the mesh's ranks {self._rank_grid!r}")
        self.coordinate = tuple(int(c) for c in found[0])
        return self.coordinate

    @classmethod
    def virtual(cls, shape: Sequence[int], names: Sequence[str], coordinate: Sequence[int] | None = None) -> Mesh:
        """A mesh without process groups: enough to plan and explain."""
        shape = tuple(shape)
        if coordinate is None:
            coordinate = (0,) * len(shape)
        if len(names) != len(shape) or len(coordinate) != len(shape):
            raise EinshardError("virtual mesh: shape, names and coordinate must have the same length")
        _check_name_list(names, len(shape))
        return cls(None, names=names, shape=shape, coordinate=coordinate)

    # -- dimensions -------------------------------------------------------
    def dims(self, name: str) -> tuple[str, ...]:
        """The atomic dimensions of ``name`` (``"sp-dp"`` → ``("dp", "sp")``), in mesh order."""
        cached = self._dims_cache.get(name)
        if cached is not None:
            return cached
        parts = name.split("-")
        if any(p == "" for p in parts):
            raise EinshardError(f"mesh dimension {name!r} has an empty component; the mesh has {list(self.names)}")
        if len(set(parts)) != len(parts):
            raise EinshardError(f"mesh dimension {name!r} repeats a component; the mesh has {list(self.names)}")
        unknown = [p for p in parts if p not in self.names]
        if unknown:
            raise EinshardError(
                f"mesh dimension {unknown[0]!r} (in {name!r}) is not in the mesh; it has {list(self.names)}"
            )
        if len(parts) > 1 and not self.allow_compound:
            raise EinshardError(
                f"compound mesh dimension {name!r} needs a wrapped mesh: pass es.wrap_mesh(device_mesh)"
            )
        dims = tuple(sorted(parts, key=self.names.index))
        self._dims_cache[name] = dims
        return dims

    def label(self, dims: Sequence[str]) -> str:
        """The canonical name of a set of atomic dimensions (mesh order, ``-`` joined)."""
        return "-".join(sorted(dims, key=self.names.index))

    def size(self, mesh_dim: str | int | Sequence[str] | None = None) -> int:
        """The number of ranks along ``mesh_dim`` (a (compound) name, a dimension index, or all with ``None``)."""
        name = mesh_dim
        if name is None:
            return math.prod(self.shape)
        if isinstance(name, int):
            return self.shape[name]
        dims = self.dims(name) if isinstance(name, str) else name
        return math.prod([self.shape[self.names.index(d)] for d in dims])  # (a list: dynamo traces this)

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
            raise EinshardError("a virtual mesh has no ranks")
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
            raise EinshardError("a virtual mesh has no process groups")
        if len(dims) == 1 and hasattr(self.device_mesh, "get_group"):
            group = self.device_mesh.get_group(self.names.index(dims[0]))
        else:  # a compound dimension (or a mesh object without groups of its own)
            group = self._new_compound_group(dims)
        comm_stats.register_group_label(group, self.label(dims))
        self._groups[dims] = group
        return group

    def order(self, name: str | Sequence[str]) -> tuple[int, ...] | None:
        """The group rank holding each block of ``name``'s group; ``None`` where block ``k`` is on group rank ``k``.

        Blocks are numbered as :meth:`index` numbers the members (mesh-order
        flattening, or the order of a tuple of dimensions). A process group
        numbers its ranks in ascending global-rank order, so the two differ on
        meshes built from a permuted rank tensor, on sub-meshes in another
        dimension order and for compound groups. Computed once per group.

        >>> mesh = es.wrap_mesh(DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("dp", "tp")))  # doctest: +SKIP
        >>> mesh.order("dp-tp"), mesh.order("tp")  # doctest: +SKIP
        ((0, 2, 1, 3), None)
        """
        dims = self.dims(name) if isinstance(name, str) else tuple(name)
        try:
            return self._orders[dims]
        except KeyError:
            pass
        order = None
        if self._has_groups():
            ranks = dist.get_process_group_ranks(self.group(dims))
            members = self._member_ranks(dims)
            if sorted(members) != sorted(ranks):
                raise EinshardError(
                    f"the process group of mesh dimension(s) {list(dims)} holds ranks {sorted(ranks)}, "
                    f"but the mesh puts {sorted(members)} there"
                )
            position = {r: j for j, r in enumerate(ranks)}
            found = tuple(position[r] for r in members)
            order = None if found == tuple(range(len(found))) else found
        self._orders[dims] = order
        return order

    def _has_groups(self) -> bool:
        return self.device_mesh is not None

    def has_process_groups(self) -> bool:
        """Whether the mesh has process groups (``False`` for a virtual one, made for planning)."""
        return self._has_groups()

    def _member_ranks(self, dims: Sequence[str]) -> list[int]:
        """The global ranks of this rank's group over ``dims``, in block order."""
        index = tuple(slice(None) if n in dims else c for n, c in zip(self.names, self.coordinate))
        kept = [n for n in self.names if n in dims]  # the axes left after indexing, in mesh order
        grid = np.asarray(self._rank_grid)[index]
        return grid.transpose([kept.index(d) for d in dims]).reshape(-1).tolist()

    def _new_compound_group(self, dims: tuple[str, ...]):
        index = []
        for i, name in enumerate(self.names):
            index.append(slice(None) if name in dims else self.coordinate[i])
        ranks = self._rank_grid[tuple(index)].reshape(-1).tolist()
        if len(ranks) == dist.get_world_size() and ranks == list(range(len(ranks))):
            return dist.group.WORLD
        return dist.new_group(ranks, use_local_synchronization=True)

    # -- the DeviceMesh interface -------------------------------------------
    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.names

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def device_type(self) -> str:
        return "cpu" if self.device_mesh is None else getattr(self.device_mesh, "device_type", "cpu")

    @property
    def mesh(self):
        """The global ranks as a tensor of the mesh's shape (a virtual mesh numbers them in order)."""
        if self._rank_grid is None:
            return torch.arange(math.prod(self.shape)).reshape(self.shape)
        return torch.as_tensor(self._rank_grid)

    def _dim_name(self, mesh_dim) -> str:
        if mesh_dim is None:
            if len(self.names) != 1:
                raise EinshardError(f"this mesh has {len(self.names)} dimensions {list(self.names)}; name one")
            return self.names[0]
        if isinstance(mesh_dim, bool) or not isinstance(mesh_dim, (int, str)):
            raise TypeError(f"a mesh dimension is a name or an index, got {type(mesh_dim).__name__}")
        if isinstance(mesh_dim, int):
            if not -len(self.names) <= mesh_dim < len(self.names):
                raise EinshardError(f"mesh dimension index {mesh_dim} is out of range for {list(self.names)}")
            return self.names[mesh_dim]
        return mesh_dim

    def get_group(self, mesh_dim: str | int | None = None):
        """The process group of a (compound) dimension, like ``DeviceMesh.get_group``."""
        return self.group(self._dim_name(mesh_dim))

    def get_all_groups(self) -> list:
        return [self.group(n) for n in self.names]

    def get_local_rank(self, mesh_dim: str | int | None = None) -> int:
        """This rank's index along a (compound) dimension."""
        return self.index(self._dim_name(mesh_dim))

    def get_coordinate(self) -> list[int]:
        return list(self.coordinate)

    def get_rank(self) -> int:
        return int(self.mesh[tuple(self.coordinate)])

    def __getitem__(self, names) -> Mesh:
        """A sub-mesh over one, several or compound names (``mesh["dp"]``, ``mesh["dp", "tp"]``, ``mesh["dp-sp"]``).

        Cached: the same names (in any component order) give the same object;
        its groups are this mesh's (compound ones created lazily, once).
        """
        key = (names,) if isinstance(names, str) else tuple(names) if isinstance(names, (tuple, list)) else None
        if key is None or not key or any(not isinstance(n, str) for n in key):
            raise TypeError(f"index a mesh with dimension names (str), got {names!r}")
        parts = tuple(self.dims(n) for n in key)
        flat = [d for p in parts for d in p]
        if len(set(flat)) != len(flat):
            raise EinshardError(f"mesh[{names!r}] names a mesh dimension twice; the mesh has {list(self.names)}")
        if parts == tuple((n,) for n in self.names):
            return self
        sub = self._submeshes.get(parts)
        if sub is None:
            sub = SubMesh(self, parts)
            self._submeshes[parts] = sub
        return sub

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


class SubMesh(Mesh):
    """``mesh[...]``: some (compound) dimensions of a parent mesh, sharing its process groups.

    Each of its dimensions is named by the parent's canonical label
    (``"dp-sp"``); its ``device_mesh`` is built from the parent's groups on
    first use.
    """

    __slots__ = ("parent", "parts", "_device_mesh")

    def __init__(self, parent: Mesh, parts: tuple[tuple[str, ...], ...]):
        names = tuple(parent.label(p) for p in parts)
        shape = tuple(parent.size(p) for p in parts)
        coordinate = tuple(parent.index(p) for p in parts)
        chosen = [d for p in parts for d in p]
        index = tuple(slice(None) if n in chosen else c for n, c in zip(parent.names, parent.coordinate))
        kept = [n for n in parent.names if n in chosen]  # the axes left after indexing, in mesh order
        grid = np.asarray(parent.mesh)[index].transpose([kept.index(d) for d in chosen]).reshape(shape)
        super().__init__(None, names=names, shape=shape, coordinate=coordinate, rank_grid=grid)
        self.parent = parent
        self.parts = parts
        self._device_mesh: DeviceMesh | None = None

    @property
    def device_mesh(self):
        """A ``DeviceMesh`` over the parent's groups (``None`` when the parent is virtual)."""
        if self._device_mesh is None and self.parent.device_mesh is not None:
            groups = [self.parent.group(p) for p in self.parts]
            self._device_mesh = DeviceMesh.from_group(
                groups if len(groups) > 1 else groups[0],
                self.parent.device_type,
                mesh=self.mesh,
                mesh_dim_names=self.names,
            )
        return self._device_mesh

    @device_mesh.setter
    def device_mesh(self, value) -> None:
        pass  # set by Mesh.__init__; built lazily instead

    def _has_groups(self) -> bool:
        return self.parent._has_groups()

    @property
    def device_type(self) -> str:
        return self.parent.device_type

    def dims(self, name: str) -> tuple[str, ...]:
        if name in self.names:
            return (name,)
        try:  # "sp-dp" names the sub-mesh dimension "dp-sp"
            label = self.parent.label(self.parent.dims(name))
        except ValueError:
            label = None
        if label in self.names:
            return (label,)
        return super().dims(name)

    def group(self, name: str | Sequence[str]):
        dims = self.dims(name) if isinstance(name, str) else tuple(name)
        parent_dims = [d for n in dims for d in self.parts[self.names.index(n)]]
        return self.parent.group(tuple(parent_dims))

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


def _name_tuple(names) -> tuple:
    """``mesh_dim_names`` as a tuple: a ``str`` is one name, ``None`` none; TypeError for anything else that
    is not an iterable of names (an int, an array or tensor)."""
    if names is None:
        return ()
    if isinstance(names, str):
        return (names,)
    if (hasattr(names, "shape") and hasattr(names, "dtype")) or not hasattr(names, "__iter__"):
        raise TypeError(f"mesh_dim_names must be an iterable of strings, got {type(names).__name__} {names!r}")
    return tuple(names)


def _dash_problem(name: str, names) -> str:
    parts = name.split("-")
    if "" in parts:
        return "contains '-' with an empty compound component"
    if len(set(parts)) != len(parts):
        return "contains '-' and repeats a compound component"
    overlap = [m for m in names if m != name and set(m.split("-")) & set(parts)]
    if overlap:
        return f"contains '-' and overlaps the compound components of {overlap[0]!r}"
    return "contains '-'"


def _check_name_list(names, ndim: int) -> tuple[str, ...]:
    """Mesh dimension names: strings, non-empty, distinct, without '-', one per dimension."""
    names = _name_tuple(names)
    for n in names:
        if not isinstance(n, str):
            raise TypeError(f"mesh_dim_names entries must be strings, got {n!r} in {names!r}")
        if not n:
            raise EinshardError(f"mesh_dim_names entries must be non-empty strings, got {names!r}")
    for n in names:
        if "-" in n:
            raise EinshardError(f"mesh_dim_names entry {n!r} {_dash_problem(n, names)}; a name cannot contain '-', "
                                f"which joins compound dimensions ('dp-sp'): rename it (e.g. {n.replace('-', '_')!r})")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise EinshardError(f"mesh_dim_names cannot repeat a name: {repeated} repeat in {names!r}")
    if len(names) != ndim:
        raise EinshardError(f"mesh_dim_names length must match the mesh rank: the mesh has {ndim} dimension(s) but "
                            f"{len(names)} name(s) were given: {names!r}")
    return names


def check_names(device_mesh, names=None) -> tuple[str, ...]:
    """The validated dimension names of ``device_mesh`` (``names`` overrides missing ones).

    Checked before any group is created, on anything with ``mesh`` and ``mesh_dim_names``
    (a ``str`` is one name).
    """
    own = getattr(device_mesh, "mesh_dim_names", None)
    ndim = len(tuple(device_mesh.mesh.shape))
    if names is not None:
        names = _check_name_list(names, ndim)
        if own is not None and _name_tuple(own) and _name_tuple(own) != names:
            raise EinshardError(f"mesh_dim_names={names!r} contradicts the mesh's own names {tuple(own)!r}")
        return names
    if own is None:
        raise EinshardError(
            "einshard needs a DeviceMesh with mesh_dim_names, e.g. "
            "init_device_mesh('cpu', (2, 4), mesh_dim_names=('dp', 'tp')), or wrap_mesh(mesh, mesh_dim_names=...)"
        )
    return _check_name_list(own, ndim)


class _ByIdentity:
    """Meshes wrapped per ``DeviceMesh`` *object*: ``DeviceMesh`` compares by value (ranks, shape, names,
    device type), so two meshes with their own process groups can be equal; a wrapper must keep its own
    groups. An entry lives while its ``DeviceMesh`` does (the wrapper holds it)."""

    def __init__(self):
        self._entries: dict[int, tuple[weakref.ref, Mesh]] = {}

    def get(self, mesh) -> Mesh | None:
        entry = self._entries.get(id(mesh))
        return entry[1] if entry is not None and entry[0]() is mesh else None

    def put(self, mesh, wrapped: Mesh) -> None:
        key, entries = id(mesh), self._entries
        entries[key] = (weakref.ref(mesh, lambda _ref: entries.pop(key, None)), wrapped)


_WRAPPED = _ByIdentity()
_PLAIN = _ByIdentity()


def wrap_mesh(mesh, mesh_dim_names: Sequence[str] | None = None) -> Mesh:
    """Wrap a ``DeviceMesh`` so compound dimensions (``"dp-sp"``) can be named.

    The result stands in for the ``DeviceMesh`` (``mesh_dim_names``, ``shape``,
    ``size()``, ``get_group``, ``get_local_rank``, ``get_coordinate``, and
    ``mesh["dp"]``, ``mesh["dp", "tp"]``, ``mesh["dp-sp"]``). Wrapping is
    idempotent and cached: the same ``DeviceMesh`` always gives the same
    wrapper, so its lazily created compound groups are shared, and
    ``wrap_mesh(wrapped) is wrapped``. ``mesh_dim_names=`` names an unnamed
    mesh; names are checked first (strings, non-empty, distinct, no ``-``,
    one per dimension, agreeing with the mesh's own).

    >>> mesh = es.wrap_mesh(init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp")))  # doctest: +SKIP
    >>> mesh["dp-tp"].get_group().size(), mesh.get_local_rank("tp")  # doctest: +SKIP
    (8, 1)
    >>> es.einshard("a b/dp-tp -> a b", x, mesh=mesh)  # doctest: +SKIP
    """
    if isinstance(mesh, Mesh):
        if mesh_dim_names is not None and _check_name_list(mesh_dim_names, mesh.ndim) != mesh.names:
            raise EinshardError(f"mesh_dim_names={tuple(mesh_dim_names)!r} contradicts the mesh's names {mesh.names!r}")
        if mesh.allow_compound:
            return mesh
        mesh = mesh.device_mesh
    if not (hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "mesh")):
        raise EinshardError(f"wrap_mesh needs a DeviceMesh, got {type(mesh).__name__}")
    names = check_names(mesh, mesh_dim_names)
    wrapped = _WRAPPED.get(mesh)
    if wrapped is None:
        wrapped = Mesh.from_device_mesh(mesh, names=names)
        try:
            _WRAPPED.put(mesh, wrapped)
        except TypeError:  # an object that cannot be weakly referenced: wrapped anew each time
            pass
    elif wrapped.names != names:
        raise EinshardError(f"mesh_dim_names={names!r} contradicts the names "
                            f"this mesh was wrapped with {wrapped.names!r}")
    return wrapped


def as_mesh(mesh) -> Mesh:
    """``mesh`` as an ``es.Mesh``: itself, or a DeviceMesh wrapped once (atomic names only) and cached."""
    if isinstance(mesh, Mesh):
        return mesh
    if not (hasattr(mesh, "mesh_dim_names") and hasattr(mesh, "mesh")):
        raise EinshardError(f"mesh= must be a DeviceMesh or es.wrap_mesh(...), got {type(mesh).__name__}")
    wrapped = _PLAIN.get(mesh)
    if wrapped is None:
        wrapped = Mesh.from_device_mesh(mesh, allow_compound=False)
        try:
            _PLAIN.put(mesh, wrapped)
        except TypeError:  # (as in wrap_mesh)
            pass
    return wrapped


@contextlib.contextmanager
def use_mesh(mesh):
    """Make ``mesh`` the ambient mesh: ops inside need no ``mesh=``.

    >>> with es.use_mesh(mesh):  # doctest: +SKIP
    ...     y = es.einshard("a/tp b -> a b", x)
    """
    mesh = as_mesh(mesh)
    token = None
    try:  # pushed inside the try, so that no exit path (a compiler splitting the frame) skips the pop
        token = _context.push(mesh=mesh)
        yield mesh
    finally:
        if token is not None:
            _context.pop(token)


def current_mesh() -> Mesh | None:
    """The ambient mesh (from ``use_mesh`` or ``shard_map``), or ``None``."""
    return _context.current().mesh


def _in_backward() -> str:
    """A hint for an op without a mesh that runs during backward (a hook, a custom Function's backward)."""
    if _torch_compat.current_graph_task_id() == -1:
        return ""
    return (" (this call runs during backward, where no es.use_mesh or shard_map context is active: pass mesh=; "
            "activation-checkpointed regions are recomputed in their forward's context)")


def mesh_required(what: str | None = None, why: str = "") -> EinshardError:
    """The error of a call that needs a mesh and has none: it names ``what`` (the formula or function),
    says ``why`` and how to pass one.

    >>> print(mesh_required("'a/tp -> a'", "'a' is sharded over 'tp' in the input only"))
    'a/tp -> a': Distributed einshard operations require mesh=...: 'a' is sharded over 'tp' in the input only; pass mesh=mesh, or make the call inside `with es.use_mesh(mesh):`
    """  # noqa: E501 - a doctest's output line
    text = MESH_REQUIRED + (f": {why}" if why else "")
    text += "; pass mesh=mesh, or make the call inside `with es.use_mesh(mesh):`" + _in_backward()
    err = EinshardError(text if what is None else f"{what}: {text}")
    if what is not None:
        err.expression = what
    return err


def resolve_mesh(mesh, what: str | None = None) -> Mesh:
    """``mesh`` as a :class:`Mesh`, falling back to the ambient mesh (``what`` names the caller in the error)."""
    if mesh is None:
        mesh = _context.current().mesh
        if mesh is None:
            raise mesh_required(what)
        return mesh
    return as_mesh(mesh)
