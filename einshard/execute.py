"""Running planned transitions on one rank, as autograd Functions.

:func:`compile_step` binds a rank-independent :class:`~einshard.plan.transition.Step`
to this rank's coordinate and process groups. :class:`Transition` runs a
whole transition; its backward is the reverse transition (itself a
``Transition``), so gradients are exact adjoints and double backward works.
"""

from __future__ import annotations

import torch

from . import checks as _checks
from . import collectives as C
from . import collectives as _eager_collectives
from .exchange import transition_exchange
from .layout import Layout, MeshShape
from .mappings import make_mapping

_transforms_active = torch._C._are_functorch_transforms_active

__all__ = ["Transition", "compile_step", "transition"]


def _rel_slices(inner, outer):
    """Per-axis ``(start, length)`` of box ``inner`` inside box ``outer`` (empty: ``(0, 0)``)."""
    return [(a - c, b - a) if b > a else (0, 0) for (a, b), (c, _) in zip(inner, outer)]


def _narrow(x: torch.Tensor, rel) -> torch.Tensor:
    for dim, (start, length) in enumerate(rel):
        if start != 0 or length != x.shape[dim]:
            x = x.narrow(dim, start, length)
    return x


def compile_step(step, mesh, C=C):
    """A callable ``x -> y`` running ``step`` on this rank.

    ``C``: the collectives to call, :mod:`einshard.collectives` (eager) or
    :mod:`einshard._traced_collectives` (under ``torch.compile``).
    """
    shape = MeshShape.of(mesh)
    coord = mesh.coordinate
    kind = step.kind
    if kind == "slice":
        rel = _rel_slices(step.dst.box(coord, shape), step.src.box(coord, shape))
        return lambda x: _narrow(x, rel)
    if kind == "keep_root":  # contributions: the value on group rank 0, zeros elsewhere
        if shape.index(step.dims, coord) == 0:
            return lambda x: x
        return torch.zeros_like
    group = mesh.group(step.dims)
    members = shape.group_coords(step.dims, coord)
    if kind == "all_reduce":
        return lambda x: C.all_reduce(x, group)
    if kind == "reduce_scatter":
        i = step.axis
        sizes = [b - a for a, b in (step.dst.interval(i, m, shape) for m in members)]
        return lambda x: C.reduce_scatter(x, group, i, sizes)
    if kind == "all_gather":
        i = step.axis
        sizes = [b - a for a, b in (step.src.interval(i, m, shape) for m in members)]
        return lambda x: C.all_gather(x, group, i, sizes)
    if kind == "all_to_all":
        i, j = step.axis, step.to_axis
        src_sizes = [b - a for a, b in (step.src.interval(i, m, shape) for m in members)]
        dst_sizes = [b - a for a, b in (step.dst.interval(j, m, shape) for m in members)]
        return lambda x: C.all_to_all(x, group, i, j, src_sizes, dst_sizes)
    if kind == "exchange":
        return transition_exchange(step.src, step.dst, step.dims, mesh, traced=C is not _eager_collectives)
    raise AssertionError(kind)


class Transition:
    """A compiled ``src -> dst`` transition on this rank; call it on a local tensor."""

    __slots__ = ("src", "dst", "mesh", "shape", "planned", "steps", "traced_steps", "_reverse", "trivial", "back")

    def __init__(self, src: Layout, dst: Layout, mesh, steps=None, back: Layout | None = None):
        from .plan.transition import plan_transition

        self.src, self.dst, self.mesh = src, dst, mesh
        # the layout the gradient goes back to: ``src``, or ``src`` left partial for a gradient duty
        self.back = src if back is None else back
        self.shape = MeshShape.of(mesh)
        planned = plan_transition(src, dst, self.shape) if steps is None else steps
        self.planned = tuple(planned)
        self.steps = [s.compile(mesh) for s in planned]
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
                from .plan.transition import plan_gradient

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
        from . import _traced_collectives as TC

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


class Embedding:
    """The local result turned into per-rank contributions over ``dims`` (this rank's part).

    Forward: the block zero-padded to the contribution's extent, and zeros
    on every rank but group rank 0 of the dimensions the result was
    replicated over (``root_dims``). Backward (the exact adjoint): the
    cotangent's block, broadcast from group rank 0 over ``root_dims``.
    """

    __slots__ = ("out_shape", "rel", "keep", "group")

    def __init__(self, result: Layout, embedded: Layout, root_dims: tuple, mesh):
        shape = MeshShape.of(mesh)
        coord = mesh.coordinate
        self.rel = _rel_slices(result.box(coord, shape), embedded.box(coord, shape))
        self.out_shape = embedded.local_shape(coord, shape)
        self.keep = not root_dims or shape.index(root_dims, coord) == 0
        self.group = mesh.group(root_dims) if root_dims else None

    def forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.out_shape)
        if self.keep:
            _narrow(out, self.rel).copy_(x)
        return out

    def adjoint_raw(self, g: torch.Tensor, C=C) -> torch.Tensor:
        block = _narrow(g, self.rel).contiguous()
        return block if self.group is None else C.broadcast(block, self.group, 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _embed(x, self)

    def traced(self, x: torch.Tensor) -> torch.Tensor:
        return _TracedEmbed.apply(x, self)


class _TracedEmbed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, e):
        ctx.e = e
        return e.forward_raw(x)

    @staticmethod
    def backward(ctx, grad):
        from . import _traced_collectives as TC

        return ctx.e.adjoint_raw(grad, TC), None


_embed = make_mapping("Embed", lambda x, e: e.forward_raw(x), lambda g, e: _embed_adjoint(g, e))
_embed_adjoint = make_mapping("EmbedAdjoint", lambda g, e: e.adjoint_raw(g), lambda d, e: _embed(d, e))
