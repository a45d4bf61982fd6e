"""Gradient duties in local formulas: a use that does not vary over the duty's groups counts once.

A local formula (no ``/``, no ``//``) says that every operand is replicated over every mesh
dimension: each rank computes the same value. Its backward gives each rank the whole gradient, and a
gradient duty over groups ``G`` would sum those copies, counting the use once per rank of ``G``. As in
a distributed formula whose plan replicates the computation (:mod:`einshard.plan.contraction`'s
gradient duties), the gradient is kept on group rank 0 of ``G`` and zeroed elsewhere, so the duty's sum
counts it once: the operand passes through a transition that is the identity forward and one
``keep_root`` step backward (its adjoint, for double backward, is the all-reduce).
"""

from __future__ import annotations

import torch

from ..comm.mesh import Mesh, mesh_required, resolve_mesh
from ..core import _context
from ..core.layout import Layout
from ..errors import EinshardError
from ..plan.contraction import ANY, duty_dims
from ..runtime.execute import transition

__all__ = ["keep_duties_on_root"]


def keep_duties_on_root(formula: str, tensors, duties, mesh) -> tuple:
    """``tensors`` with each operand that has a duty over groups (``duties``, per operand) and needs a
    gradient wrapped so its gradient is kept on group rank 0 of those groups (zeros elsewhere).

    ``mesh``: the call's ``mesh=`` (``None``: the ambient mesh); raises ``EinshardError`` when there is
    none, or when it lacks a duty's group. A pending duty (nothing in a local formula leaves its gradient
    partial) and operands that need no gradient pass through.
    """
    if not torch.is_grad_enabled():
        return tensors
    out = list(tensors)
    resolved = None
    for k, (t, duty) in enumerate(zip(tensors, duties)):
        if duty is None or duty == ANY or not t.requires_grad:
            continue
        if resolved is None:
            resolved = _mesh(formula, k, duty, mesh)
        try:
            dims = duty_dims([duty], resolved.names)[0]
        except EinshardError as err:
            raise EinshardError(f"{formula!r}: {err}") from None
        whole = Layout(tuple(f"_{i}" for i in range(t.dim())), tuple(t.shape), ((),) * t.dim(), (None,) * t.dim())
        out[k] = transition(whole, whole, resolved, back=whole.with_partial(dims))(t)
    return tensors if resolved is None else tuple(out)


def _mesh(formula, k, duty, mesh) -> Mesh:
    if mesh is None and _context.current().mesh is None:
        raise mesh_required(repr(formula), f"operand {k} has a gradient duty over {list(duty)}, and a local formula "
                                           "keeps its gradient on one rank of those groups (every rank computes "
                                           "the same value)")
    return resolve_mesh(mesh)
