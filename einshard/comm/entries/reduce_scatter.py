"""``reduce_scatter``: this rank's block of the sum over a group (JAX's ``psum_scatter``); its adjoint is
``all_gather_varying``. Also :func:`reduce_scatter_rows`, the flat one of the gradient buckets."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ...core._torch_compat import functional_collectives as fc
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import (
    CompletedWork,
    agree,
    along,
    back,
    contiguous_clone,
    default_shapes,
    flat,
    group_rank,
    group_size,
    named_shapes,
    norm_axis,
    offsets,
    pad,
    real,
    record,
    reduce_scatter_tensor,
    whole_split,
)
from ..arguments import (
    order as check_order,
)
from ..collective import Collective, register
from ..primitives import padded_step, varying

__all__ = ["REDUCE_SCATTER", "reduce_scatter_rows"]


def reduce_scatter(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None):
    """This rank's block along ``dim`` of the sum over ranks of ``x``.

    Every rank passes the whole (same-shaped) ``x``; ``shapes`` (default
    ``compute_split_shapes(x.shape[dim], P)``) must sum to ``x.shape[dim]``.
    Uneven blocks are padded to the largest. ``order``: the group rank
    holding each block (default: block ``j`` on group rank ``j``).

    >>> reduce_scatter(torch.ones(4), group, 0)  # 2 ranks  # doctest: +SKIP
    tensor([2., 2.])
    """
    size, shapes, d, err = along(x, group, dim, shapes, "reduce_scatter")
    if order is not None:
        order = check_order(order, size, "reduce_scatter")
    if err is None:
        shapes, err = whole_split(shapes, x.shape[d], size, "reduce_scatter: shapes", f"dim {dim}")
    if err is not None or _checks.agreement_needed():
        agree(group, err, "reduce_scatter", x, extra=(("dim", d), ("shapes", shapes)))
    return x.detach(), group, d, shapes, order


def _eager(x: torch.Tensor, group, d: int, shapes, order=None) -> torch.Tensor:
    size = len(shapes)
    if size == 1:
        return contiguous_clone(x)
    rank = group_rank(group)
    mine = shapes[rank if order is None else order.index(rank)]
    m = max(shapes)
    if all(s == m for s in shapes):
        buf = x.unflatten(d, (size, m)).movedim(d, 0)
        # slot j goes to group rank j: the block it holds
        buf = buf.contiguous() if order is None else buf[[order.index(j) for j in range(size)]]
    else:
        buf = x.new_zeros((size,) + x.shape[:d] + (m,) + x.shape[d + 1 :])
        holders = range(size) if order is None else order
        for j, off, s in zip(holders, offsets(shapes), shapes):
            if s:
                buf[j].narrow(d, 0, s).copy_(x.narrow(d, off, s))
    out = buf.new_empty(buf.shape[1:])
    if out.numel() == 0:
        return out.narrow(d, 0, mine).contiguous()
    if _stats.is_active():
        record("reduce_scatter", group, size, out.numel() * out.element_size())
    reduce_scatter_tensor(flat(out), flat(buf), op=dist.ReduceOp.SUM, group=group)
    if mine == m:
        return out
    return out.narrow(d, 0, mine).contiguous()


def _traced(x: torch.Tensor, group, dim: int, shapes, order=None) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum of ``x`` over ``group``."""
    size = group.size()
    if size == 1:
        return x.clone()
    m = max(shapes)
    if all(s == m for s in shapes):
        buf = x.reshape(x.shape[:dim] + (size, m) + x.shape[dim + 1 :]).movedim(dim, 0)  # (unflatten: a super() call)
    else:
        starts = [sum(shapes[:j]) for j in range(size)]
        buf = torch.stack([pad(x.narrow(dim, o, s), dim, m) for o, s in zip(starts, shapes)])
    if order is not None:  # slot j goes to group rank j: the block it holds
        buf = buf[[order.index(j) for j in range(size)]]
    out = back(fc.reduce_scatter_tensor(real(buf), "sum", 0, group), x)[0]
    mine = shapes[group.rank() if order is None else order.index(group.rank())]
    return out if mine == m else out.narrow(dim, 0, mine)


def _named(x, axes, *, axis: int = 0, tiled: bool = True, shapes=None):
    """This rank's block of the sum over ``dim_name`` (JAX's ``psum_scatter``); varies over it.

    ``tiled=True`` splits ``axis`` into blocks (``shapes``, default
    ``compute_split_shapes``: uneven sizes allowed); ``tiled=False`` needs
    ``x.shape[axis] == size`` and removes ``axis``. Backward: all-gather.

    >>> g_block = es.spmd.psum_scatter(g, "dp", axis=0)  # doctest: +SKIP
    """
    a = norm_axis(axis, x.dim(), "psum_scatter")
    group = axes.group
    if tiled:
        shapes = default_shapes(x, group, a, named_shapes(shapes, axes, "psum_scatter"), False)
        return REDUCE_SCATTER.autograd, (x, group, a, shapes, axes.order)
    if x.shape[a] != axes.size:
        raise EinshardError(
            f"psum_scatter: tiled=False needs x.shape[{axis}] == {axes.size} (the size of "
            f"{'-'.join(axes.dims)!r}), got {x.shape[a]}"
        )
    return _scatter_squeezed, (x, group, a, axes.order)


def _scatter_squeezed(x, group, axis, order):
    return REDUCE_SCATTER.autograd(x, group, axis, default_shapes(x, group, axis, None, False), order).squeeze(axis)


REDUCE_SCATTER = register(Collective(
    name="reduce_scatter",
    **padded_step("reduce_scatter", "reduce-scatter", "dst"),
    vary=varying,
    check=reduce_scatter,
    eager=_eager,
    traced=_traced,
    adjoint="all_gather_varying",
    named="psum_scatter",
    bind=_named,
))


def reduce_scatter_rows(rows: torch.Tensor, group, *, async_op: bool = False):
    """Row ``j`` of the sum over ranks of ``rows`` (shape ``(P, M)``) on group rank ``j``: a flat
    reduce-scatter (the buckets of :mod:`einshard.comm.grad_sums`). With ``async_op=True``: ``(row, work)``.

    >>> reduce_scatter_rows(torch.ones(2, 3), group)  # 2 ranks  # doctest: +SKIP
    tensor([2., 2., 2.])
    """
    size = group_size(group)
    if rows.dim() != 2 or rows.shape[0] != size:
        raise EinshardError(f"reduce_scatter_rows: rows must have shape ({size}, M), got {tuple(rows.shape)}")
    rows = rows.detach().contiguous()
    if size == 1:
        out = rows[0].clone()
        return (out, CompletedWork()) if async_op else out
    out = rows.new_empty(rows.shape[1:])
    if _stats.is_active():
        record("reduce_scatter", group, size, out.numel() * out.element_size())
    work = reduce_scatter_tensor(out, rows.reshape(-1), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return (out, work) if async_op else out
