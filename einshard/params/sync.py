"""Initial synchronisation: make replicated parameters equal by broadcasting from group rank 0.

For each group in ``state.shared``, in order, ``param.data`` is broadcast in
place from the group's rank 0 (groups of size 1 are skipped; no autograd).
Sync groups never share a component with a shard, so every member of a group
holds a block of the same shape, even under uneven split shapes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import EinshardError
from .names import mesh_names, resolve_group, runtime_mesh, str_tuple
from .state import ParameterInitSync, ParameterState, check_state, derive_init_sync
from .store import Registration, iter_parameter_states, per_name
from .validate import check_resolves

__all__ = ["init_param_", "init_params_", "sync_param_", "sync_module_params_"]


def sync_param_(p, state, mesh) -> torch.nn.Parameter:
    """Broadcast ``p.data`` over each group of ``state.shared`` from group rank 0; returns ``p``.

    >>> import torch, einshard as es
    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> sync_param_(p, es.params.ParameterState.from_layout("c"), None) is p  # nothing shared: no mesh needed
    True
    """
    if not isinstance(state, ParameterState):
        raise TypeError(f"expected a ParameterState, got {type(state).__name__}")
    if not state.shared:
        return p
    rt = runtime_mesh(mesh)
    groups = [resolve_group(rt, g, "init_sync") for g in state.shared]
    with torch.no_grad():
        for group, size in groups:
            if size == 1:
                continue
            data = p.data
            buf = data if data.is_contiguous() else data.contiguous()
            dist.broadcast(buf, group=group, group_src=0)
            if buf is not data:
                data.copy_(buf)
    return p


def sync_module_params_(module, mesh):
    """:func:`sync_param_` for every parameter with a state, in parameter order; returns ``module``."""
    items = list(iter_parameter_states(module))
    for name, _, state in items:
        if not isinstance(state, ParameterState):
            raise TypeError(f"{name!r}: expected a ParameterState, got {type(state).__name__}")
    rt = _runtime(mesh, [state for _, _, state in items])  # every group resolves before the first broadcast
    for _, p, state in items:
        sync_param_(p, state, rt)
    return module


def _init_sync(sync, sharded, names) -> ParameterInitSync:
    if sync is None:
        return derive_init_sync(sharded, names)
    if isinstance(sync, str):
        return ParameterInitSync.from_annotation(sync, sharded, names)
    groups = str_tuple(sync, "sync")
    if not groups:
        raise EinshardError("sync: an empty iterable; explicit mode requires mesh_dims")
    for g in groups:
        ParameterInitSync.from_annotation(g)  # the same value rules (no suffix)
    return ParameterInitSync("explicit", groups)


def _init_state(p, mesh, sync, sharded, names, source) -> ParameterState:
    if not isinstance(p, torch.nn.Parameter):
        raise TypeError(f"init_param_ needs a torch.nn.Parameter, got {type(p).__name__}")
    sharded = str_tuple(sharded, "sharded")
    state = ParameterState(
        None,
        layout_shard_dims=sharded,
        mesh_dim_names=names,
        init_sync=_init_sync(sync, sharded, names),
        source=source,
        explicit_init_sync_none=sync == "none",
    )
    check_state(state)
    return state


def _runtime(mesh, states):
    if not any(s.shared for s in states):
        return None
    try:
        rt = runtime_mesh(mesh)
    except ValueError:
        raise EinshardError("initial sync requires mesh= (the parameter is shared over mesh groups)") from None
    for s in states:
        check_resolves(s, rt, layout=False, grad=False)
        if rt.device_mesh is None and any(rt.size(rt.dims(g)) > 1 for g in s.shared):
            raise EinshardError(f"initial sync over {s.shared!r} needs process groups; a virtual mesh has none")
    return rt


def init_param_(p, mesh, *, sync=None, sharded=(), mesh_dim_names=(), source="init") -> torch.nn.Parameter:
    """Register a layout-free init state (footprint ``sharded``) and broadcast ``p`` over its sync groups.

    ``sync``: ``None`` → every mesh name sharing no component with ``sharded``;
    ``"none"``/``"external"``; a group or an iterable of groups. Returns ``p``.

    >>> import torch, einshard as es
    >>> p = init_param_(torch.nn.Parameter(torch.ones(2)), es.Mesh.virtual((1,), ("dp",)))
    >>> es.params.get_parameter_state(p).init_sync
    ParameterInitSync(mode='inferred', mesh_dims=('dp',))
    """
    names = mesh_names(mesh, mesh_dim_names)
    state = _init_state(p, mesh, sync, sharded, names, source)
    reg = Registration()
    merged = reg.add(p, state)
    rt = _runtime(mesh, [merged])
    reg.attach()
    return sync_param_(p, merged, rt)


def init_params_(module, mesh, *, sync=None, sharded=None, mesh_dim_names=(), source="init"):
    """:func:`init_param_` for every parameter of ``module`` (build and check all, attach all, then sync).

    ``sync``/``sharded``: one value, or mappings keyed by ``named_parameters()`` names. Returns ``module``.

    >>> import torch, einshard as es
    >>> lin = es.params.register_linear_parameters_(torch.nn.Linear(3, 4), weight_layout="out/tp in")
    >>> _ = init_params_(lin, es.Mesh.virtual((1, 1), ("dp", "tp")))
    >>> es.params.get_parameter_state(lin.weight).init_sync.mesh_dims
    ('dp',)
    """
    if isinstance(module, torch.nn.Parameter):
        return init_param_(module, mesh, sync=sync, sharded=sharded, mesh_dim_names=mesh_dim_names, source=source)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"init_params_ needs an nn.Module or a Parameter, got {type(module).__name__}")
    params = dict(module.named_parameters())
    names = mesh_names(mesh, mesh_dim_names)
    syncs = per_name(sync, list(params), "sync")
    shardeds = per_name(sharded, list(params), "sharded")
    reg = Registration()
    merged = {}
    for name, p in params.items():
        try:
            merged[name] = reg.add(p, _init_state(p, mesh, syncs[name], shardeds[name], names, source), name)
        except ValueError as err:
            raise EinshardError(f"parameter {name!r}: {err}") from None
    rt = _runtime(mesh, list(merged.values()))
    reg.attach()
    for name, p in params.items():
        sync_param_(p, merged[name], rt)
    return module
