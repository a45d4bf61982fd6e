"""``einshard_like``: record the ``[param]`` states a formula would record, without running it."""

from __future__ import annotations

import math

import torch

from ..comm.mesh import Mesh, current_mesh, mesh_required, resolve_mesh
from ..core._split import compute_split_shapes
from ..core.policy import resolve_policy
from ..errors import EinshardError
from ..notation import Axis, EllipsisItem, Group, TensorSpec, expand, freeze_families
from ..plan.local import freeze_sizes
from ..plan.stationary import is_stationary, needs_mesh_for_grad, why_mesh
from ..runtime.distributed import plan_distributed
from .formula import check_params_first, recorder_for
from .names import mesh_names, unknown_groups

__all__ = ["einshard_like"]


def _stand_in_shape(spec: TensorSpec, rt, sizes: dict) -> tuple[int, ...]:
    """A local shape consistent with ``sizes``: unknown axes get the mesh size (divisible by any group)."""
    default = math.prod(rt.shape)
    shape = []
    for item in spec.items:
        if isinstance(item, EllipsisItem):
            continue
        size = 1
        for a in item.axes if isinstance(item, Group) else (item,):
            assert isinstance(a, Axis)  # an expanded spec: no families left
            whole = int(sizes.get(a.name, default))
            try:
                size *= compute_split_shapes(whole, rt.size(a.mesh))[rt.index(a.mesh)] if a.mesh else whole
            except ValueError:  # an unknown mesh name: planning reports it as einshard does
                size *= whole
        shape.append(size)
    return tuple(shape)


def _check_names(parsed, names) -> None:
    """Every shard and partial group of the formula is a mesh name, or distinct names joined by '-'."""
    groups = [a.mesh for t in parsed.tensors for a in t.axes if a.mesh] + [g for t in parsed.tensors for g in t.partial]
    unknown = list(dict.fromkeys(unknown_groups(groups, names)))
    if unknown:
        raise EinshardError(f"{parsed.text!r}: the formula references unknown mesh dimensions "
                            f"{', '.join(unknown)}: the mesh has {names!r}")


def _planning_mesh(parsed, mesh, names, sizes, operands):
    """The mesh the formula is planned on: ``mesh`` (or the ambient one), or for a mesh object that only has
    ``mesh_dim_names`` a virtual one of those names; ``None`` for a formula ``einshard`` runs without a mesh
    (stationary, and no operand needs a gradient summed over ranks)."""
    if mesh is not None and not isinstance(mesh, Mesh) and getattr(mesh, "mesh", None) is None and names:
        return Mesh.virtual((2,) * len(names), names)
    if mesh is None and current_mesh() is None:
        if not is_stationary(parsed, tuple((sizes or {}).items())):
            raise mesh_required(repr(parsed.text), why_mesh(parsed))
        grads = [torch.empty(0, device="meta", requires_grad=bool(getattr(t, "requires_grad", False)))
                 for t in operands]  # stand-ins that only say whether the operand needs a gradient
        why = needs_mesh_for_grad(parsed, grads + [torch.empty(0, device="meta")] * (len(parsed.inputs) - len(grads)))
        if why is not None:
            raise mesh_required(repr(parsed.text), why)
        return None
    return resolve_mesh(mesh)


def _check_formula(parsed, mesh, sizes, frozen_families, duties=(), operands=()) -> None:
    """The formula-level errors ``einshard`` would raise, without operand values or sizes."""
    if parsed.is_local:
        return
    names = mesh_names(mesh)
    if names:
        _check_names(parsed, names)
    rt = _planning_mesh(parsed, mesh, names, sizes, operands)
    if rt is None:
        return
    known = dict(sizes or {})
    shapes = [_stand_in_shape(t, rt, known) for t in parsed.inputs]
    plan_distributed(
        parsed, shapes, 4, rt, None, freeze_sizes(sizes), resolve_policy(None, None), frozen_families, duties
    )


def einshard_like(formula, *operands, mesh=None, sizes=None, families=None) -> None:
    """Record the ``[param]`` states ``es.einshard(formula, *operands)`` would record, without running it.

    Operand values and sizes are never read (non-``[param]`` operands may be ``None``);
    formula-level errors are raised as ``einshard`` would, before anything is attached.

    >>> import torch, einshard as es
    >>> w = torch.nn.Parameter(torch.zeros(3, 4))
    >>> einshard_like("b c, c d [param, grad=dp] -> b d", None, w, mesh=es.Mesh.virtual((2,), ("dp",)))
    >>> es.params.get_parameter_state(w).reduce
    ('dp',)
    """
    run = _DISABLED[0] if _DISABLED else _einshard_like_outside_compile()
    return run(formula, *operands, mesh=mesh, sizes=sizes, families=families)


# The mark torch.compiler.disable puts on what it wraps: dynamo does not inline einshard_like into a
# graph (it breaks the graph and calls it), and the body runs behind the real torch.compiler.disable,
# made on first use (importing dynamo at import time would cost a second).
_DISABLE_MSG = "einshard_like records parameter metadata in eager Python"
einshard_like._torchdynamo_disable = True  # type: ignore[attr-defined]  # a function attribute
einshard_like._torchdynamo_disable_msg = _DISABLE_MSG  # type: ignore[attr-defined]
_DISABLED: list = []


def _einshard_like_outside_compile():
    """``einshard_like``'s body behind ``torch.compiler.disable`` (made once)."""
    if not _DISABLED:
        _DISABLED.append(torch.compiler.disable(_einshard_like))
    return _DISABLED[0]


def _einshard_like(formula, *operands, mesh=None, sizes=None, families=None) -> None:
    frozen = freeze_families(families)
    try:
        parsed = expand(formula, frozen)
    except ValueError:
        check_params_first(formula, frozen, operands, mesh_names(mesh))  # [param] metadata errors first
        raise
    recorder = recorder_for(formula, parsed)  # the same preparation es.einshard runs
    prepared = None if recorder is None else recorder.prepare(operands, mesh_names(mesh))
    duties = () if recorder is None else recorder.duties(operands, prepared)
    _check_formula(parsed, mesh, sizes, frozen, duties, operands)
    if recorder is not None:
        recorder.commit(operands, prepared)
