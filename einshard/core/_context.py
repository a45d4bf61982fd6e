"""The ambient context: the mesh and split shapes that ops use when not given.

``es.use_mesh`` sets the mesh; ``shard_map`` sets the mesh and the split
shapes it knows from its specs. Ops read :func:`current` once per call.

Eager code keeps the context in a ``ContextVar`` (so threads and asyncio
tasks each see their own). ``torch.compile`` cannot trace
``ContextVar.get``, so every change is mirrored in a plain module-level
object (:data:`_STATE`) and traced code reads and writes only that one:
dynamo guards on it like on any global, and a compiled function recompiles
when it runs under another ambient context.
"""

from __future__ import annotations

import contextvars

from ._torch_compat import compile_in_progress


class Ambient:
    """One immutable state of the context (build a changed copy with :meth:`changed`)."""

    __slots__ = ("mesh", "shapes", "policy", "shard_map", "shapes_key")

    def __init__(self, mesh=None, shapes=None, policy=None, shard_map=None, shapes_key=()):
        self.mesh = mesh
        # {(mesh dims in mesh order, axis): split shapes} known from shard_map's specs, for ``mesh``
        self.shapes = {} if shapes is None else shapes
        # extra per-scope state (shard_map's variance tracking, policy scope)
        self.policy = policy
        self.shard_map = shard_map
        # a hashable form of ``shapes`` for plan-cache keys
        self.shapes_key = shapes_key

    def changed(self, mesh=None, shapes=None, shard_map=None) -> Ambient:
        """A copy with the given fields replaced (``None``: kept)."""
        key = self.shapes_key
        if shapes is not None:
            shapes = dict(shapes)
            key = tuple(sorted(shapes.items()))
        return Ambient(
            self.mesh if mesh is None else mesh,
            self.shapes if shapes is None else shapes,
            self.policy,
            self.shard_map if shard_map is None else shard_map,
            key,
        )


class _State:
    """The mirror of the current context that traced code reads (see the module docstring)."""

    __slots__ = ("ambient",)

    def __init__(self, ambient):
        self.ambient = ambient


_EMPTY = Ambient()
_AMBIENT: contextvars.ContextVar[Ambient] = contextvars.ContextVar("einshard_ambient", default=_EMPTY)
_STATE = _State(_EMPTY)


def current() -> Ambient:
    if compile_in_progress():
        return _STATE.ambient
    return _AMBIENT.get()


def push(mesh=None, shapes=None, shard_map=None):
    """Enter a changed context; returns the token for :func:`pop` (always pop in ``finally``)."""
    if compile_in_progress():
        old = _STATE.ambient
        _STATE.ambient = old.changed(mesh, shapes, shard_map)
        return old
    new = _AMBIENT.get().changed(mesh, shapes, shard_map)
    token = _AMBIENT.set(new)
    _STATE.ambient = new
    return token


def restore(ambient: Ambient):
    """Enter ``ambient`` (an earlier :func:`current`) as the whole context, in eager code; pop the token with
    :func:`pop`. For recomputation: an activation-checkpointed region runs again in its forward's context."""
    token = _AMBIENT.set(ambient)
    _STATE.ambient = ambient
    return token


def pop(token) -> None:
    if isinstance(token, Ambient):  # pushed by traced code
        _STATE.ambient = token
        return
    _AMBIENT.reset(token)
    _STATE.ambient = _AMBIENT.get()


class at_trace_time:
    """Make ``mesh``/``shapes`` the context of planning code that runs while dynamo traces.

    Traced code changes the context only in dynamo's model of :data:`_STATE`
    (the real object is updated when the graph runs), so trace-time planning
    functions receive the traced context's fields as arguments and set them
    here for their duration.
    """

    __slots__ = ("ambient", "old")

    def __init__(self, mesh, shapes):
        self.ambient = Ambient(mesh, dict(shapes), shapes_key=tuple(sorted(shapes.items())))

    def __enter__(self):
        self.old = _STATE.ambient
        _STATE.ambient = self.ambient
        return self.ambient

    def __exit__(self, *exc):
        _STATE.ambient = self.old
        return False


def shapes_for(mesh) -> dict:
    """The ambient split shapes, if they belong to ``mesh`` (the ambient mesh); else none.

    ``shard_map`` records split shapes for its own mesh; an op inside the body
    that runs on another mesh (``mesh=other`` or ``es.use_mesh(other)``) must
    not read them.
    """
    amb = current()
    if amb.shapes and (mesh is amb.mesh or (amb.mesh is not None and mesh == amb.mesh)):
        return amb.shapes
    return {}
