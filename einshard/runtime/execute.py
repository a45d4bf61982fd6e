"""Running planned transitions on one rank, as autograd Functions.

:func:`compile_step` binds a rank-independent :class:`~einshard.plan.transition.Step`
to this rank's coordinate and process groups. :class:`Transition` runs a
whole transition; its backward is the reverse transition (itself a
``Transition``), so gradients are exact adjoints and double backward works.
"""

from __future__ import annotations

import copy

import torch

from ..comm import _traced_collectives as TC
from ..comm import checks as _checks
from ..comm import collectives as C
from ..comm import collectives as _eager_collectives
from ..comm.exchange import runs_exchange
from ..comm.grad_sums import leaf_sum
from ..comm.mappings import mapping_forms
from ..comm.primitives import PRIMITIVES, Site
from ..core import _torch_compat
from ..core._cache import BoundedCache
from ..core._torch_compat import in_traced_code
from ..core.layout import Layout, MeshShape
from ..plan.transition import Step, plan_gradient, plan_transition

_transforms_active = _torch_compat.functorch_transforms_active

__all__ = ["Transition", "compile_step", "transition"]


def compile_step(step, mesh, C=C):
    """A callable ``x -> y`` running ``step`` on this rank (its primitive's ``run``).

    ``C``: the collectives to call, :mod:`einshard.comm.collectives` (eager) or
    :mod:`einshard.comm._traced_collectives` (under ``torch.compile``).
    """
    run = PRIMITIVES[step.kind].run
    assert run is not None, step.kind  # every step kind the planner makes runs
    return run(step, Site(mesh, C, _exchange))


def _exchange(src: Layout, dst: Layout, dims, mesh, C):
    """The general exchange of a transition step ``src -> dst`` over ``dims`` (the ``exchange`` primitive's run)."""
    ex = runs_exchange(src, dst, dims, mesh)
    return ex.run if C is _eager_collectives else ex.run_traced


class Transition:
    """A compiled ``src -> dst`` transition on this rank; call it on a local tensor."""

    __slots__ = ("src", "dst", "mesh", "shape", "planned", "steps", "traced_steps", "_reverse", "trivial", "back",
                 "_owning", "sum_dims")

    def __init__(self, src: Layout, dst: Layout, mesh, steps=None, back: Layout | None = None):
        self.src, self.dst, self.mesh = src, dst, mesh
        # the layout the gradient goes back to: ``src``, or ``src`` left partial for a gradient duty
        self.back = src if back is None else back
        self.shape = MeshShape.of(mesh)
        planned = plan_transition(src, dst, self.shape) if steps is None else steps
        self.planned = tuple(planned)
        self.steps = [compile_step(s, mesh) for s in planned]
        self.traced_steps: tuple | None = None  # built by prepare_traced (when a plan is first traced)
        self._reverse: Transition | None = None
        self._owning: Transition | None = None
        # the steps of the backward: the reverse transition, or the gradient left partial for its duty
        back_steps = (plan_transition(dst, src, self.shape) if self.back == src
                      else plan_gradient(dst, self.back, self.shape))
        # no forward steps and no backward steps: autograd needs nothing either (the gradient passes as it is,
        # also where it stays partial for a duty: ``w -> w // dp`` with the duty over dp)
        self.trivial = not self.steps and not back_steps
        # no forward steps and one all-reduce back (a replicated operand used as per-rank data, ``w -> w // dp``):
        # a pvary, whose sum into a leaf may wait for the end of backward (einshard.comm.grad_sums.leaf_sum)
        self.sum_dims = None
        if not self.steps and self.back == src and len(back_steps) == 1 and back_steps[0].kind == "all_reduce":
            self.sum_dims = back_steps[0].dims

    def reverse(self) -> Transition:
        if self._reverse is None:
            if self.back == self.src:
                self._reverse = transition(self.dst, self.src, self.mesh)
                self._reverse._reverse = self
            else:  # a gradient left partial for its duty (uncached: its own reverse is the plain one)
                rev = Transition(self.dst, self.back, self.mesh, plan_gradient(self.dst, self.back, self.shape))
                rev._reverse = transition(self.back, self.dst, self.mesh)
                self._reverse = rev
        return self._reverse

    def owning(self) -> Transition:
        """This transition for a tensor nobody else reads (a contraction's fresh result).

        A leading all-reduce then sums into the tensor itself, as hand-written
        tensor-parallel code does, instead of into a copy; the backward is the
        same. ``self`` when the transition does not start with an all-reduce.
        """
        if self._owning is None:
            self._owning = self
            if self.planned and self.planned[0].kind == "all_reduce":
                owning = copy.copy(self)
                group = self.mesh.group(self.planned[0].dims)
                owning.steps = [lambda x: C.all_reduce_owned(x, group)] + self.steps[1:]
                owning._reverse = self.reverse()
                owning._owning = owning
                self._owning = owning
        return self._owning

    def run_raw(self, x: torch.Tensor) -> torch.Tensor:
        if _checks.ENABLED:  # agreed once per operation, not per collective
            with _checks.planned():
                for step in self.steps:
                    x = step(x)
            return x
        for step in self.steps:
            x = step(x)
        return x

    def prepare_traced(self) -> Transition:
        """Build the functional-collective steps of this transition and of its reverse (for backward)."""
        for t in (self, self.reverse()):
            if t.traced_steps is None:
                t.traced_steps = tuple(compile_step(s, t.mesh, TC) for s in t.planned)
        return self

    def run_traced(self, x: torch.Tensor) -> torch.Tensor:
        assert self.traced_steps is not None  # prepare_traced ran
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
        if in_traced_code():  # dynamo traces this call: the functional steps (prepared at trace time)
            return _TracedTransition.apply(x, self)
        if not (x.requires_grad and torch.is_grad_enabled()) and not _transforms_active():
            return self.run_raw(x)  # no backward will run: skip the autograd Function
        if self.sum_dims is not None and not _transforms_active():
            return self._summed(x, _apply_transition)
        return _apply_transition(x, self)

    def _summed(self, x: torch.Tensor, apply) -> torch.Tensor:
        """A pvary (no forward step, one all-reduce back) on ``x``, which needs a gradient: a leaf's sum waits for
        the end of backward (:func:`~einshard.comm.grad_sums.leaf_sum`), a gathered ZeRO block's gather sums it;
        else ``apply(x, self)``, the autograd mapping."""
        if x.is_leaf:
            return leaf_sum(x, self.mesh.group(self.sum_dims))
        deferred = getattr(x, "einshard_pvary", None)  # a gathered ZeRO block: its gather sums it
        y = None if deferred is None else deferred(self.sum_dims)
        if y is not None:
            return y
        return apply(x, self)

    def eager(self, grad: bool):
        """This transition as a replay runs it once it has checked, for the whole call, that checks are off, no
        ``torch.func`` transform is active and dynamo does not trace it: ``x -> y`` for an operand that needs a
        gradient (``grad``: grad mode is on and the operand requires grad) or not. The same steps and autograd
        node as :meth:`__call__`, without its per-call tests."""
        if not grad:
            return self.run_raw
        if self.sum_dims is not None:
            return lambda x: self._summed(x, _eager_transition)
        return lambda x: _eager_transition(x, self)


