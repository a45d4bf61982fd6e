"""``all_to_all_v``: a chunk of any size to every rank of a group (the transport of the planner's
``exchange`` steps); no autograd form (the exchange is its own adjoint)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core._torch_compat import functional_collectives as fc
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import agree, all_to_all_single, group_rank, group_size, real, sizes
from ..collective import Collective, register
from ..primitives import same, varying

__all__ = ["ALL_TO_ALL_V"]


def all_to_all_v(chunks: Sequence[torch.Tensor], recv_numels: Sequence[int], group):
    """General exchange: ``chunks[j]`` goes to group rank ``j``; returns what each rank sent here.

    Chunks may have any shape (they are flattened) and must share one dtype;
    ``recv_numels[j]`` is the element count rank ``j`` sends to this rank.
    Returns flat 1-D tensors, one per source rank. This rank's own chunk is
    passed through without communication (the result may share its memory).
    One ``all_to_all_single`` with split sizes (for point-to-point transfers
    with only some peers, see :func:`isend_irecv`).

    >>> got = all_to_all_v([torch.full((j,), float(rank)) for j in range(P)], [rank] * P, group)  # doctest: +SKIP
    >>> got[j]  # rank j's chunk for this rank: `rank` elements equal to j  # doctest: +SKIP
    """
    size = group_size(group)
    chunks = list(chunks)
    if len(chunks) != size:
        raise EinshardError(f"all_to_all_v: got {len(chunks)} chunks but the group has {size} ranks")
    recv_numels = sizes(recv_numels, "all_to_all_v: recv_numels", size)
    rank = group_rank(group) if size > 1 else 0
    err = None
    dtype = chunks[rank].dtype
    if any(c.dtype != dtype for c in chunks):
        err = EinshardError(f"all_to_all_v: chunks have different dtypes {sorted({str(c.dtype) for c in chunks})}")
    elif chunks[rank].numel() != recv_numels[rank]:
        err = EinshardError(
            f"all_to_all_v: this rank (group rank {rank}) keeps {chunks[rank].numel()} elements for itself "
            f"but recv_numels[{rank}] = {recv_numels[rank]}"
        )
    if err is not None or _checks.agreement_needed():
        agree(group, err, "all_to_all_v", extra=(("dtype", dtype), ("device", chunks[rank].device)))
    return [c.detach() for c in chunks], recv_numels, group


def _eager(chunks, recv_numels, group) -> list[torch.Tensor]:
    size = len(chunks)
    rank = group_rank(group) if size > 1 else 0
    own = chunks[rank].reshape(-1)
    if size == 1:
        return [own]
    in_splits = [0 if j == rank else c.numel() for j, c in enumerate(chunks)]
    out_splits = [0 if j == rank else n for j, n in enumerate(recv_numels)]
    send = [c.reshape(-1) for j, c in enumerate(chunks) if j != rank and c.numel()]
    inp = torch.cat(send) if send else own.new_empty(0)
    out = own.new_empty(sum(out_splits))
    # Always called: a rank cannot know whether the others exchange anything.
    if _stats.is_active():
        isz = own.element_size()
        _stats.record("all_to_all_v", group, sum(in_splits) * isz, sum(out_splits) * isz)
    all_to_all_single(out, inp, out_splits, in_splits, group)
    result = list(out.split(out_splits))
    result[rank] = own
    return result


def _traced(chunks, recv_numels, group) -> list:
    """``chunks[j]`` to group rank ``j``; returns the flat chunks every rank sent here."""
    size = group.size()
    rank = group.rank() if size > 1 else 0
    own = chunks[rank].reshape(-1)
    if size == 1:
        return [own]
    factor = 2 if own.is_complex() else 1
    in_splits = [0 if j == rank else c.numel() for j, c in enumerate(chunks)]
    out_splits = [0 if j == rank else n for j, n in enumerate(recv_numels)]
    send = [real(c).reshape(-1) for j, c in enumerate(chunks) if j != rank and c.numel()]
    inp = torch.cat(send) if send else real(own).reshape(-1)[:0]
    out = fc.all_to_all_single(inp, [s * factor for s in out_splits], [s * factor for s in in_splits], group)
    if own.is_complex():
        out = torch.view_as_complex(out.view(-1, 2))
    result = list(out.split(out_splits))
    result[rank] = own
    return result


ALL_TO_ALL_V = register(Collective(
    name="all_to_all_v",
    traffic=same,
    vary=varying,
    check=all_to_all_v,
    eager=_eager,
    traced=_traced,
))
