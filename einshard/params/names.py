"""Mesh-dimension names for parameter metadata: reading them, checking groups, resolving groups.

A *group* is a mesh-dimension name, atomic (``dp``) or compound (``dp-sp``);
its *components* are the ``-``-separated atomic names. Every overlap rule is
checked on components, so ``dp-sp``/``sp-dp`` overlap and so do ``dp``/``dp-sp``.
Reading names needs no process groups; :func:`resolve_group` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..comm.mesh import Mesh, as_mesh
from ..core import _context
from ..errors import EinshardError

__all__ = [
    "components",
    "str_tuple",
    "check_group_syntax",
    "normalize_mesh_dim_names",
    "mesh_names",
    "is_known",
    "unknown_groups",
    "overlapping",
    "resolve_group",
]


def components(group: str) -> tuple[str, ...]:
    """The atomic components of a group: ``components("dp-sp") == ("dp", "sp")``."""
    return tuple(group.split("-"))


def check_group_syntax(group: str, what: str) -> None:
    """ValueError "repeated mesh dimensions" for an empty or repeated component.

    >>> check_group_syntax("dp-sp", "grad")
    >>> check_group_syntax("dp-dp", "grad")
    Traceback (most recent call last):
    ...
    einshard.errors.EinshardError: grad group 'dp-dp' has repeated mesh dimensions (an empty or repeated component)
    """
    if not isinstance(group, str):
        raise TypeError(f"{what} group must be a str, got {type(group).__name__}")
    parts = components(group)
    if any(p == "" for p in parts) or len(set(parts)) != len(parts):
        raise EinshardError(f"{what} group {group!r} has repeated mesh dimensions (an empty or repeated component)")


def str_tuple(value, what: str) -> tuple[str, ...]:
    """``None`` → ``()``, a str → one entry, an iterable of str → a tuple (TypeError otherwise)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, torch.Tensor) or not isinstance(value, Iterable) or hasattr(value, "dtype"):
        raise TypeError(f"{what} must be a str, an iterable of str, or None, got {type(value).__name__}")
    value = tuple(value)
    for v in value:
        if not isinstance(v, str):
            raise TypeError(f"{what} entries must be str, got {v!r} in {value!r}")
    return value


def normalize_mesh_dim_names(names) -> tuple[str, ...]:
    """``mesh_dim_names`` as a checked tuple (a ``str`` is one name, ``None`` is ``()``).

    >>> normalize_mesh_dim_names("dp"), normalize_mesh_dim_names(["dp", "tp"])
    (('dp',), ('dp', 'tp'))
    """
    names = str_tuple(names, "mesh_dim_names")
    seen: dict[str, str] = {}
    for n in names:
        if n == "":
            raise EinshardError(f"mesh_dim_names {names!r} has an empty name")
        if names.count(n) > 1:
            raise EinshardError(f"mesh_dim_names {names!r} has the duplicate name {n!r}")
        check_group_syntax(n, "mesh_dim_names")
        for c in components(n):
            if c in seen:
                raise EinshardError(f"mesh_dim_names {names!r}: {seen[c]!r} and {n!r} share the component {c!r}")
            seen[c] = n
    return names


def _own_names(mesh) -> tuple[str, ...] | None:
    """The names a mesh object carries (``None`` when it carries none).

    An object with a rank tensor ``mesh`` needs one name per dimension (``None`` counts as none).
    """
    if _is_es_mesh(mesh):
        return mesh.names
    names = getattr(mesh, "mesh_dim_names", None)
    grid = getattr(mesh, "mesh", None)
    if names is None and not isinstance(grid, torch.Tensor):
        return None
    names = normalize_mesh_dim_names(names)
    if isinstance(grid, torch.Tensor) and grid.ndim != len(names):
        raise EinshardError(f"mesh_dim_names length must match the mesh rank: the mesh has {grid.ndim} dimensions but "
                            f"{len(names)} mesh_dim_names {names!r}")
    return names


def _is_es_mesh(mesh) -> bool:
    return isinstance(mesh, Mesh)


def mesh_names(mesh=None, mesh_dim_names=()) -> tuple[str, ...]:
    """The managed mesh's names: ``mesh_dim_names=`` if given, else the mesh's (or the ambient mesh's).

    >>> from einshard import Mesh
    >>> mesh_names(Mesh.virtual((2, 4), ("dp", "tp")))
    ('dp', 'tp')
    >>> mesh_names(None, "tp")
    ('tp',)
    """
    given = normalize_mesh_dim_names(mesh_dim_names)
    if mesh is None:
        mesh = _context.current().mesh
    own = None if mesh is None else _own_names(mesh)
    if given:
        if own and own != given:
            raise EinshardError(f"mesh_dim_names={given!r} differs from the mesh's own names {own!r}")
        return given
    return own or ()


def is_known(group: str, names: Sequence[str]) -> bool:
    """A name, or ≥2 distinct components that are all names."""
    if group in names:
        return True
    parts = components(group)
    return len(parts) >= 2 and len(set(parts)) == len(parts) and all(p in names for p in parts)


def unknown_groups(groups: Iterable[str], names: Sequence[str]) -> list[str]:
    """The groups not known to ``names`` (none when ``names`` is empty: nothing is checked)."""
    if not names:
        return []
    return [g for g in groups if not is_known(g, names)]


def overlapping(groups: Sequence[str]) -> tuple[str, str] | None:
    """The first pair of groups sharing a component, or ``None``."""
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            if set(components(a)) & set(components(b)):
                return a, b
    return None


def runtime_mesh(mesh):
    """``mesh`` (or the ambient mesh) as an ``es.Mesh`` for resolving groups; raw DeviceMeshes stay atomic-only."""
    if mesh is None:
        mesh = _context.current().mesh
    if mesh is None:
        raise EinshardError("this operation requires mesh= (or an ambient es.use_mesh)")
    if _is_es_mesh(mesh):
        return mesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be an es.Mesh or a DeviceMesh, got {type(mesh).__name__}")
    return as_mesh(mesh)


def resolve_dims(mesh, group: str, what: str) -> tuple[str, ...]:
    """The atomic dims of ``group`` on ``mesh`` (an ``es.Mesh``), in mesh order.

    ValueError naming the group if it is missing; "wrap_mesh" for a compound group on a raw DeviceMesh.
    """
    try:
        return mesh.dims(group)
    except ValueError as err:
        raise EinshardError(f"{what} group {group!r} cannot be resolved on {mesh!r}: {err}") from None


def resolve_group(mesh, group: str, what: str = "mesh"):
    """``(process_group, size)`` of ``group`` on ``mesh``; the process group is ``None`` at size 1."""
    dims = resolve_dims(mesh, group, what)
    size = mesh.size(dims)
    if size == 1:
        return None, 1
    return mesh.group(dims), size
