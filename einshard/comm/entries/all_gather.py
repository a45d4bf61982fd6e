"""``all_gather``: every rank's block, concatenated on every rank (uneven blocks padded to the largest).

Two entries share its transport: ``all_gather`` makes a value the same on every rank (its adjoint is
``split``: this rank's block of the cotangent), ``all_gather_varying`` per-rank values (its adjoint is
``reduce_scatter``; sequence parallelism's entry to a tensor-parallel region). Also
:func:`all_gather_start`, the gather ZeRO prefetches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ...core._torch_compat import functional_collectives as fc
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import (
    CompletedWork,
    agree,
    all_gather_tensor,
    along,
    back,
    contiguous_clone,
    default_shapes,
    flat,
    group_rank,
    group_size,
    holder,
    masked,
    named_shapes,
    norm_axis,
    pad,
    real,
    record,
)
from ..arguments import (
    dim as check_dim,
)
from ..arguments import (
    order as check_order,
)
from ..collective import Collective, register
from ..primitives import invariant, padded_step, varying

__all__ = ["ALL_GATHER", "ALL_GATHER_VARYING", "PendingGather", "all_gather_start"]


def all_gather(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None):
    """Concatenate every rank's ``x`` along ``dim``, in group-rank order (block order with ``order``).

    ``shapes`` are the per-rank sizes along ``dim`` (default: even, every
    rank holds ``x.shape[dim]``). Uneven blocks are padded to the largest.
    ``order``: the group rank holding each block (default: block ``j`` on group rank ``j``).

    >>> all_gather(torch.full((1, 2), float(rank)), group, 0)  # 2 ranks  # doctest: +SKIP
    tensor([[0., 0.],
            [1., 1.]])
    >>> all_gather(x, group, dim=1, shapes=[3, 3, 3, 0])  # doctest: +SKIP
    """
    size, shapes, d, err = along(x, group, dim, shapes, "all_gather")
    if order is not None:
        order = check_order(order, size, "all_gather")
    rank = group_rank(group) if size > 1 else 0
    me = rank if order is None else order.index(rank)
    if err is None and shapes is not None and x.shape[d] != shapes[me]:
        err = EinshardError(
            f"all_gather: this rank ({holder(rank, me)}) holds {x.shape[d]} elements along dim {dim} "
            f"but shapes[{me}] = {shapes[me]} (shapes {shapes})"
        )
    if err is not None or _checks.agreement_needed():
        agree(group, err, "all_gather", x, masked(x.shape, d if shapes is not None and err is None else None),
              (("dim", d), ("shapes", shapes)))
    return x.detach(), group, d, [x.shape[d]] * size if shapes is None else shapes, order


def _eager(x: torch.Tensor, group, d: int, shapes, order=None) -> torch.Tensor:
    size = len(shapes)
    if size == 1:
        return contiguous_clone(x)
    local = x.shape[d]
    m = max(shapes)
    even = all(s == m for s in shapes)
    if local == m:
        block = x.contiguous()
    else:
        block = x.new_zeros(x.shape[:d] + (m,) + x.shape[d + 1 :])
        block.narrow(d, 0, local).copy_(x)
    out = block.new_empty((size,) + block.shape)
    if block.numel() > 0:
        if _stats.is_active():
            record("all_gather", group, size, block.numel() * block.element_size())
        all_gather_tensor(flat(out), flat(block), group=group)
    if even:
        if order is not None:
            out = out[list(order)]  # block k came from group rank order[k]
        return out.movedim(0, d).reshape(x.shape[:d] + (size * m,) + x.shape[d + 1 :])
    holders = range(size) if order is None else order
    return torch.cat([out[j].narrow(d, 0, s) for j, s in zip(holders, shapes)], dim=d)


def _traced(x: torch.Tensor, group, dim: int, shapes, order=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (``shapes``: per-block sizes)."""
    size = group.size()
    if size == 1:
        return x.clone()
    m = max(shapes)
    blocks = back(fc.all_gather_tensor(real(pad(x, dim, m)).unsqueeze(0), 0, group), x)
    if order is not None:
        blocks = blocks[list(order)]  # block k came from group rank order[k]
    if all(s == m for s in shapes):
        return blocks.movedim(0, dim).reshape(x.shape[:dim] + (size * m,) + x.shape[dim + 1 :])
    return torch.cat([blocks[j].narrow(dim, 0, s) for j, s in enumerate(shapes) if s], dim)


