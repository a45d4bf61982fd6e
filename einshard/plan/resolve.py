"""From a formula and local tensors to layouts: sizes, split shapes, checks.

:func:`resolve` turns one rank's view of a distributed formula (its local
shapes, ``shapes=``, ``sizes=`` and the ambient split shapes of
``shard_map``) into the layouts of the operands and of the requested output.
Errors every rank can see are raised at once; an error only this rank can
see (its local size disagrees with the split shapes) is returned, so the
caller can agree on it across ranks before the first collective.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..core._split import as_sizes, compute_split_shapes
from ..core.layout import Layout, broadcast_size
from ..errors import EinshardError, SizeMismatchError, naming
from ..notation import Axis, EllipsisItem, Formula, Group, TensorSpec, invalid

__all__ = ["Resolved", "resolve", "freeze_shapes", "ELLIPSIS_PREFIX"]

ELLIPSIS_PREFIX = "\u2026"  # names of the unnamed '...' dimensions: '…0' is the last one


def freeze_shapes(shapes):
    """A hashable form of ``shapes=`` (lists become tuples, dicts sorted tuples); no value is changed.

    Malformed values (not a list or a dict of lists) are a ``ValueError``;
    :func:`resolve` checks the sizes themselves.
    """
    if shapes is None:
        return None
    if isinstance(shapes, Mapping):
        return ("dict",) + tuple(sorted((str(k), freeze_shapes(v)) for k, v in shapes.items()))
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Iterable):
        raise EinshardError(
            f"shapes= must be a list of per-rank sizes or a dict of them (per mesh dimension, optionally per "
            f"axis), got {shapes!r}"
        )
    frozen = tuple(shapes)
    for v in frozen:
        if isinstance(v, (Mapping, list, tuple, str, bytes)) or not isinstance(v, Hashable):
            raise EinshardError(f"shapes= lists must hold integer sizes, got {list(frozen)!r}")
    return frozen


@dataclass(frozen=True)
class Resolved:
    """The layouts of one call, as this rank sees it."""

    operands: tuple[Layout, ...]
    output: Layout
    in_shapes: tuple  # per operand: None or the local shape with groups expanded
    out_shape: tuple | None  # the local output shape with groups merged, or None
    summed: frozenset  # output partial dims that carry contributions
    fixed: frozenset  # axes that may not be sharded
    local_error: str | None  # an error only this rank can see


class _Occurrence:
    __slots__ = ("operand", "axis", "dims", "local", "in_group")

    def __init__(self, operand, axis, dims, local, in_group):
        self.operand, self.axis, self.dims, self.local, self.in_group = operand, axis, dims, local, in_group


class Splits:
    """Looks up split shapes from ``shapes=`` and the ambient context."""

    def __init__(self, shapes, ambient, mesh, labels, axes=None):
        self.shapes, self.ambient, self.mesh = shapes, ambient, mesh
        self.labels = labels  # every sharded label of the formula (for the list form)
        if isinstance(shapes, Mapping):
            self._check_keys(shapes, None if axes is None else set(axes))
        elif shapes is not None:
            as_sizes(shapes, "shapes")

    def _check_keys(self, shapes: Mapping, axes: set | None) -> None:
        """Every key names mesh dimensions of the mesh, every per-axis key an axis of the formula."""
        for key, value in shapes.items():
            if not isinstance(key, str):
                raise EinshardError(f"shapes= keys are mesh dimension names, got {key!r}")
            try:
                self.mesh.dims(key)
            except ValueError as err:
                raise EinshardError(f"shapes[{key!r}]: {err}") from None
            if isinstance(value, Mapping):
                for axis, sizes in value.items():
                    if axes is not None and axis not in axes:
                        raise EinshardError(f"shapes[{key!r}] names axis {axis!r}, which is not in the formula")
                    as_sizes(sizes, f"shapes[{key!r}][{axis!r}]")
            else:
                as_sizes(value, f"shapes[{key!r}]")

    def explicit(self, dims: tuple, axis: str, missing_ok: bool = False):
        """The split shapes ``shapes=`` (or the ambient context) gives, or ``None``.

        A per-axis entry for ``dims`` that lacks ``axis`` is an error unless
        ``missing_ok`` (the caller can derive the split).
        """
        shapes = self.shapes
        label = self.mesh.label(dims)
        found = None
        if shapes is not None:
            if isinstance(shapes, Mapping):
                entry = self._entry(shapes, dims)
                if entry is not None:
                    if isinstance(entry, Mapping):
                        if axis not in entry:
                            if missing_ok:
                                return None
                            raise EinshardError(
                                f"shapes[{label!r}] has no entry for axis {axis!r}; "
                                f"it has {sorted(entry)}"
                            )
                        entry = entry[axis]
                    found = as_sizes(entry, f"shapes[{label!r}]")
            else:
                if len(self.labels) != 1:
                    raise EinshardError(
                        f"shapes= as a list needs exactly one sharded mesh dimension, but the "
                        f"formula shards over {sorted(self.labels)}; use {{'dim': [...]}} instead"
                    )
                found = as_sizes(shapes, "shapes")
        if found is None and self.ambient:
            found = self.ambient.get((dims, axis))
        if found is not None and len(found) != self.mesh.size(dims):
            raise EinshardError(
                f"split shapes {list(found)} of axis {axis!r} over {label!r} have "
                f"{len(found)} entries but {label!r} has {self.mesh.size(dims)} ranks"
            )
        return None if found is None else tuple(found)

    def _entry(self, shapes: Mapping, dims: tuple):
        wanted = frozenset(dims)
        for key, value in shapes.items():  # keys were checked against the mesh (a sub-mesh's may hold '-')
            if isinstance(key, str) and frozenset(self.mesh.dims(key)) == wanted:
                return value
        return None

def _dims_at(mesh, text: str, name: str, position: int) -> tuple:
    """``mesh.dims(name)``; an unknown dimension is an ``invalid`` error with a caret at ``position``."""
    try:
        return mesh.dims(name)
    except ValueError as err:
        raise invalid(text, position, str(err)) from None


@naming()
def resolve(
    formula: Formula, local_shapes: Sequence[tuple], mesh, shapes=None, sizes=None, ambient=None, axes=()
) -> Resolved:
    """Layouts of the operands and output of ``formula`` for this rank's tensors.

    ``axes``: the axis names ``shapes=`` may name per axis besides the
    formula's (an op whose output has new axes passes them); ``None`` when
    ``shapes=`` is shared by several formulas and may name others.
    """
    text = formula.text
    if formula.output is None:
        raise EinshardError("einshard needs a formula 'inputs -> output'")
    if len(local_shapes) != len(formula.inputs):
        raise EinshardError(
            f"the formula has {len(formula.inputs)} operand(s) but {len(local_shapes)} tensor(s) were given"
        )
    sizes = dict(sizes or {})

    def dims_of(axis: Axis) -> tuple:
        return mesh.dims(axis.mesh) if axis.mesh else ()

    def partial_of(spec: TensorSpec) -> frozenset:
        out: set = set()
        for p in spec.partial:
            out.update(mesh.dims(p))
        return frozenset(out)

    labels = set()
    for spec in formula.tensors:  # validates the names, with the expression and a caret
        for a in spec.axes:
            if a.mesh:
                at = text.find("/", a.pos) + 1 if text.startswith(a.name, a.pos) else a.pos
                labels.add(mesh.label(_dims_at(mesh, text, a.mesh, at)))
        for p in spec.partial:
            _dims_at(mesh, text, p, text.find(p, text.find("//", spec.pos)))
    known = None if axes is None else {a.name for t in formula.tensors for a in t.axes} | set(axes)
    lookup = Splits(shapes, ambient, mesh, labels, known)

    occurrences: list[_Occurrence] = []
    # per operand: one (kind, payload) per tensor dim: ("axis", occurrence) or ("group", (occurrences, dim size))
    per_operand: list[list[tuple[str, Any]]] = []
    ellipsis_ndims = []
    for k, (spec, shape) in enumerate(zip(formula.inputs, local_shapes)):
        where = f"operand {k}"
        n_ell = spec.ellipsis_ndim(len(shape), where)
        ellipsis_ndims.append(n_ell if spec.has_ellipsis else None)
        dims: list[tuple[str, Any]] = []
        pos = 0
        for item in spec.items:
            if isinstance(item, EllipsisItem):
                for j in range(n_ell):
                    name = f"{ELLIPSIS_PREFIX}{n_ell - 1 - j}"
                    occ = _Occurrence(k, name, (), shape[pos], False)
                    occurrences.append(occ)
                    dims.append(("axis", occ))
                    pos += 1
            elif isinstance(item, Group):
                occs = [_Occurrence(k, a.name, dims_of(a), None, True) for a in item.axes]
                occurrences.extend(occs)
                dims.append(("group", (occs, shape[pos])))
                pos += 1
            else:
                assert isinstance(item, Axis)  # families and zips are expanded before resolving
                occ = _Occurrence(k, item.name, dims_of(item), shape[pos], False)
                occurrences.append(occ)
                dims.append(("axis", occ))
                pos += 1
        per_operand.append(dims)

    global_size: dict[str, int] = {}
    for name, value in sizes.items():
        global_size[name] = int(value)

    def set_global(axis: str, size: int, where: str):
        old = global_size.get(axis)
        if old is None:
            global_size[axis] = size
        elif old != size:
            if axis in ones and 1 in (old, size):  # a size-1 occurrence broadcasts
                broadcast.add(axis)
                global_size[axis] = max(old, size)
                return
            raise SizeMismatchError(f"axis {axis!r} has global size {size} in {where} but {old} elsewhere")

    # plain unsharded occurrences fix global sizes; size-1 ones may broadcast (like torch.einsum)
    broadcast: set = set()
    ones: set = set()
    for occ in occurrences:
        if not occ.in_group and not occ.dims:
            if occ.local == 1 and occ.axis not in sizes:
                ones.add(occ.axis)
                continue
            set_global(occ.axis, occ.local, f"operand {occ.operand}")
    for axis in ones:
        if axis in global_size and global_size[axis] != 1:
            broadcast.add(axis)
    # explicit split shapes
    splits: dict[tuple, tuple] = {}
    for occ in occurrences:
        if occ.dims and (occ.dims, occ.axis) not in splits:
            found = lookup.explicit(occ.dims, occ.axis, missing_ok=occ.axis in global_size)
            if found is not None:
                set_global(occ.axis, sum(found), f"the split shapes of operand {occ.operand}")
                splits[(occ.dims, occ.axis)] = found

    def split_of(axis: str, dims: tuple, local: int | None):
        found = splits.get((dims, axis))
        if found is None:
            n = mesh.size(dims)
            if axis in global_size:
                found = tuple(compute_split_shapes(global_size[axis], n))
            elif local is not None:
                found = (local,) * n  # assumed even: every rank holds as much as this one
                set_global(axis, local * n, "an evenly split operand")
            else:
                return None
            splits[(dims, axis)] = found
        return found

    for occ in occurrences:
        if not occ.in_group and occ.dims:
            split_of(occ.axis, occ.dims, occ.local)
    for axis in ones:
        if axis not in global_size:
            global_size[axis] = 1
        elif global_size[axis] != 1:
            broadcast.add(axis)

    local_error = None

    def local_size(occ) -> int | None:
        if not occ.dims:
            return global_size.get(occ.axis)
        found = split_of(occ.axis, occ.dims, None)
        return None if found is None else found[mesh.index(occ.dims)]

    # groups: infer one unknown factor per group
    pending = [d for dims in per_operand for kind, d in dims if kind == "group"]
    group_locals: dict[int, list[int | None]] = {}
    progress = True
    while pending and progress:
        progress = False
        for entry in list(pending):
            occs, dim_size = entry
            locals_ = [local_size(o) for o in occs]
            unknown = [o for o, s in zip(occs, locals_) if s is None]
            if len(unknown) > 1:
                continue
            product = math.prod(s for s in locals_ if s is not None)
            if unknown:
                occ = unknown[0]
                group_text = f"'({' '.join(o.axis for o in occs)})'"
                if product == 0 and local_error is None:
                    local_error = (
                        f"{text!r}: cannot infer the size of {occ.axis!r} in {group_text} of operand {occ.operand}: "
                        f"this rank's block of it is empty; pass sizes={{{occ.axis!r}: ...}}"
                    )
                elif product and dim_size % product and local_error is None:
                    local_error = (
                        f"{text!r}: dimension of size {dim_size} in operand {occ.operand} on this rank cannot be "
                        f"factored as group {group_text}: the known factors have product {product}, which does "
                        f"not divide {dim_size}, so the unknown factor {occ.axis!r} has no size"
                    )
                inferred = dim_size // product if product else 0
                occ.local = inferred
                if occ.dims:
                    split_of(occ.axis, occ.dims, inferred)
                else:
                    set_global(occ.axis, inferred, f"operand {occ.operand}")
                locals_ = [local_size(o) for o in occs]
            elif product != dim_size and local_error is None:
                local_error = (
                    f"{text!r}: group '({' '.join(o.axis for o in occs)})' of operand {occs[0].operand} has local "
                    f"size {dim_size} on this rank, but its factors give {product}"
                )
            for o, s in zip(occs, locals_):
                o.local = s
            group_locals[id(entry)] = locals_
            pending.remove(entry)
            progress = True
    if pending:
        occs, _ = pending[0]
        names = ", ".join(repr(o.axis) for o in occs if local_size(o) is None)
        raise EinshardError(
            f"Cannot infer multiple factor sizes: {names} in group '({' '.join(o.axis for o in occs)})' of "
            f"operand {occs[0].operand} are all unknown; pass sizes= for all but one"
        )

    # this rank's local sizes must match the split shapes
    for occ in occurrences:
        if occ.dims and occ.local is not None and local_error is None:
            found = split_of(occ.axis, occ.dims, occ.local)
            mine = found[mesh.index(occ.dims)]
            if occ.local != mine:
                label = mesh.label(occ.dims)
                if len(found) > 1 and occ.local == sum(found) and not occ.in_group:
                    # a whole tensor where its block is expected (a shard_map body returning the whole result)
                    fix = (f"it holds the whole axis, not its block: pass this rank's block, or name {occ.axis!r} "
                           f"unsharded where the whole tensor is meant ('{occ.axis}' instead of '{occ.axis}/{label}': "
                           f"a shard_map out-spec returning it whole, or an in-spec '{occ.axis} ... -> "
                           f"{occ.axis}/{label} ...' splitting it on entry)")
                else:
                    fix = "pass shapes= with the real split (or this rank's block, if a whole tensor was given)"
                local_error = (
                    f"{text!r}: operand {occ.operand} holds {occ.local} elements of axis {occ.axis!r} on this rank, "
                    f"but the split shapes over {label!r} are {list(found)} (this rank's block: {mine}); {fix}"
                )

    # operand layouts
    layouts, in_shapes = [], []
    fixed = set(broadcast)
    for k, dims in enumerate(per_operand):
        axes, gsizes, shard, spl, local = [], [], [], [], []
        grouped = False
        seen = set()
        for kind, payload in dims:
            occs = payload[0] if kind == "group" else [payload]
            grouped |= kind == "group"
            for occ in occs:
                if occ.axis in seen:
                    fixed.add(occ.axis)
                seen.add(occ.axis)
                if occ.axis.startswith(ELLIPSIS_PREFIX):
                    fixed.add(occ.axis)
                axes.append(occ.axis)
                plain_one = occ.axis in broadcast and not occ.dims and not occ.in_group and occ.local == 1
                gsizes.append(1 if plain_one else global_size[occ.axis])
                shard.append(occ.dims)
                spl.append(split_of(occ.axis, occ.dims, None) if occ.dims else None)
                local.append(occ.local if occ.local is not None else local_size(occ))
        layouts.append(Layout(tuple(axes), tuple(gsizes), tuple(shard), tuple(spl), partial_of(formula.inputs[k])))
        in_shapes.append(tuple(local) if grouped else None)

    # output layout
    out = formula.output
    ell_sizes: dict[str, int] = {}
    for occ in occurrences:
        if occ.axis.startswith(ELLIPSIS_PREFIX):
            ell_sizes[occ.axis] = broadcast_size(ell_sizes.get(occ.axis, 1), occ.local)
    n_out_ell = max((n for n in ellipsis_ndims if n is not None), default=0)
    axes, gsizes, shard, spl = [], [], [], []
    merged: list[int] = []
    grouped = False
    for item in out.items:
        if isinstance(item, EllipsisItem):
            for j in range(n_out_ell):
                name = f"{ELLIPSIS_PREFIX}{n_out_ell - 1 - j}"
                axes.append(name)
                gsizes.append(ell_sizes[name])
                shard.append(())
                spl.append(None)
                merged.append(ell_sizes[name])
            continue
        members = item.axes if isinstance(item, Group) else (item,)
        grouped |= isinstance(item, Group)
        product = 1
        for a in members:
            assert isinstance(a, Axis)  # families and zips are expanded before resolving
            d = dims_of(a)
            axes.append(a.name)
            gsizes.append(global_size[a.name])
            shard.append(d)
            if d:
                found = splits.get((d, a.name)) or lookup.explicit(d, a.name, missing_ok=True)
                if found is None:
                    found = tuple(compute_split_shapes(global_size[a.name], mesh.size(d)))
                elif sum(found) != global_size[a.name]:
                    raise EinshardError(
                        f"split shapes {list(found)} of output axis {a.name!r} sum to {sum(found)} "
                        f"but the axis has size {global_size[a.name]}"
                    )
                spl.append(tuple(found))
                product *= found[mesh.index(d)]
            else:
                spl.append(None)
                product *= global_size[a.name]
        merged.append(product)
    out_layout = Layout(tuple(axes), tuple(gsizes), tuple(shard), tuple(spl), partial_of(out))

    in_axes = {a for layout in layouts for a in layout.axes}
    sums_something = bool(in_axes - set(out_layout.axes))
    summed = frozenset(
        d for d in out_layout.partial if sums_something or any(d in layout.partial for layout in layouts)
    )
    return Resolved(
        tuple(layouts),
        out_layout,
        tuple(in_shapes),
        tuple(merged) if grouped else None,
        summed,
        frozenset(fixed),
        local_error,
    )
