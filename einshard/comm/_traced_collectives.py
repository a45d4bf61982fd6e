"""The raw collectives of :mod:`einshard.comm.collectives`, as functional collectives for traced code.

Under ``torch.compile`` a plan's transitions call these instead of the
in-place ``torch.distributed`` ones: each is built on
``torch.distributed._functional_collectives`` (a graph node that returns a
new tensor), so a whole layer is one graph and inductor may reorder and
overlap its communication. Same signatures and results as the eager
functions (uneven blocks padded to the largest, as there); arguments were
checked when the plan was made, so there is no validation here. ``order``
(the group rank holding each block, ``None``: block ``j`` on group rank
``j``) is as in the eager functions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed._functional_collectives as fc

__all__ = ["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "ppermute"]


def _real(x: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(x.contiguous()) if x.is_complex() else x.contiguous()


def _back(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.view_as_complex(y) if like.is_complex() else y


def all_reduce(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """The sum (``op``: or ``"max"``, ``"min"``) of ``x`` over ``group``."""
    if group.size() == 1:
        return x.clone()
    return _back(fc.all_reduce(_real(x), op, group), x)


def broadcast(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """Group rank ``src``'s ``x`` on every rank."""
    if group.size() == 1:
        return x.clone()
    return _back(fc.broadcast(_real(x), src, group), x)


def _pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def all_gather(x: torch.Tensor, group, dim: int, shapes, order=None) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (``shapes``: per-block sizes)."""
    size = group.size()
    if size == 1:
        return x.clone()
    m = max(shapes)
    blocks = _back(fc.all_gather_tensor(_real(_pad(x, dim, m)).unsqueeze(0), 0, group), x)
    if order is not None:
        blocks = blocks[list(order)]  # block k came from group rank order[k]
    if all(s == m for s in shapes):
        return blocks.movedim(0, dim).reshape(x.shape[:dim] + (size * m,) + x.shape[dim + 1 :])
    return torch.cat([blocks[j].narrow(dim, 0, s) for j, s in enumerate(shapes) if s], dim)


def reduce_scatter(x: torch.Tensor, group, dim: int, shapes, order=None) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum of ``x`` over ``group``."""
    size = group.size()
    if size == 1:
        return x.clone()
    m = max(shapes)
    if all(s == m for s in shapes):
        buf = x.reshape(x.shape[:dim] + (size, m) + x.shape[dim + 1 :]).movedim(dim, 0)  # (unflatten: a super() call)
    else:
        offsets = [sum(shapes[:j]) for j in range(size)]
        buf = torch.stack([_pad(x.narrow(dim, o, s), dim, m) for o, s in zip(offsets, shapes)])
    if order is not None:  # slot j goes to group rank j: the block it holds
        buf = buf[[order.index(j) for j in range(size)]]
    out = _back(fc.reduce_scatter_tensor(_real(buf), "sum", 0, group), x)[0]
    mine = shapes[group.rank() if order is None else order.index(group.rank())]
    return out if mine == m else out.narrow(dim, 0, mine)


def all_to_all(x: torch.Tensor, group, src_dim: int, dst_dim: int, src_shapes, dst_shapes, order=None) -> torch.Tensor:
    """Sharded along ``src_dim`` -> sharded along ``dst_dim`` (one ``all_to_all_single``)."""
    size = group.size()
    if size == 1:
        return x.clone()
    if order is not None:  # in group-rank order along dst_dim, then the pieces back in block order
        return _all_to_all_ordered(x, group, src_dim, dst_dim, src_shapes, dst_shapes, order)
    sd, dd = src_dim, dst_dim
    rank = group.rank()
    other = math.prod([x.shape[k] for k in range(x.dim()) if k not in (sd, dd)])  # (dynamo: no generator)
    mine = dst_shapes[rank]
    factor = 2 if x.is_complex() else 1
    in_splits = [s * other * x.shape[sd] * factor for s in dst_shapes]
    out_splits = [mine * other * s * factor for s in src_shapes]
    flat = _real(x.movedim(dd, 0)).reshape(-1)
    out = fc.all_to_all_single(flat, out_splits, in_splits, group)
    if x.is_complex():
        out = torch.view_as_complex(out.view(-1, 2))
    moved = [mine] + [x.shape[k] for k in range(x.dim()) if k != dd]
    sd_moved = sd + 1 if sd < dd else sd
    pieces = []
    for s, part in zip(src_shapes, out.split([n // factor for n in out_splits])):
        if s:
            moved[sd_moved] = s
            pieces.append(part.view(moved).movedim(0, dd))
    return torch.cat(pieces, sd)


def _all_to_all_ordered(x, group, sd, dd, src_shapes, dst_shapes, order):
    """:func:`all_to_all` whose blocks live on group ranks ``order``: the dst blocks sent in group-rank
    order, the received src pieces put back in block order."""
    size = group.size()
    blocks = [order.index(j) for j in range(size)]  # the block group rank j holds
    offsets = [sum(dst_shapes[:b]) for b in range(size)]
    x = torch.cat([x.narrow(dd, offsets[b], dst_shapes[b]) for b in blocks], dd)
    y = all_to_all(x, group, sd, dd, [src_shapes[b] for b in blocks], [dst_shapes[b] for b in blocks])
    pieces = list(y.split([src_shapes[b] for b in blocks], sd))
    return torch.cat([pieces[order[k]] for k in range(size)], sd)


def all_to_all_v(chunks, recv_numels, group) -> list:
    """``chunks[j]`` to group rank ``j``; returns the flat chunks every rank sent here."""
    size = group.size()
    rank = group.rank() if size > 1 else 0
    own = chunks[rank].reshape(-1)
    if size == 1:
        return [own]
    factor = 2 if own.is_complex() else 1
    in_splits = [0 if j == rank else c.numel() for j, c in enumerate(chunks)]
    out_splits = [0 if j == rank else n for j, n in enumerate(recv_numels)]
    send = [_real(c).reshape(-1) for j, c in enumerate(chunks) if j != rank and c.numel()]
    inp = torch.cat(send) if send else _real(own).reshape(-1)[:0]
    out = fc.all_to_all_single(inp, [s * factor for s in out_splits], [s * factor for s in in_splits], group)
    if own.is_complex():
        out = torch.view_as_complex(out.view(-1, 2))
    result = list(out.split(out_splits))
    result[rank] = own
    return result


def ppermute(x: torch.Tensor, group, pairs, recv_shape) -> torch.Tensor:
    """``x`` sent along the ``(src, dst)`` group-rank ``pairs``; zeros of ``recv_shape`` where nothing arrives.

    One ``all_to_all_single`` that every rank of the group joins (with nothing to move where a rank has no
    pair).
    """
    size = group.size()
    rank = group.rank() if size > 1 else 0
    src = next((s for s, d in pairs if d == rank), None)
    if size > 1:
        dst = next((d for s, d in pairs if s == rank), None)
        chunks = [x.new_empty(0)] * size
        if dst is not None and dst != rank:
            chunks[dst] = x
        recv = [0] * size
        if src is not None and src != rank:
            recv[src] = math.prod(recv_shape)
        got = all_to_all_v(chunks, recv, group)
        if src is not None and src != rank:
            return got[src].view(recv_shape)
    if src is None:
        return x.new_zeros(recv_shape)
    return x.clone().view(recv_shape)