def _named(x, axes, *, axis: int = 0, tiled: bool = True, shapes=None):
    """Concatenate every rank's ``x`` along ``axis`` (JAX's ``all_gather``); invariant over ``dim_name``.

    ``tiled=True`` concatenates along the existing ``axis``; ``tiled=False``
    stacks along a new axis inserted at ``axis``. ``shapes`` gives per-rank
    sizes along ``axis`` when they differ (uneven blocks); default: every
    rank holds as much as this one. Backward: this rank's block of the
    cotangent.

    >>> w = es.spmd.all_gather(w_block, "tp", axis=0)  # doctest: +SKIP
    """
    group = axes.group
    if tiled:
        a = norm_axis(axis, x.dim(), "all_gather")
        shapes = default_shapes(x, group, a, named_shapes(shapes, axes, "all_gather"), True)
        return ALL_GATHER.autograd, (x, group, a, shapes, axes.order)
    a = norm_axis(axis, x.dim() + 1, "all_gather")
    return _gather_stacked, (x, group, a, axes.order)


def _gather_stacked(x, group, axis, order):
    x = x.unsqueeze(axis)
    return ALL_GATHER.autograd(x, group, axis, default_shapes(x, group, axis, None, True), order)


ALL_GATHER = register(Collective(
    name="all_gather",
    **padded_step("all_gather", "all-gather", "src"),
    vary=invariant,
    check=all_gather,
    eager=_eager,
    traced=_traced,
    adjoint="split",
    named="all_gather",
    bind=_named,
))

ALL_GATHER_VARYING = register(dataclasses.replace(
    ALL_GATHER, name="all_gather_varying", what=None, run=None, basis=None, traffic=None, transport="all_gather",
    vary=varying, adjoint="reduce_scatter", named="", bind=None,
))


class PendingGather:
    """An all-gather in flight (:func:`all_gather_start`); :meth:`wait` returns the concatenated tensor."""

    __slots__ = ("out", "work", "dim", "shapes", "holders", "_done")

    def __init__(self, out, work, dim, shapes, holders=None):
        self.out, self.work, self.dim, self.shapes, self._done = out, work, dim, shapes, None
        self.holders = range(len(shapes)) if holders is None else holders  # the group rank of each block

    @property
    def in_flight(self) -> bool:
        """Started and not waited for yet."""
        return self._done is None

    def wait(self) -> torch.Tensor:
        if self._done is None:
            self.work.wait()
            d, out = self.dim, self.out
            self._done = torch.cat([out[j].narrow(d, 0, s) for j, s in zip(self.holders, self.shapes)], dim=d)
            self.out = self.work = None
        return self._done


def all_gather_start(x: torch.Tensor, group, dim: int, shapes: Sequence[int], order=None) -> PendingGather:
    """Start :func:`all_gather` (``shapes``: every block's size along ``dim``; uneven ones padded) without
    waiting for it: the prefetched gathers of :mod:`einshard.params.zero`. ``order``: the group rank holding
    each block (default: block ``j`` on group rank ``j``), as for :func:`all_gather`.

    >>> pending = all_gather_start(x, group, 0, [2, 2])  # doctest: +SKIP
    >>> pending.wait().shape  # doctest: +SKIP
    torch.Size([4])
    """
    size = group_size(group)
    d, err = check_dim(dim, x.dim(), "all_gather_start")
    if err is not None:
        raise err
    shapes = list(shapes)
    if order is not None:
        order = check_order(order, size, "all_gather_start")
    me = 0 if size == 1 else group_rank(group) if order is None else order.index(group_rank(group))
    if len(shapes) != size or x.shape[d] != shapes[me]:
        raise EinshardError(f"all_gather_start: shapes {shapes} do not fit this rank's {tuple(x.shape)} along {dim}")
    x = x.detach()
    m = max(shapes)
    block = x.new_zeros(x.shape[:d] + (m,) + x.shape[d + 1 :])
    block.narrow(d, 0, x.shape[d]).copy_(x)
    out = block.new_empty((size,) + block.shape)
    if size == 1 or block.numel() == 0:
        out.copy_(block.expand_as(out))
        return PendingGather(out, CompletedWork(), d, shapes, order)
    if _stats.is_active():
        record("all_gather", group, size, block.numel() * block.element_size())
    work = all_gather_tensor(flat(out), flat(block), group=group, async_op=True)
    return PendingGather(out, work, d, shapes, order)
