"""The ambient context: the mesh and split shapes that ops use when not given.

``es.use_mesh`` sets the mesh; ``shard_map`` sets the mesh and the split
shapes it knows from its specs. Ops read :func:`current` once per call.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Ambient:
    mesh: object = None
    # {(mesh dims in mesh order, axis): split shapes} known from shard_map's specs, for ``mesh``
    shapes: dict = field(default_factory=dict)
    # extra per-scope state (shard_map's variance tracking, policy scope)
    policy: object = None
    shard_map: object = None
    # a hashable form of ``shapes`` for plan-cache keys (set by ``push``)
    shapes_key: tuple = ()


_EMPTY = Ambient()
_AMBIENT: contextvars.ContextVar[Ambient] = contextvars.ContextVar("einshard_ambient", default=_EMPTY)


def current() -> Ambient:
    return _AMBIENT.get()


def push(**changes) -> contextvars.Token:
    if "shapes" in changes:
        shapes = dict(changes["shapes"] or {})
        changes["shapes"] = shapes
        changes["shapes_key"] = tuple(sorted(shapes.items()))
    return _AMBIENT.set(replace(_AMBIENT.get(), **changes))


def pop(token: contextvars.Token) -> None:
    _AMBIENT.reset(token)


def shapes_for(mesh) -> dict:
    """The ambient split shapes, if they belong to ``mesh`` (the ambient mesh); else none.

    ``shard_map`` records split shapes for its own mesh; an op inside the body
    that runs on another mesh (``mesh=other`` or ``es.use_mesh(other)``) must
    not read them.
    """
    amb = _AMBIENT.get()
    if amb.shapes and (mesh is amb.mesh or (amb.mesh is not None and mesh == amb.mesh)):
        return amb.shapes
    return {}
