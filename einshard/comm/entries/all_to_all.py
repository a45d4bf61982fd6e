"""``all_to_all``: sharded along one dimension to sharded along another; its adjoint is the reverse
all-to-all."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ...core._torch_compat import functional_collectives as fc
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import (
    agree,
    all_to_all_single,
    contiguous_clone,
    default_shapes,
    group_rank,
    group_size,
    holder,
    masked,
    norm_axis,
    offsets,
    real,
    sizes,
    whole_split,
)
from ..arguments import (
    dim as check_dim,
)
from ..arguments import (
    order as check_order,
)
from ..collective import Collective, register
from ..primitives import moved, same, varying

__all__ = ["ALL_TO_ALL", "repartition"]


def all_to_all(
    x: torch.Tensor,
    group,
    src_dim: int,
    dst_dim: int,
    src_shapes: Sequence[int] | None = None,
    dst_shapes: Sequence[int] | None = None,
    order=None,
):
    """Repartition: sharded along ``src_dim`` and whole along ``dst_dim`` → the reverse.

    This rank holds ``src_shapes[rank]`` along ``src_dim`` (default: even)
    and the whole ``dst_dim``; it gets the whole ``src_dim`` and
    ``dst_shapes[rank]`` along ``dst_dim`` (default
    ``compute_split_shapes(x.shape[dst_dim], P)``). One ``all_to_all_single``
    with split sizes, so uneven and empty blocks cost no padding. ``order``:
    the group rank holding each block of both dims (default: block ``j`` on
    group rank ``j``); the shapes are then indexed by block.

    >>> x = torch.randn(2, 8)              # rows 2r, 2r+1 of a (8, 8) matrix, 4 ranks  # doctest: +SKIP
    >>> all_to_all(x, group, 0, 1).shape   # every row, columns 2r, 2r+1  # doctest: +SKIP
    torch.Size([8, 2])
    """
    size = group_size(group)
    if src_shapes is not None:
        src_shapes = sizes(src_shapes, "all_to_all: src_shapes", size)
    if dst_shapes is not None:
        dst_shapes = sizes(dst_shapes, "all_to_all: dst_shapes", size)
    if order is not None:
        order = check_order(order, size, "all_to_all")
    rank = group_rank(group) if size > 1 else 0
    me = rank if order is None else order.index(rank)
    sd, err = check_dim(src_dim, x.dim(), "all_to_all", "src_dim")
    dd, err2 = check_dim(dst_dim, x.dim(), "all_to_all", "dst_dim")
    err = err or err2
    if err is None and sd == dd:
        err = EinshardError(f"all_to_all: src_dim ({src_dim}) and dst_dim ({dst_dim}) must differ")
    if err is None:
        if src_shapes is None:
            src_shapes = [x.shape[sd]] * size
        elif x.shape[sd] != src_shapes[me]:
            err = EinshardError(
                f"all_to_all: this rank ({holder(rank, me)}) holds {x.shape[sd]} elements along src_dim "
                f"{src_dim} but src_shapes[{me}] = {src_shapes[me]} (src_shapes {src_shapes})"
            )
    if err is None:
        dst_shapes, err = whole_split(dst_shapes, x.shape[dd], size, "all_to_all: dst_shapes", f"dst_dim {dst_dim}")
    if err is not None or _checks.agreement_needed():
        uneven = err is None and src_shapes is not None and any(s != src_shapes[0] for s in src_shapes)
        agree(group, err, "all_to_all", x, masked(x.shape, sd if uneven else None),
              (("dims", (sd, dd)), ("src_shapes", src_shapes), ("dst_shapes", dst_shapes)))
    return x.detach(), group, sd, dd, src_shapes, dst_shapes, order


def _eager(x: torch.Tensor, group, sd: int, dd: int, src_shapes, dst_shapes, order=None) -> torch.Tensor:
    size = len(src_shapes)
    if size == 1:
        return contiguous_clone(x)
    rank = group_rank(group)
    me = rank if order is None else order.index(rank)
    # blocks[j]: the block group rank j holds (its dst block goes there, its src block comes from there)
    blocks = range(size) if order is None else [order.index(j) for j in range(size)]
    # Pack the blocks for the destination ranks one after the other, each in x's own dimension order, so
    # that the received blocks are this rank's result pieces along src_dim (no unpacking when nothing
    # precedes src_dim).
    m = max(dst_shapes)
    if all(s == m for s in dst_shapes):
        send = x.unflatten(dd, (size, m)).movedim(dd, 0)  # one copy below (a view for dd == 0)
        send = (send if order is None else send[blocks]).reshape(-1)
    else:
        starts = offsets(dst_shapes)
        send = torch.cat([x.narrow(dd, starts[b], dst_shapes[b]).reshape(-1) for b in blocks])
    other = math.prod(x.shape[k] for k in range(x.dim()) if k not in (sd, dd))
    mine = dst_shapes[me]
    in_splits = [dst_shapes[b] * other * x.shape[sd] for b in blocks]
    out_splits = [mine * other * src_shapes[b] for b in blocks]
    out = x.new_empty(sum(out_splits))
    # Skip only when nobody moves anything (decided from shared sizes, so every rank agrees).
    if sum(src_shapes) * sum(dst_shapes) * other:
        if _stats.is_active():
            isz = x.element_size()
            _stats.record(
                "all_to_all",
                group,
                (sum(in_splits) - in_splits[rank]) * isz,
                (sum(out_splits) - out_splits[rank]) * isz,
            )
        all_to_all_single(out, send, out_splits, in_splits, group)
    result_shape = list(x.shape)
    result_shape[sd] = sum(src_shapes)
    result_shape[dd] = mine
    if order is None and math.prod(x.shape[:sd]) == 1:  # the pieces, one after the other, are the result
        return out.view(result_shape)
    piece = list(result_shape)
    received = out.split(out_splits)  # from group rank j: block blocks[j]
    parts = []
    for s, j in zip(src_shapes, range(size) if order is None else order):
        if s:
            piece[sd] = s
            parts.append(received[j].view(piece))
    return torch.cat(parts, sd)


def _traced(x: torch.Tensor, group, src_dim: int, dst_dim: int, src_shapes, dst_shapes, order=None):
    """Sharded along ``src_dim`` -> sharded along ``dst_dim`` (one ``all_to_all_single``)."""
    size = group.size()
    if size == 1:
        return x.clone()
    if order is not None:  # in group-rank order along dst_dim, then the pieces back in block order
        return _traced_ordered(x, group, src_dim, dst_dim, src_shapes, dst_shapes, order)
    sd, dd = src_dim, dst_dim
    rank = group.rank()
    other = math.prod([x.shape[k] for k in range(x.dim()) if k not in (sd, dd)])  # (dynamo: no generator)
    mine = dst_shapes[rank]
    factor = 2 if x.is_complex() else 1
    in_splits = [s * other * x.shape[sd] * factor for s in dst_shapes]
    out_splits = [mine * other * s * factor for s in src_shapes]
    buf = real(x.movedim(dd, 0)).reshape(-1)
    out = fc.all_to_all_single(buf, out_splits, in_splits, group)
    if x.is_complex():
        out = torch.view_as_complex(out.view(-1, 2))
    moved_shape = [mine] + [x.shape[k] for k in range(x.dim()) if k != dd]
    sd_moved = sd + 1 if sd < dd else sd
    pieces = []
    for s, part in zip(src_shapes, out.split([n // factor for n in out_splits])):
        if s:
            moved_shape[sd_moved] = s
            pieces.append(part.view(moved_shape).movedim(0, dd))
    return torch.cat(pieces, sd)


def _traced_ordered(x, group, sd, dd, src_shapes, dst_shapes, order):
    """:func:`_traced` whose blocks live on group ranks ``order``: the dst blocks sent in group-rank
    order, the received src pieces put back in block order."""
    size = group.size()
    blocks = [order.index(j) for j in range(size)]  # the block group rank j holds
    starts = [sum(dst_shapes[:b]) for b in range(size)]
    x = torch.cat([x.narrow(dd, starts[b], dst_shapes[b]) for b in blocks], dd)
    y = _traced(x, group, sd, dd, [src_shapes[b] for b in blocks], [dst_shapes[b] for b in blocks])
    pieces = list(y.split([src_shapes[b] for b in blocks], sd))
    return torch.cat([pieces[order[k]] for k in range(size)], sd)


def _run(step, site):
    group, C, i, j = site.group(step.dims), site.C, step.axis, step.to_axis
    src_sizes, dst_sizes = site.sizes(step.src, i, step.dims), site.sizes(step.dst, j, step.dims)
    order = site.order(step.dims)
    if order is None:
        return lambda x: C.all_to_all(x, group, i, j, src_sizes, dst_sizes)
    return lambda x: C.all_to_all(x, group, i, j, src_sizes, dst_sizes, order)


def repartition(x: torch.Tensor, group, src_dim: int, dst_dim: int, src_shapes=None, dst_shapes=None, order=None):
    """The autograd form with default shapes: ``src_shapes`` even, ``dst_shapes`` ``compute_split_shapes``."""
    src_shapes = default_shapes(x, group, src_dim, src_shapes, True)
    dst_shapes = default_shapes(x, group, dst_dim, dst_shapes, False)
    return ALL_TO_ALL.autograd(x, group, src_dim, dst_dim, src_shapes, dst_shapes, order)


def _named(x, axes, split_axis: int, concat_axis: int, *, tiled: bool = True):
    """Split ``split_axis`` into one block per rank, send block ``j`` to rank ``j``, concatenate along ``concat_axis``.

    JAX's ``all_to_all``. ``tiled=True`` (the default here; JAX's default is
    ``False``) keeps the number of dimensions: ``split_axis`` shrinks by the
    group size and ``concat_axis`` grows by it (uneven ``split_axis`` sizes
    are split with ``compute_split_shapes``). ``tiled=False`` needs
    ``x.shape[split_axis] == size``, removes ``split_axis`` and inserts a new
    axis of that size at ``concat_axis`` (of the result). The output varies
    over ``dim_name``; backward: the inverse all-to-all.

    >>> y = es.spmd.all_to_all(x, "sp", split_axis=2, concat_axis=1)  # doctest: +SKIP
    """
    s = norm_axis(split_axis, x.dim(), "all_to_all")
    c = norm_axis(concat_axis, x.dim(), "all_to_all")
    group, order = axes.group, axes.order
    if tiled:
        if s == c:
            return _same_axis, (x, group, s, order)
        return repartition, (x, group, c, s, None, None, order)
    if x.shape[s] != axes.size:
        raise EinshardError(
            f"all_to_all: tiled=False needs x.shape[{split_axis}] == {axes.size} (the size of "
            f"{'-'.join(axes.dims)!r}), got {x.shape[s]}"
        )
    return _untiled, (x, group, s, c, order)


def _same_axis(x, group, axis, order):
    # split and concatenate along the same axis: blocks move, the shape stays
    n = group_size(group)
    size = x.shape[axis]
    if size % n:
        raise EinshardError(f"all_to_all: split_axis == concat_axis needs a size divisible by {n}, got {size}")
    shape = list(x.shape)
    y = x.reshape(shape[:axis] + [n, size // n] + shape[axis + 1 :])
    y = repartition(y.unsqueeze(axis + 1), group, axis + 1, axis, None, None, order)
    return y.reshape(shape)


def _untiled(x, group, split_axis, concat_axis, order):
    y = x.movedim(split_axis, 0).unsqueeze(1)  # (n, 1, rest): block j goes to rank j
    y = repartition(y, group, 1, 0, None, None, order)  # (1, n, rest): block r came from rank r
    return y.squeeze(0).movedim(0, concat_axis)


ALL_TO_ALL = register(Collective(
    name="all_to_all",
    what=lambda s: f"all-to-all {s.src.axes[s.axis]} -> {s.src.axes[s.to_axis]}" if s.axis >= 0 else "all-to-all",
    run=_run,
    basis=moved,
    traffic=same,
    vary=varying,
    check=all_to_all,
    eager=_eager,
    traced=_traced,
    adjoint="all_to_all",
    transpose=lambda group, sd, dd, ss, ds, order: (group, dd, sd, ds, ss, order),
    named="all_to_all",
    bind=_named,
))
