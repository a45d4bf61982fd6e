"""Activation checkpointing: a recompute runs in the context of the forward it replays.

``torch.utils.checkpoint`` runs a checkpointed region's function a second
time during backward, usually after ``es.use_mesh`` or the ``shard_map``
call around it has returned. The library ops in it read the ambient context
(:mod:`einshard.core._context`: the mesh, the split shapes ``shard_map`` knows,
the running body) and the ``es.optimize`` scope, and inside
``shard_map(check_vma=True)`` every torch op goes through the body's
variance tracker. So the recompute must run as the forward did:

- when a region's forward starts, :func:`capture` records the ambient
  context, the policy scope and, in a tracking body, the tracker and the
  vma of the region's tensor arguments;
- the recompute runs inside :func:`replay`: that context restored, and in a
  tracking body a replica of the tracker (same call, so it reads the
  body's tags) with the arguments' tags, and the tags ``shard_map`` removed
  from its inputs and outputs on exit, put back for its duration.

Gradient sums stay exact in both modes: with ``use_reentrant=False`` the
forward's graph (and its pvary-s) is the one backward runs, and the
recompute only refills saved tensors; with ``use_reentrant=True`` the
forward ran without a graph (no pvary), and the recompute builds the graph
backward runs, pvary-ing exactly where the forward's tracking would have.

:func:`install` (called when ``einshard`` is imported) puts the capture
into both implementations of ``torch.utils.checkpoint`` (through the shims
of :mod:`einshard.core._torch_compat`), so users pass nothing special: the
reentrant ``CheckpointFunction.forward`` wraps its function, and the
non-reentrant checkpoint's frame wraps its recompute. In a multi-process program the non-reentrant
checkpoint's early stop is turned off, so every rank recomputes the whole
region and runs the same collectives.
"""

from __future__ import annotations

import optree
import torch.distributed as dist

from ..core import _context, _torch_compat
from ..core import policy as _policy
from ..core._torch_compat import compile_in_progress
from ..errors import EinshardError
from . import vma as _vma

__all__ = ["Forward", "capture", "replay", "install", "installed"]



class Forward:
    """What a checkpointed region's forward ran under (see :func:`capture`)."""

    __slots__ = ("ambient", "scope", "tracker", "masks")

    def __init__(self, ambient, scope, tracker):
        self.ambient = ambient  # the ambient context (einshard.core._context.Ambient)
        self.scope = scope  # the es.optimize scope
        self.tracker = tracker  # the body's variance tracker, where it tracks the region
        self.masks = None  # the vma of the region's arguments' leaves (see note)

    def note(self, args) -> None:
        """Record the vma of ``args``' tensors (tracked regions only)."""
        if self.tracker is not None:
            self.masks = self.tracker.masks(optree.tree_leaves(args, none_is_leaf=True))


def capture() -> Forward | None:
    """The context of the region whose forward starts now; ``None`` where nothing needs restoring.

    >>> capture() is None   # no es.use_mesh, shard_map or es.optimize around
    True
    """
    if compile_in_progress():  # a compiled region's recompute is part of the compiled graph
        return None
    ambient = _context.current()
    scope = _policy.scope()
    body = ambient.shard_map
    if ambient.mesh is None and body is None and not ambient.shapes and scope is None:
        return None
    tracker = None
    if body is not None and body.tracker is not None:
        tracker = body.tracker
        if tracker.suspended:  # inside a library op: the region runs untracked, as its recompute will
            tracker = None
            ambient = ambient.changed(shard_map=body.with_tracker(None))
        elif tracker.kept is None:
            tracker.kept = []  # from now on the body's exit remembers the tags it removes
    return Forward(ambient, scope, tracker)


def replay(forward: Forward, fn, args, kwargs=None):
    """``fn(*args, **kwargs)``, a recompute of the region ``forward`` was captured for, in its context.

    >>> replay(Forward(_context.current(), None, None), max, (1, 2))
    2
    """
    if compile_in_progress():  # compiled autograd tracing a reentrant backward: the context cannot be entered there
        raise EinshardError(
            "activation checkpointing: a recompute traced by torch.compile (compiled autograd) cannot run in its "
            "forward's einshard context; compile the forward too, use use_reentrant=False, or run backward eagerly"
        )
    kwargs = kwargs or {}
    ambient = forward.ambient
    tracker = forward.tracker
    if tracker is not None:
        tracker = tracker.replica()
        ambient = ambient.changed(shard_map=ambient.shard_map.with_tracker(tracker))
    token = _context.restore(ambient)
    try:
        with _policy.scoped(forward.scope):
            if tracker is None:
                return fn(*args, **kwargs)
            leaves = optree.tree_leaves(args, none_is_leaf=True)
            masks = forward.masks
            if masks is None or len(masks) != len(leaves):
                raise EinshardError(
                    "activation checkpointing: the arguments of a region checkpointed in a shard_map body "
                    "with check_vma=True changed structure between its forward and its recompute, so their "
                    "variance cannot be restored; pass the region tensors (not containers modified later)"
                )
            return _vma.run_replayed(tracker, fn, args, kwargs, leaves, masks)
    finally:
        _context.pop(token)


class _Replayed:
    """``fn`` whose calls are recomputes of the region ``forward`` was captured for."""

    __slots__ = ("fn", "forward")

    def __init__(self, fn, forward):
        self.fn, self.forward = fn, forward

    def __call__(self, *args, **kwargs):
        return replay(self.forward, self.fn, args, kwargs)


class _Rerun(_Replayed):
    """The function of a reentrant checkpoint: its first call is the forward, later ones replay it."""

    __slots__ = ("ran",)

    def __init__(self, fn, forward):
        super().__init__(fn, forward)
        self.ran = False

    def __call__(self, *args, **kwargs):
        if not self.ran:
            self.ran = True
            return self.fn(*args, **kwargs)
        return replay(self.forward, self.fn, args, kwargs)


def _reentrant_forward(ctx, run_function, preserve_rng_state, *args):
    """``CheckpointFunction.forward`` (``use_reentrant=True``), with the region's context captured."""
    forward = capture()
    if forward is not None:
        forward.note(args)
        run_function = _Rerun(run_function, forward)
    return _torch_compat.original_reentrant_forward(ctx, run_function, preserve_rng_state, *args)


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _Frame(_torch_compat.CheckpointFrame):
    """The non-reentrant checkpoint's frame, its recompute run by :func:`replay`.

    Early stop (the recompute stops as soon as the tensors backward needs are
    computed) is off in a multi-process program: where ranks save a different
    number of tensors before a collective, some would stop short of it while
    the others wait there.
    """

    def __init__(self, recompute_fn, *rest, **kwargs):
        forward = capture()
        if forward is not None:
            recompute_fn = _Replayed(recompute_fn, forward)
        super().__init__(recompute_fn, *rest, **kwargs)
        self.einshard_forward = forward
        if getattr(self, "early_stop", False) and _distributed():
            self.early_stop = False

    def inputs_saved(self, inputs):
        if self.einshard_forward is not None:
            self.einshard_forward.note(inputs)


def install() -> bool:
    """Make ``torch.utils.checkpoint`` (both ``use_reentrant`` modes) replay regions in their forward's context.

    Called when ``einshard`` is imported; idempotent.

    >>> install()
    True
    """
    _torch_compat.install_checkpoint(_Frame, _reentrant_forward)
    return True


def installed() -> bool:
    """Whether :func:`install` has hooked ``torch.utils.checkpoint``.

    >>> installed()
    True
    """
    return _torch_compat.checkpoint_installed(_Frame)
