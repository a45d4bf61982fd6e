"""Running planned transitions on one rank, as autograd Functions.

:func:`compile_step` binds a rank-independent :class:`~einshard.plan.transition.Step`
to this rank's coordinate and process groups. :class:`Transition` runs a
whole transition; its backward is the reverse transition (itself a
``Transition``), so gradients are exact adjoints and double backward works.
"""

from __future__ import annotations

import torch

from . import _traced_collectives as TC
from . import checks as _checks
from . import collectives as C
from . import collectives as _eager_collectives
from .layout import Layout, MeshShape
from .mappings import make_mapping
from .plan.transition import Step, plan_gradient, plan_transition
from .primitives import PRIMITIVES, Site
from .primitives import narrow as _narrow
from .primitives import rel_slices as _rel_slices

_transforms_active = torch._C._are_functorch_transforms_active

__all__ = ["Transition", "compile_step", "transition"]


def compile_step(step, mesh, C=C):
    """A callable ``x -> y`` running ``step`` on this rank (its primitive's ``run``).

    ``C``: the collectives to call, :mod:`einshard.collectives` (eager) or
    :mod:`einshard._traced_collectives` (under ``torch.compile``).
    """
    return PRIMITIVES[step.kind].run(step, Site(mesh, C, _exchange))


def _exchange(src: Layout, dst: Layout, dims, mesh, C):
    """The general exchange of a transition step ``src -> dst`` over ``dims`` (the ``exchange`` primitive's run)."""
    shape, coord = MeshShape.of(mesh), mesh.coordinate
    return _compile_exchange(src, dst, dims, shape, coord, mesh.group(dims), shape.group_coords(dims, coord), C)


def _intersect(a, b):
    out = []
    for (x0, x1), (y0, y1) in zip(a, b):
        lo, hi = max(x0, y0), min(x1, y1)
        if hi <= lo:
            return None
        out.append((lo, hi))
    return tuple(out)


def _compile_exchange(src: Layout, dst: Layout, dims, shape: MeshShape, coord, group, members, C=C):
    """Every rank sends each peer the part of its block the peer needs and lacks.

    The peer that supplies a region is the one that holds it and agrees with
    the receiver on every exchanged mesh dimension that shards nothing in
    ``src``: so replicated data is read from the "nearest" copy and every
    element moves at most once.
    """
    free = [shape.names.index(d) for d in dims if src.owner(d) is None]
    my_src = src.box(coord, shape)
    my_dst = dst.box(coord, shape)
    out_shape = tuple(b - a for a, b in my_dst)
    sends, recvs = [], []
    for m in members:
        if any(m[p] != coord[p] for p in free):
            sends.append(None)
            recvs.append(None)
            continue
        piece = _intersect(my_src, dst.box(m, shape))
        sends.append(None if piece is None else _rel_slices(piece, my_src))
        piece = _intersect(src.box(m, shape), my_dst)
        recvs.append(None if piece is None else _rel_slices(piece, my_dst))
    recv_numels = [0 if r is None else _numel(r) for r in recvs]
    # eager: point-to-point with the peers that have data, sending views (functional: all_to_all_single)
    kwargs = {"pairwise": True} if C is _eager_collectives else {}
    # the whole output comes from one peer (an ownership swap): its buffer is the output, no unpacking
    whole = [j for j, n in enumerate(recv_numels) if n and n == _numel([(0, n) for n in out_shape])]
    whole = whole[0] if whole else None
    # ... from this rank itself (a diagonal rank of a swap): the output is the input block
    keep = whole is not None and tuple(members[whole]) == tuple(coord) and my_src == my_dst

    def run(x: torch.Tensor) -> torch.Tensor:
        empty = x.new_empty(0)
        chunks = [empty if s is None else _narrow(x, s) for s in sends]
        got = C.all_to_all_v(chunks, recv_numels, group, **kwargs)
        if keep:
            return x
        if whole is not None:
            return got[whole].view(out_shape)
        out = x.new_empty(out_shape)
        for r, flat in zip(recvs, got):
            if r is not None:
                _narrow(out, r).copy_(flat.view([n for _, n in r]))
        return out

    return run


def _numel(rel) -> int:
    n = 1
    for _, length in rel:
        n *= length
    return n


