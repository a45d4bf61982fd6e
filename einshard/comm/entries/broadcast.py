"""``broadcast``: one rank's value on every rank of a group; its adjoint is ``all_reduce`` (every rank
receives the sum of the gradients, as a replicated input gets its full gradient everywhere)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core._torch_compat import functional_collectives as fc
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import agree, back, contiguous_clone, flat, global_rank, group_rank, group_size, real, record
from ..collective import Collective, register
from ..primitives import invariant

__all__ = ["BROADCAST"]


def broadcast(x: torch.Tensor, group=None, src: int = 0):
    """Rank ``src``'s ``x`` on every rank of ``group``, as a new tensor.

    ``src`` is the rank *within the group*. The other ranks' ``x`` only give
    the shape and dtype (they must match ``src``'s).

    >>> y = broadcast(torch.full((2,), float(rank)), group, src=1)  # doctest: +SKIP
    >>> y  # on every rank  # doctest: +SKIP
    tensor([1., 1.])
    """
    size = group_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise EinshardError(f"broadcast: src={src!r} is not a rank of the group (size {size})")
    if _checks.agreement_needed():
        agree(group, None, "broadcast", x, extra=(("src", src),))
    return x.detach(), group, src


def _eager(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    size = group_size(group)
    if size == 1:
        return contiguous_clone(x)
    rank = group_rank(group)
    y = contiguous_clone(x) if rank == src else torch.empty_like(x, memory_format=torch.contiguous_format)
    if _stats.is_active():
        record("broadcast", group, size, y.numel() * y.element_size(), rank == src)
    dist.broadcast(flat(y), src=global_rank(group, src), group=group)
    return y


def _traced(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Group rank ``src``'s ``x`` on every rank."""
    if group.size() == 1:
        return x.clone()
    return back(fc.broadcast(real(x), src, group), x)


BROADCAST = register(Collective(
    name="broadcast",
    traffic=lambda p, n, root: (n / p, n * (p - 1) / p) if root is None else (n, 0) if root else (0, n),
    vary=invariant,
    check=broadcast,
    eager=_eager,
    traced=_traced,
    adjoint="all_reduce",
    transpose=lambda group, src: (group,),
))
