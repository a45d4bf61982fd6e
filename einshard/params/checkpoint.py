"""Modules ↔ DTensors, from the registered layouts: ``es.params.to_dtensor`` / ``es.params.from_dtensor``.

A parameter's registered layout gives its DTensor placements: ``Shard(i)`` on
every mesh dimension among the components of item ``i``'s group (in mesh
order), ``Replicate()`` elsewhere; a gradient duty is never a placement. The
blocks of a DTensor follow ``torch.chunk``'s split rule, which can differ from
einshard's (``compute_split_shapes``) when a size does not divide evenly, so
both directions move data where the two rules disagree: the real split shapes
are read from the ranks' block sizes (one small all-gather), never assumed.

That makes ``torch.distributed.checkpoint`` (DCP) work on einshard models:
save ``to_dtensor(model)`` on one mesh, load into ``to_dtensor(other)`` on
another (DCP reshards), then copy ``from_dtensor(...)`` into the parameters.
"""

from __future__ import annotations

import torch

from ..errors import EinshardError
from ..notation import expand
from ..plan.resolve import resolve
from ..spmd.dtensor import from_dtensor as unwrap
from ..spmd.dtensor import is_dtensor
from ..spmd.dtensor import to_dtensor as wrap
from ..spmd.tree import discover_splits, map_leaves, prepare_tree
from .metadata import record_global_shape_, recorded_global_shape
from .specs import as_param_tree, param_specs, specs_or_registered

__all__ = ["to_dtensor", "from_dtensor", "load_from_dtensor_"]


def to_dtensor(module_or_state_dict, specs=None, *, mesh=None):
    """Every parameter with a layout as a ``DTensor`` (global shape, placements from its layout).

    Returns a state dict (or the same pytree) whose laid-out tensors are DTensors on
    ``mesh``'s ``DeviceMesh``; other entries (buffers, step counters) pass through.
    Uneven blocks are read from the ranks and moved to ``torch.chunk``'s split where
    the rules differ. No autograd.

    >>> import torch.distributed.checkpoint as dcp                            # doctest: +SKIP
    >>> dcp.save(es.params.to_dtensor(model, mesh=mesh), checkpoint_id="ckpt")      # doctest: +SKIP
    """
    mesh, leaves, treedef, per_leaf, names = prepare_tree(module_or_state_dict, specs, mesh, None, "to_dtensor")
    if mesh.device_mesh is None:
        raise EinshardError("to_dtensor: a virtual mesh cannot hold DTensors; "
                            "pass the DeviceMesh (or es.wrap_mesh of it)")
    found = discover_splits(mesh, leaves, per_leaf)

    def as_dtensor(k, x, spec):
        if spec.inner_spec.has_groups or spec.inner_spec.partial:
            raise EinshardError(f"to_dtensor: {names[k]!r} has layout {spec.inner!r}; DTensors need plain axes")
        formula = expand(f"{spec.inner} -> {spec.inner}", ())
        layout = resolve(formula, [tuple(x.shape)], mesh, shapes=found.get(k), axes=None).operands[0]
        return wrap(x.detach(), layout, mesh, where=f"to_dtensor {names[k]!r}")

    return map_leaves(treedef, leaves, per_leaf, as_dtensor)


def from_dtensor(state, module_or_specs=None, *, mesh=None):
    """This rank's blocks (einshard's split shapes) of the DTensors in ``state``.

    ``module_or_specs``: the module whose registered layouts say where each entry
    goes (its ``state_dict`` names), or a spec pytree; default: the layouts
    registered on ``state``'s own parameters. With a module, every block's shape
    is checked against the parameter's.

    >>> local = es.params.from_dtensor(loaded, model, mesh=mesh)   # doctest: +SKIP
    """
    module = module_or_specs if isinstance(module_or_specs, torch.nn.Module) else None
    if module is not None:
        specs = param_specs(as_param_tree(module))
        specs = {k: specs.get(k) for k in as_param_tree(state)} if isinstance(state, dict) else specs
    else:
        specs = module_or_specs
    if specs is None:
        specs = specs_or_registered(as_param_tree(state), None, "from_dtensor")
    mesh, leaves, treedef, per_leaf, names = prepare_tree(state, specs, mesh, None, "from_dtensor")
    targets = module.state_dict(keep_vars=True) if module is not None else {}

    def block(k, x, spec):
        local, _ = unwrap(x, spec.inner, mesh, where=f"from_dtensor {names[k]!r}")
        want = targets.get(names[k])
        if want is not None and tuple(want.shape) != tuple(local.shape):
            raise EinshardError(
                f"from_dtensor: {names[k]!r} gives a block of shape {tuple(local.shape)} on this rank but the "
                f"parameter has shape {tuple(want.shape)}; was it built with einshard's split shapes?"
            )
        return local.detach().clone()

    return map_leaves(treedef, leaves, per_leaf, block, accept=is_dtensor)


def load_from_dtensor_(module, state, *, mesh=None):
    """Copy ``from_dtensor(state, module)`` into ``module``'s parameters and buffers in place; returns ``module``.

    >>> dcp.load(sd := es.params.to_dtensor(model, mesh=mesh), checkpoint_id="ckpt")  # doctest: +SKIP
    >>> es.params.load_from_dtensor_(model, sd, mesh=mesh)                              # doctest: +SKIP
    """
    local = from_dtensor(state, module, mesh=mesh)
    targets = module.state_dict(keep_vars=True)
    unknown = [k for k in local if k not in targets]
    if unknown:
        raise EinshardError(f"load_from_dtensor_: entries {unknown} are not in the module's state_dict")
    records = [(targets[name], tuple(x.shape)) for name, x in (state.items() if isinstance(state, dict) else ())
               if is_dtensor(x) and isinstance(targets.get(name), torch.nn.Parameter)]  # the DTensors' global shapes
    for p, shape in records:
        known = recorded_global_shape(p)
        if known is not None and known != shape:
            raise EinshardError(f"load_from_dtensor_: a DTensor of global shape {shape} for a parameter whose "
                                f"recorded global shape is {known}")
    with torch.no_grad():
        for name, value in local.items():
            if isinstance(value, torch.Tensor):
                targets[name].copy_(value)
    for p, shape in records:
        record_global_shape_(p, shape)
    return module
