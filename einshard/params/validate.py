"""Finalising pending gradient duties, and validating a module's attached states.

A ``[param]`` annotation without ``grad=`` (or with ``grad=ddp``/``external``/``async``)
leaves the gradient duty *pending inference* when the formula alone cannot
tell which groups the gradient is partial over. ``finalize_*`` names them;
``validate_module_parameter_states_`` checks everything before training starts.

>>> import torch, einshard as es
>>> p = torch.nn.Parameter(torch.zeros(3))
>>> _ = es.params.register_parameter_state(p, es.params.ParameterState.from_spec("c [param]", mesh_dim_names=("dp",)))
>>> _ = finalize_parameter_grad_comm_(p, "dp")
>>> es.params.get_parameter_state(p).grad_comm.mesh_dims
('dp',)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..core import _context
from ..errors import EinshardError
from .names import mesh_names, resolve_dims, runtime_mesh
from .state import ParameterGradComm, ParameterState, check_rank, check_state
from .store import Registration, get_parameter_state

__all__ = [
    "finalize_parameter_grad_comm_",
    "finalize_module_parameter_grad_comm_",
    "validate_module_parameter_states_",
    "check_resolves",
    "check_not_pending",
]


def check_not_pending(state: ParameterState, where: str) -> None:
    """ValueError "pending inference" for a pending native/ddp gradient duty."""
    g = state.grad_comm
    if g.pending_inference and g.backend in ("native", "ddp"):
        raise EinshardError(
            f"{where}: the gradient duty is pending inference (grad={g.backend!r} without groups); "
            "name its groups with finalize_parameter_grad_comm_ or annotate grad=G"
        )


def check_resolves(state: ParameterState, mesh, *, layout: bool = True, init: bool = True, grad: bool = True) -> None:
    """Every group that will run on ``mesh`` (an ``es.Mesh``) resolves there (ValueError naming the group)."""
    groups = []
    if layout:
        groups += [("layout", g) for g in state.layout_shard_dims]
    if init:
        groups += [("init_sync", g) for g in state.shared]
    if grad and state.grad_comm.backend in ("native", "ddp"):
        groups += [("grad", g) for g in state.grad_comm.mesh_dims]
    for what, g in groups:
        resolve_dims(mesh, g, what)


def _finalized_state(p, grad, names, mesh) -> ParameterState:
    if not isinstance(p, torch.nn.Parameter):
        raise TypeError(f"p must be a torch.nn.Parameter, got {type(p).__name__}")
    if not isinstance(grad, str):
        raise TypeError(f"grad must be a str like 'dp' or 'dp:async', got {type(grad).__name__}")
    state = get_parameter_state(p)
    if state is None:
        raise EinshardError("the parameter has no ParameterState to finalise")
    if not state.grad_comm.pending_inference:
        raise EinshardError(f"the gradient duty is not pending inference ({state.grad_comm!r})")
    new = ParameterGradComm.from_annotation(grad)
    if new.mode != "explicit":
        raise EinshardError(f"finalising needs an explicit mesh group like 'dp' or 'dp:async', got {grad!r}")
    if new.backend != state.grad_comm.backend:
        raise EinshardError(
            f"grad={grad!r} has backend {new.backend!r} but the pending duty's backend is {state.grad_comm.backend!r}"
        )
    if names and state.mesh_dim_names and names != state.mesh_dim_names:
        raise EinshardError(f"mesh names {names!r} differ from the state's {state.mesh_dim_names!r}")
    if mesh is not None and new.backend in ("native", "ddp"):
        for g in new.mesh_dims:
            resolve_dims(mesh, g, "grad")
    return replace(state, grad_comm=new, mesh_dim_names=names or state.mesh_dim_names)


def _names_and_mesh(mesh, mesh_dim_names):
    names = mesh_names(mesh, mesh_dim_names)
    if mesh is None:
        mesh = _context.current().mesh
    return names, (None if mesh is None else runtime_mesh(mesh))


def finalize_parameter_grad_comm_(p, grad, *, mesh=None, mesh_dim_names=()) -> torch.nn.Parameter:
    """Replace a pending gradient duty by ``G``, ``G:async``, ``G:ddp`` or ``G:external``; returns ``p``."""
    names, rt = _names_and_mesh(mesh, mesh_dim_names)
    reg = Registration()
    reg.add(p, _finalized_state(p, grad, names, rt))
    reg.attach()
    return p


def finalize_module_parameter_grad_comm_(module, grad, *, mesh=None, mesh_dim_names=()):
    """Finalise several parameters: ``grad`` maps parameter names to values; all or nothing. Returns ``module``.

    >>> import torch, einshard as es
    >>> lin = torch.nn.Linear(3, 2)
    >>> _ = es.params.register_parameter_state(lin.weight, es.params.ParameterState.from_spec("o i [param]"))
    >>> _ = finalize_module_parameter_grad_comm_(lin, {"weight": "dp:async"})
    >>> es.params.get_parameter_state(lin.weight).grad_comm.schedule
    'async'
    """
    if not isinstance(grad, Mapping):
        raise TypeError(f"grad must be a Mapping from parameter names to values, got {type(grad).__name__}")
    if not grad:
        raise EinshardError("grad is empty: name at least one parameter")
    names, rt = _names_and_mesh(mesh, mesh_dim_names)
    reg = Registration()
    for name, value in grad.items():
        if not isinstance(name, str) or not name:
            raise EinshardError(f"parameter names must be non-empty str, got {name!r}")
        try:
            p = module.get_parameter(name)
        except AttributeError:
            raise EinshardError(f"unknown parameter name {name!r}") from None
        try:
            reg.add(p, _finalized_state(p, value, names, rt), name)
        except ValueError as err:
            raise EinshardError(f"parameter {name!r}: {err}") from None
    reg.attach()
    return module


def validate_module_parameter_states_(module, mesh=None, *, allow_pending=False):
    """Check every attached state (well-formed, rank, invariants, no pending native/ddp duty); returns ``module``.

    With ``mesh``, its names must equal the states' names (when they have any) and every group must resolve.
    Any failure is ``ValueError("Invalid parameter metadata for '<name>': <cause>")``.

    >>> import torch, einshard as es
    >>> lin = es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in")
    >>> validate_module_parameter_states_(lin, es.Mesh.virtual((2, 4), ("dp", "tp"))) is lin
    True
    """
    rt = None if mesh is None else runtime_mesh(mesh)
    mesh_dims = () if mesh is None else mesh_names(mesh)
    seen = set()
    for name, p in module.named_parameters():
        state = get_parameter_state(p)
        if state is None or id(p) in seen:
            continue
        seen.add(id(p))
        try:
            check_state(state)
            check_rank(state, p.dim())
            if not allow_pending:
                check_not_pending(state, "validation")
            if rt is not None:
                if state.mesh_dim_names and state.mesh_dim_names != mesh_dims:
                    raise EinshardError(f"the state's mesh names {state.mesh_dim_names!r} "
                                        f"differ from the mesh's {mesh_dims!r}")
                check_resolves(state, rt)
        except (ValueError, TypeError) as err:
            raise EinshardError(f"Invalid parameter metadata for {name!r}: {err}") from None
    return module
