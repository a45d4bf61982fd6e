"""``[param]`` formula operands: their states and rank-local inference.

For each ``[param]`` input of a formula, the operand's spec and annotations
give a state (``ParameterState.from_spec``, source ``formula``). A *pending*
gradient duty (``[param]`` without ``grad=``, or ``grad=async``/``ddp``/``external``)
is inferred by :func:`parameter_operand_state` from the groups of the formula:
the shard groups of the axes the parameter lacks (the other inputs left to
right, then the output; compound groups kept whole, duplicates by exact text
dropped), then the output's partial groups; no group means no duty. The result
is validated (the groups must be disjoint, miss the layout's shards and be
known names).

``es.einshard`` infers this way only when the formula is **rank-local**
(:func:`is_rank_local`): no partial anywhere, every sharded axis occurs in
exactly one input and in the output with the same group, and an axis shared
by two or more inputs is unsharded everywhere. Then each rank computes its
block alone and those groups are exactly the ones the gradient is partial
over. Any other formula keeps the duty pending, and the planner resolves it
when it runs.

>>> import torch
>>> from einshard import parse_sharding
>>> f = parse_sharding("b/dp c, c d [param] -> b/dp d")
>>> w = torch.nn.Parameter(torch.zeros(3, 4))
>>> parameter_operand_state(w, f.inputs, f.output, 1, mesh_dim_names=("dp",)).grad_comm.mesh_dims
('dp',)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..errors import EinshardError
from ..notation import TensorSpec
from .state import ParameterGradComm, ParameterState, check_state
from .store import Registration

__all__ = ["parameter_operand_state", "register_parameter_operand", "is_rank_local"]


def is_rank_local(inputs: Sequence[TensorSpec], output: TensorSpec | None) -> bool:
    """No partial anywhere; sharded axes in exactly one input and the output (same group); shared axes unsharded."""
    if output is None or output.partial or any(t.partial for t in inputs):
        return False
    where: dict[str, list[str | None]] = {}
    for t in inputs:
        for name in {a.name for a in t.axes}:
            where.setdefault(name, [])
        for a in t.axes:
            where[a.name].append(a.mesh)
    out = {a.name: a.mesh for a in output.axes}
    counts = {name: sum(1 for t in inputs if any(a.name == name for a in t.axes)) for name in where}
    for name, groups in where.items():
        sharded = any(groups) or out.get(name) is not None
        if not sharded:
            continue
        if counts[name] != 1 or name not in out or any(g != out[name] for g in groups):
            return False
    return True


def _inferred_groups(inputs, output, index, shards: bool) -> tuple[str, ...]:
    """The shard groups of the axes input ``index`` lacks (``shards``), then the output's partial groups."""
    own = {a.name for a in inputs[index].axes}
    dims: list[str] = []
    if shards:
        others = [t for k, t in enumerate(inputs) if k != index] + ([] if output is None else [output])
        for t in others:
            for a in t.axes:
                if a.mesh and a.name not in own and a.mesh not in dims:
                    dims.append(a.mesh)
    for g in () if output is None else output.partial:
        if g not in dims:
            dims.append(g)
    return tuple(dims)


def parameter_operand_state(
    p, input_specs, output_spec, operand_index, *, mesh_dim_names=(), source="formula", infer_grad=True
) -> ParameterState:
    """The (unattached) state of input ``operand_index`` of a formula.

    ``infer_grad``: ``True`` infers a pending duty from the formula's groups (see the module;
    whether the formula is rank-local or not); ``"partials"`` from the output's partial groups
    only; ``False`` keeps it pending. No group gives no duty (``ParameterGradComm()``); the
    inferred groups are validated (ValueError "grad ... overlap" for overlapping groups).

    >>> from einshard import parse_sharding
    >>> f = parse_sharding("b/dp c, c [param, grad=async] -> b/dp c // sp")
    >>> parameter_operand_state(torch.nn.Parameter(torch.zeros(3)), f.inputs, f.output, 1,
    ...                         mesh_dim_names=("dp", "sp")).grad_comm.mesh_dims
    ('dp', 'sp')
    """
    if not isinstance(p, torch.nn.Parameter):
        raise TypeError(f"operand {operand_index} is annotated [param] and "
                        f"must be a torch.nn.Parameter, got {type(p).__name__}")
    if infer_grad not in (True, False, "partials"):
        raise EinshardError(f"infer_grad must be True, False or 'partials', got {infer_grad!r}")
    state = ParameterState.from_spec(input_specs[operand_index], mesh_dim_names=mesh_dim_names, source=source)
    gc = state.grad_comm
    if not gc.pending_inference or infer_grad is False:
        return state
    dims = _inferred_groups(input_specs, output_spec, operand_index, shards=infer_grad is True)
    state = replace(state, grad_comm=replace(gc, mesh_dims=dims) if dims else ParameterGradComm())
    check_state(state)
    return state


def register_parameter_operand(
    p, input_specs, output_spec, operand_index, *, mesh_dim_names=(), source="formula", infer_grad=True
) -> torch.nn.Parameter:
    """:func:`parameter_operand_state`, then the rank check and registration (merge); returns ``p``."""
    state = parameter_operand_state(
        p, input_specs, output_spec, operand_index, mesh_dim_names=mesh_dim_names, source=source, infer_grad=infer_grad
    )
    reg = Registration()
    reg.add(p, state)
    reg.attach()
    return p
