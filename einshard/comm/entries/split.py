"""``split``: this rank's block of a value the same on every rank (no communication); its adjoint is
``all_gather``."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import checks as _checks
from ..arguments import agree, along, group_rank, whole_split
from ..arguments import order as check_order
from ..collective import Collective, register

__all__ = ["SPLIT"]


def split(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None):
    """This rank's block of ``x`` along ``dim`` (a view; no communication).

    ``shapes`` are the per-rank block sizes (default
    ``compute_split_shapes(x.shape[dim], P)``); they must sum to ``x.shape[dim]``.
    ``order``: the group rank holding each block (default: block ``j`` on group rank ``j``).

    >>> split(torch.arange(10), group, 0)  # rank 3 of 4 → shapes [3, 3, 3, 1]  # doctest: +SKIP
    tensor([9])
    """
    size, shapes, d, err = along(x, group, dim, shapes, "split")
    if order is not None:
        order = check_order(order, size, "split")
    if err is None:
        shapes, err = whole_split(shapes, x.shape[d], size, "split: shapes", f"dim {dim}")
    if err is not None or _checks.agreement_needed():
        agree(group, err, "split")
    return x.detach(), group, d, shapes, order


def _block(x: torch.Tensor, group, dim: int, shapes, order=None) -> torch.Tensor:
    """The block of group rank ``group_rank(group)`` (a view)."""
    rank = group_rank(group) if len(shapes) > 1 else 0
    me = rank if order is None else order.index(rank)
    return x.narrow(dim, sum(shapes[:me]), shapes[me])


SPLIT: Collective = register(Collective(
    name="split",
    check=split,
    eager=_block,
    traced=_block,
    forward=lambda x, *args: SPLIT.raw(x, *args).contiguous(),
    adjoint="all_gather",
))
