"""Whole model states ↔ sharded ones: ``es.tree_shard`` and ``es.tree_gather``.

For checkpoints: a state dict, an optimizer state, any pytree of tensors.
``specs`` is a pytree prefix of the tree (optree rules, as for
``shard_map``): a spec string at a node applies to every tensor below it,
``None`` passes a subtree through, and non-tensor leaves (step counters,
hyper-parameters) pass through.

- ``tree_shard(tree, specs, mesh=...)``: every rank holds the whole tensors
  (e.g. just loaded); returns this rank's blocks. Sharding is slicing: no
  communication. A partial spec (``// d``) puts the whole value on the first
  rank of ``d`` and zeros on the others, so the sum over ``d`` is the value.
- ``tree_gather(tree, specs, mesh=...)``: every rank holds its blocks;
  returns the whole tensors on every rank (all-gathers; sums over partial
  dimensions). Uneven split shapes need no ``shapes=``: the ranks exchange
  their block sizes in one small all-gather for the whole tree.

``tree_gather(tree_shard(t, specs), specs) == t`` exactly. Both run without
autograd and return plain tensors (``nn.Parameter`` leaves come back as
tensors, as in a ``state_dict``). ``DTensor`` leaves are accepted too.
"""

from __future__ import annotations

import dataclasses
import math

import optree
import torch

from ..comm import collectives as C
from ..comm.mesh import resolve_mesh, wrap_mesh
from ..core.layout import MeshShape
from ..errors import EinshardError
from ..notation import EllipsisItem, Group, expand
from ..ops.einshard import einshard
from ..params.metadata import record_global_shape_, recorded_global_shape
from ..params.specs import as_param_tree, specs_or_registered
from ._specs import match, shapes_subset, sizes_for, sizes_subset, spec_tree
from ._specs import maybe_dtensor as is_dtensor
from ._specs import strip_spec as _strip
from .dtensor import from_dtensor

__all__ = ["tree_shard", "tree_gather", "prepare_tree", "map_leaves", "discover_splits"]


def prepare_tree(tree, specs, mesh, families, where):
    """``(mesh, leaves, treedef, per-leaf spec, per-leaf dotted name)`` of a tree (or module) and its specs.

    A module becomes its ``state_dict(keep_vars=True)``; without ``specs`` the
    parameters' registered layouts are used.
    """
    tree = as_param_tree(tree)
    specs = specs_or_registered(tree, specs, where)
    mesh = wrap_mesh(resolve_mesh(mesh))
    spec_leaves, spec_def = spec_tree(specs, families, "specs", "in")
    for s in spec_leaves:
        if s is not None and s.conversion:
            raise EinshardError(f"{where}: specs are layouts, not conversions; got {s.text!r}")
    paths, leaves, treedef = optree.tree_flatten_with_path(tree, none_is_leaf=True)
    per_leaf = match(spec_leaves, spec_def, tree, "specs", "tree", specs)
    return mesh, leaves, treedef, per_leaf, [".".join(map(str, path)) for path in paths]


def map_leaves(treedef, leaves, per_leaf, fn, accept=None):
    """The tree rebuilt from ``fn(k, x, spec)`` on every leaf with a spec that is a tensor (or passes
    ``accept``); other leaves pass through. Runs without autograd."""
    accept = accept or (lambda x: isinstance(x, torch.Tensor))
    with torch.no_grad():
        out = [
            x if spec is None or not accept(x) else fn(k, x, spec) for k, (x, spec) in enumerate(zip(leaves, per_leaf))
        ]
    return treedef.unflatten(out)


def tree_shard(tree, specs=None, *, mesh=None, shapes=None, sizes=None, families=None):
    """This rank's blocks of the whole tensors in ``tree``, laid out as ``specs``.

    ``tree`` may be a module (its ``state_dict(keep_vars=True)``); without
    ``specs`` the parameters' registered layouts are used (``es.params.param_specs``).

    >>> specs = {"w1": "f/tp c", "b1": "f/tp", "w2": "c f/tp", "b2": "c"}      # doctest: +SKIP
    >>> local = es.tree_shard(torch.load("ckpt.pt"), specs, mesh=mesh)        # doctest: +SKIP
    >>> local = es.tree_shard(torch.load("ckpt.pt"), es.params.param_specs(model), mesh=mesh)  # doctest: +SKIP
    """
    mesh, leaves, treedef, per_leaf, names = prepare_tree(tree, specs, mesh, families, "tree_shard")
    records = _whole_shapes(leaves, per_leaf, names)  # checked before anything runs, recorded after

    def shard(k, x, spec):
        parsed = spec.inner_spec
        target = dataclasses.replace(parsed, partial=())
        pdims = [d for p in parsed.partial for d in mesh.dims(p)]
        zero = bool(pdims) and mesh.index(_sorted(mesh, pdims)) != 0
        if is_dtensor(x):
            # whole over the partial dimensions first (a Partial DTensor is summed), then the value on
            # their first rank and zeros on the others, as for plain tensors
            local, _ = from_dtensor(x, str(target), mesh, shapes=shapes, sizes=sizes, families=families)
            return torch.zeros_like(local) if zero else local.detach().clone()
        formula = f"{_strip(parsed)} -> {target}"
        parsed_formula = expand(formula, families)
        y = einshard(formula, x.detach(), mesh=mesh, shapes=shapes_subset(parsed_formula, shapes),
                     sizes=sizes_subset(parsed_formula, sizes, families), families=families)
        return (torch.zeros_like(y) if zero else y).clone(memory_format=torch.contiguous_format)

    out = map_leaves(treedef, leaves, per_leaf, shard)
    for p, shape in records:
        record_global_shape_(p, shape)
    return out


