"""Merging two parameter states: the attached (or accumulated) one ``E`` and a new one ``N``.

Every registration path merges. Conflicts raise ``ValueError("incompatible
metadata ...")``; the result is revalidated, and when nothing changed the
attached object itself is returned.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import EinshardError
from .names import components
from .state import ParameterState, check_state, derive_init_sync, derive_tensor_state

__all__ = ["merge_states"]


def _conflict(what: str, e, n) -> ValueError:
    return EinshardError(f"incompatible metadata: {what} (attached {e!r}, new {n!r})")


def _footprint(groups) -> frozenset[str]:
    return frozenset(groups) | frozenset(c for g in groups for c in components(g))


def _merge_store(e: ParameterState, n: ParameterState):
    """The storage group: equal ones, or one side's; a stored layout takes a plain one that is its compute layout."""
    if e.store is not None and n.store is not None and e.store != n.store:
        raise _conflict("different storage groups (store=)", e.store, n.store)
    return e.store if e.store is not None else n.store


def _merge_layout(e: ParameterState, n: ParameterState):
    for stored, plain in ((e, n), (n, e)):  # the compute layout of a stored parameter, registered again
        if stored.store is not None and plain.store is None and plain.spec is not None:
            if plain.layout == stored.compute_layout:
                return stored.spec, stored.layout_shard_dims
    if e.spec is not None and n.spec is not None:
        if e.spec.items != n.spec.items:
            raise _conflict("different layout", e.layout, n.layout)
        return e.spec, e.layout_shard_dims
    for free, other in ((e, n), (n, e)):
        if free.spec is None and free.layout_shard_dims:
            if other.spec is not None or other.layout_shard_dims:
                if _footprint(free.layout_shard_dims) != _footprint(other.layout_shard_dims):
                    raise _conflict(
                        "different sharded mesh footprint", e.layout_shard_dims, n.layout_shard_dims
                    )
    if e.spec is not None:
        return e.spec, e.layout_shard_dims
    if n.spec is not None:
        return n.spec, n.layout_shard_dims
    return None, e.layout_shard_dims or n.layout_shard_dims


def _opt_outs(e: ParameterState, n: ParameterState, field: str, label: str):
    """The steps both duties share (``none`` and explicit ``none``); ``None`` when both sides have a duty."""
    ev, nv = getattr(e, field), getattr(n, field)
    if getattr(n, f"explicit_{field}_none"):
        if ev.mode != "none":
            raise _conflict(f"{label}='none' against an attached duty", ev, nv)
        return nv
    if nv.mode == "none":
        return ev
    if ev.mode == "none":
        if getattr(e, f"explicit_{field}_none"):
            raise _conflict(f"{label} was set to 'none'", ev, nv)
        return nv
    return None


def _merge_init_sync(e: ParameterState, n: ParameterState):
    es_, ns_ = e.init_sync, n.init_sync
    decided = _opt_outs(e, n, "init_sync", "init_sync")
    if decided is not None:
        return decided
    if ns_.mode == "inferred":  # an inferred one never overrides the attached one
        return es_
    same = es_ == ns_ or ("external" not in (es_.mode, ns_.mode) and es_.mesh_dims == ns_.mesh_dims)
    if not same:
        raise _conflict("different init_sync", es_, ns_)
    return es_


def _merge_grad_comm(e: ParameterState, n: ParameterState):
    eg, ng = e.grad_comm, n.grad_comm
    decided = _opt_outs(e, n, "grad_comm", "grad")
    if decided is not None:
        return decided
    if eg.backend != ng.backend:
        raise _conflict("different grad backends", eg.backend, ng.backend)
    if eg.schedule != ng.schedule and "backend_default" not in (eg.schedule, ng.schedule):
        raise _conflict("different grad schedules", eg.schedule, ng.schedule)
    schedule = ng.schedule if eg.schedule == "backend_default" else eg.schedule
    if eg.pending_inference and ng.pending_inference:
        result = eg
    elif eg.pending_inference or ng.pending_inference:
        concrete, pending = (ng, eg) if eg.pending_inference else (eg, ng)
        result = concrete if concrete.mode == "explicit" else pending
    else:
        if eg.mesh_dims != ng.mesh_dims:
            raise _conflict("different grad groups", eg.mesh_dims, ng.mesh_dims)
        result = eg
    return replace(result, schedule=schedule) if result.schedule != schedule else result


def _merge_names(e: ParameterState, n: ParameterState):
    if e.mesh_dim_names and n.mesh_dim_names and e.mesh_dim_names != n.mesh_dim_names:
        raise _conflict("different mesh_dim_names", e.mesh_dim_names, n.mesh_dim_names)
    return e.mesh_dim_names or n.mesh_dim_names


def _merge_global_shape(e: ParameterState, n: ParameterState):
    if e.global_shape is not None and n.global_shape is not None and e.global_shape != n.global_shape:
        raise _conflict("different global shape", e.global_shape, n.global_shape)
    return e.global_shape if e.global_shape is not None else n.global_shape


def merge_states(e: ParameterState | None, n: ParameterState) -> ParameterState:
    """Merge ``n`` into ``e`` (either may come from any registration path); ``e`` itself if unchanged.

    >>> from einshard.params import ParameterState
    >>> a = ParameterState.from_layout("out/tp in", mesh_dim_names=("dp", "tp"))
    >>> b = ParameterState.from_layout("out/tp in", grad="dp")
    >>> merge_states(a, b).grad_comm.mesh_dims, merge_states(a, a) is a
    (('dp',), True)
    """
    if e is None:
        check_state(n)
        return n
    spec, shard_dims = _merge_layout(e, n)
    names = _merge_names(e, n)
    init_sync = _merge_init_sync(e, n)
    if init_sync.mode == "inferred":  # the merged shards and names decide what it covers
        init_sync = derive_init_sync(shard_dims, names)
    tensor_state = derive_tensor_state(spec, names)
    merged = ParameterState(
        spec=spec,
        tensor_state=tensor_state,
        layout_shard_dims=shard_dims,
        mesh_dim_names=names,
        init_sync=init_sync,
        grad_comm=_merge_grad_comm(e, n),
        source=e.source,
        explicit_init_sync_none=e.explicit_init_sync_none or n.explicit_init_sync_none,
        explicit_grad_comm_none=e.explicit_grad_comm_none or n.explicit_grad_comm_none,
        global_shape=_merge_global_shape(e, n),
        store=_merge_store(e, n),
    )
    check_state(merged)
    return e if merged == e else merged