_TRANSITIONS = BoundedCache(16384, name="einshard.runtime.execute.transitions")


def transition(src: Layout, dst: Layout, mesh, back: Layout | None = None) -> Transition:
    """The compiled transition ``src -> dst`` for this rank (cached).

    ``back``: the layout its backward returns the gradient in (default ``src``).
    """
    key = (src, dst, id(mesh), mesh.coordinate, back)
    found = _TRANSITIONS.get(key)
    if found is None or found.mesh is not mesh:
        found = _TRANSITIONS.put(key, Transition(src, dst, mesh, back=back))
    return found


def _run_transition(x: torch.Tensor, ex: Transition) -> torch.Tensor:
    if not ex.steps:  # nothing moves forward (a pvary): the autograd node's own view of x
        return x.view_as(x)
    y = ex.run_raw(x)
    return x.view_as(x) if y is x else y


def _adjoint(grad: torch.Tensor, ex: Transition) -> torch.Tensor:
    """The backward of ``ex``: its reverse transition, as raw steps where no gradient of the gradient is tracked."""
    rev = ex.reverse()
    if grad.requires_grad or _transforms_active() or in_traced_code():  # double backward, torch.func, compiled
        return rev(grad)
    return rev.run_raw(grad)


# backward: the reverse transition (itself a Transition, so double backward works)
_apply_transition, _eager_transition = mapping_forms("Transition", _run_transition, _adjoint)


class _TracedTransition(torch.autograd.Function):
    """A transition under ``torch.compile``: functional collectives forward, the reverse transition backward."""

    @staticmethod
    def forward(ctx, x, ex):
        ctx.ex = ex
        y = ex.run_traced(x)
        return x.view_as(x) if y is x else _torch_compat.traced_function_result(y)

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
    rev = Transition(embedded, result, mesh, (Step("embed_adjoint", embedded, result, root_dims),))
    rev._reverse, fwd._reverse = fwd, rev
    return fwd.prepare_traced()