class Transition:
    """A compiled ``src -> dst`` transition on this rank; call it on a local tensor."""

    __slots__ = ("src", "dst", "mesh", "shape", "planned", "steps", "traced_steps", "_reverse", "trivial", "back")

    def __init__(self, src: Layout, dst: Layout, mesh, steps=None, back: Layout | None = None):
        self.src, self.dst, self.mesh = src, dst, mesh
        # the layout the gradient goes back to: ``src``, or ``src`` left partial for a gradient duty
        self.back = src if back is None else back
        self.shape = MeshShape.of(mesh)
        planned = plan_transition(src, dst, self.shape) if steps is None else steps
        self.planned = tuple(planned)
        self.steps = [compile_step(s, mesh) for s in planned]
        self.traced_steps = None  # built by prepare_traced (when a plan is first traced)
        self._reverse = None
        # no forward steps and no reverse steps: autograd needs nothing either
        self.trivial = not self.steps and not plan_transition(dst, src, self.shape) and self.back == src

    def reverse(self) -> "Transition":
        if self._reverse is None:
            if self.back == self.src:
                self._reverse = transition(self.dst, self.src, self.mesh)
                self._reverse._reverse = self
            else:  # a gradient left partial for its duty (uncached: its own reverse is the plain one)
                rev = Transition(self.dst, self.back, self.mesh, plan_gradient(self.dst, self.back, self.shape))
                rev._reverse = transition(self.back, self.dst, self.mesh)
                self._reverse = rev
        return self._reverse

    def run_raw(self, x: torch.Tensor) -> torch.Tensor:
        if _checks._ENABLED:  # agreed once per operation, not per collective
            with _checks.planned():
                for step in self.steps:
                    x = step(x)
            return x
        for step in self.steps:
            x = step(x)
        return x

    def prepare_traced(self) -> "Transition":
        """Build the functional-collective steps of this transition and of its reverse (for backward)."""
        for t in (self, self.reverse()):
            if t.traced_steps is None:
                t.traced_steps = tuple(compile_step(s, t.mesh, TC) for s in t.planned)
        return self

    def run_traced(self, x: torch.Tensor) -> torch.Tensor:
        for step in self.traced_steps:
            x = step(x)
        return x

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        """The transition in code that dynamo traces (call :meth:`prepare_traced` first, untraced)."""
        if self.trivial:
            return x
        return _TracedTransition.apply(x, self)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.trivial:
            return x
        if not (x.requires_grad and torch.is_grad_enabled()) and not _transforms_active():
            return self.run_raw(x)  # no backward will run: skip the autograd Function
        return _apply_transition(x, self)


_TRANSITIONS: dict = {}


def transition(src: Layout, dst: Layout, mesh, back: Layout | None = None) -> Transition:
    """The compiled transition ``src -> dst`` for this rank (cached).

    ``back``: the layout its backward returns the gradient in (default ``src``).
    """
    key = (src, dst, id(mesh), mesh.coordinate, back)
    found = _TRANSITIONS.get(key)
    if found is None or found.mesh is not mesh:
        found = Transition(src, dst, mesh, back=back)
        if len(_TRANSITIONS) > 16384:
            _TRANSITIONS.clear()
        _TRANSITIONS[key] = found
    return found


def _run_transition(x: torch.Tensor, ex: Transition) -> torch.Tensor:
    y = ex.run_raw(x)
    return x.view_as(x) if y is x else y


# backward: the reverse transition (itself a Transition, so double backward works)
_apply_transition = make_mapping("Transition", _run_transition, lambda grad, ex: ex.reverse()(grad))


class _TracedTransition(torch.autograd.Function):
    """A transition under ``torch.compile``: functional collectives forward, the reverse transition backward."""

    @staticmethod
    def forward(ctx, x, ex):
        ctx.ex = ex
        y = ex.run_traced(x)
        return x.view_as(x) if y is x else y

    @staticmethod
    def backward(ctx, grad):
        return ctx.ex.reverse().run_traced(grad), None


def Embedding(result: Layout, embedded: Layout, root_dims: tuple, mesh) -> Transition:
    """The local result turned into per-rank contributions over ``dims`` (this rank's part).

    A transition of one ``embed`` step: the block zero-padded to the
    contribution's extent, and zeros on every rank but group rank 0 of the
    dimensions the result was replicated over (``root_dims``). Its reverse,
    the exact adjoint, is one ``embed_adjoint`` step: the cotangent's block,
    broadcast from group rank 0 over ``root_dims``.
    """
    dims = tuple(d for d in mesh.names if d in embedded.partial and d not in result.partial)
    fwd = Transition(result, embedded, mesh, (Step("embed", result, embedded, dims),))
    fwd._reverse = Transition(embedded, result, mesh, (Step("embed_adjoint", embedded, result, root_dims),))
    fwd._reverse._reverse = fwd
    return fwd.prepare_traced()