def _whole_shapes(leaves, per_leaf, names) -> list:
    """``(parameter, whole shape)`` to record: the parameters the specs come from (``es.params.param_specs``) and
    the Parameter leaves with a layout; a whole value whose shape differs from a recorded one is an error."""
    records: list = []
    for k, (x, spec) in enumerate(zip(leaves, per_leaf)):
        if spec is None or not isinstance(x, torch.Tensor):
            continue
        shape = tuple(x.shape)
        owners = [getattr(spec.text, "param", None), x if isinstance(x, torch.nn.Parameter) else None]
        known = getattr(spec.text, "global_shape", None)
        for p in owners:
            if p is not None and recorded_global_shape(p) is not None:
                known = known or recorded_global_shape(p)
        if known is not None and tuple(known) != shape:
            raise EinshardError(
                f"tree_shard: {names[k]!r} is a whole value of shape {shape}, but its parameter's recorded global "
                f"shape is {tuple(known)}; tree_shard takes whole tensors (this rank's blocks come out)"
            )
        records.extend((p, shape) for p in owners if p is not None)
    return records


def _sorted(mesh, dims):
    return tuple(sorted(set(dims), key=mesh.names.index))


def tree_gather(tree, specs=None, *, mesh=None, shapes=None, sizes=None, families=None):
    """The whole tensors, on every rank, from this rank's blocks laid out as ``specs``.

    ``tree`` may be a module (its ``state_dict(keep_vars=True)``); without
    ``specs`` the parameters' registered layouts are used (``es.params.param_specs``).

    >>> whole = es.tree_gather(model_state, specs, mesh=mesh)   # doctest: +SKIP
    >>> whole = es.tree_gather(model, mesh=mesh)                # doctest: +SKIP
    >>> if dist.get_rank() == 0: torch.save(whole, "ckpt.pt")   # doctest: +SKIP
    """
    mesh, leaves, treedef, per_leaf, _ = prepare_tree(tree, specs, mesh, families, "tree_gather")
    found = None if shapes is not None else discover_splits(mesh, leaves, per_leaf, sizes, families)

    def gather(k, x, spec):
        if is_dtensor(x):
            return x.full_tensor().detach()
        formula = f"{spec.inner} -> {_strip(spec.inner_spec)}"
        parsed_formula = expand(formula, families)
        leaf_shapes = shapes_subset(parsed_formula, shapes) if found is None else (found.get(k) or None)
        y = einshard(formula, x.detach(), mesh=mesh, shapes=leaf_shapes,
                     sizes=sizes_subset(parsed_formula, sizes, families), families=families)
        if y.numel() and y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone()  # replicated: a copy, not a view of the caller's tensor
        return y

    return map_leaves(treedef, leaves, per_leaf, gather)


def discover_splits(mesh, leaves, per_leaf, sizes=None, families=None):
    """Per leaf ``{label: {axis: split shapes}}`` of its sharded axes, from one all-gather of local sizes.

    Sharded axes after a ``...`` are found by counting from the end; a sharded
    factor of a group ``(h/tp p)`` when the other factors' sizes are known
    (``sizes=``).
    """
    wanted = []  # (leaf index, axis name, dims, local size)
    for k, (x, spec) in enumerate(zip(leaves, per_leaf)):
        if spec is None or not isinstance(x, torch.Tensor) or is_dtensor(x):
            continue
        items = spec.inner_spec.items
        named = sum(not isinstance(item, EllipsisItem) for item in items)
        n_ell = x.dim() - named
        if n_ell < 0 or (n_ell and not spec.inner_spec.has_ellipsis):
            continue  # the op reports rank mismatches
        known = None
        dim = 0
        for item in items:
            if isinstance(item, EllipsisItem):
                dim += n_ell  # '...' dims are never sharded
                continue
            if isinstance(item, Group):
                sharded = [a for a in item.axes if a.mesh]
                if len(sharded) == 1:
                    if known is None:
                        known = _known_sizes(spec, sizes, families)
                    rest = [known.get(a.name) for a in item.axes if not a.mesh]
                    if None not in rest:  # decided from the spec and sizes=: the same columns on every rank
                        a = sharded[0]
                        block = x.shape[dim] // max(math.prod(r for r in rest if r is not None), 1)
                        wanted.append((k, a.name, mesh.dims(a.mesh), block))
            elif getattr(item, "mesh", None):
                wanted.append((k, item.name, mesh.dims(item.mesh), x.shape[dim]))
            dim += 1
    if not wanted:
        return {}
    shape = MeshShape.of(mesh)
    group, order = mesh.group(tuple(mesh.names)), mesh.order(tuple(mesh.names))
    table = [[w[3] for w in wanted]]  # every rank's sizes, in block (mesh) order (one rank: its own)
    if shape.world > 1:
        local = torch.tensor(table, dtype=torch.int64, device=mesh.device_type)  # the group's device
        table = C.all_gather(local, group, 0, order=order).tolist()
    found: dict = {}
    for j, (k, axis, dims, _) in enumerate(wanted):
        splits = []
        for coord in shape.group_coords(dims, mesh.coordinate):
            flat = 0
            for c, n in zip(coord, shape.shape):
                flat = flat * n + c
            splits.append(int(table[flat][j]))
        found.setdefault(k, {}).setdefault(mesh.label(dims), {})[axis] = splits
    return found


def _known_sizes(spec, sizes, families) -> dict:
    """``sizes=`` (family keys expanded) for the axes of one spec; ``{}`` when it cannot be read."""
    if not sizes:
        return {}
    try:
        return dict(sizes_for(expand(spec.inner, families), sizes, families))
    except ValueError:
        return {}
