"""``ppermute``: each rank's value sent along ``(source, destination)`` pairs (JAX's ``ppermute``); its
adjoint is the inverse permutation. Also :func:`isend_irecv`, the batched point-to-point transfers."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import agree, contiguous_clone, flat, global_rank, group_rank, group_size
from ..collective import Collective, register
from ..primitives import varying
from .all_to_all_v import ALL_TO_ALL_V

__all__ = ["PPERMUTE", "check_perm", "isend_irecv", "permute"]


def check_perm(perm, size: int) -> list[tuple[int, int]]:
    """``perm`` as ``(source, destination)`` pairs, checked against a group of ``size`` ranks."""
    pairs = []
    try:
        for pair in perm:
            s, d = pair
            if isinstance(s, bool) or isinstance(d, bool) or int(s) != s or int(d) != d:
                raise TypeError
            pairs.append((int(s), int(d)))
    except (TypeError, ValueError):
        raise EinshardError(f"ppermute: perm must be a list of (src, dst) rank pairs, got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise EinshardError(f"ppermute: pair {(s, d)} names a rank outside the group (size {size})")
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    if len(set(srcs)) != len(srcs):
        raise EinshardError(f"ppermute: a rank sends more than once in {pairs}")
    if len(set(dsts)) != len(dsts):
        raise EinshardError(f"ppermute: a rank receives more than once in {pairs}")
    return pairs


def ppermute(x: torch.Tensor, group, perm, recv_shape=None):
    """Send ``x`` along the ``(src, dst)`` pairs of ``perm`` (group ranks), like ``jax.lax.ppermute``.

    Each rank sends at most once and receives at most once; a rank that
    receives nothing gets zeros. ``recv_shape`` (default ``x.shape``) is the
    shape this rank receives. Batched ``isend``/``irecv``.

    >>> ring = [(i, (i + 1) % P) for i in range(P)]  # doctest: +SKIP
    >>> ppermute(torch.tensor([float(rank)]), group, ring)  # rank r gets r-1  # doctest: +SKIP
    """
    size = group_size(group)
    pairs = check_perm(perm, size)
    x = x.detach()
    recv_shape = tuple(x.shape) if recv_shape is None else tuple(int(s) for s in recv_shape)
    rank = group_rank(group) if size > 1 else 0
    dst = next((d for s, d in pairs if s == rank), None)
    src = next((s for s, d in pairs if d == rank), None)
    err = None
    if src == rank and math.prod(recv_shape) != x.numel():
        err = EinshardError(f"ppermute: rank {rank} sends to itself but recv_shape {recv_shape} != {tuple(x.shape)}")
    if err is not None or _checks.agreement_needed():
        agree(group, err, "ppermute", extra=(("dtype", x.dtype), ("device", x.device), ("perm", pairs)),
              sent=x.numel() if dst is not None else -1, received=math.prod(recv_shape) if src is not None else -1,
              pairs=pairs)
    return x, group, pairs, recv_shape


def _eager(x: torch.Tensor, group, pairs, recv_shape) -> torch.Tensor:
    size = group_size(group)
    rank = group_rank(group) if size > 1 else 0
    dst = next((d for s, d in pairs if s == rank), None)
    src = next((s for s, d in pairs if d == rank), None)
    if src is None:
        out = x.new_zeros(recv_shape)
    elif src == rank:
        out = contiguous_clone(x).view(recv_shape)
    else:
        out = x.new_empty(recv_shape)
    if size == 1:
        return out
    ops = []
    sent = received = 0
    if dst is not None and dst != rank and x.numel():
        xc = x.contiguous()
        ops.append(dist.P2POp(dist.isend, flat(xc), global_rank(group, dst), group))
        sent = xc.numel() * xc.element_size()
    if src is not None and src != rank and out.numel():
        ops.append(dist.P2POp(dist.irecv, flat(out), global_rank(group, src), group))
        received = out.numel() * out.element_size()
    if _stats.is_active():
        _stats.record("ppermute", group, sent, received)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out


def _traced(x: torch.Tensor, group, pairs, recv_shape) -> torch.Tensor:
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
        traced = ALL_TO_ALL_V.traced
        assert traced is not None  # every entry has its traced transport
        got = traced(chunks, recv, group)
        if src is not None and src != rank:
            return got[src].view(recv_shape)
    if src is None:
        return x.new_zeros(recv_shape)
    return x.clone().view(recv_shape)


def permute(x: torch.Tensor, group, perm, *, recv_shape=None, order=None) -> torch.Tensor:
    """The autograd form on ``perm`` checked, of blocks with ``order`` (the group rank holding each block)."""
    perm = tuple((int(s), int(d)) for s, d in check_perm(perm, group_size(group)))
    if order is not None:
        perm = tuple((order[s], order[d]) for s, d in perm)
    recv_shape = tuple(recv_shape) if recv_shape is not None else None
    return PPERMUTE.autograd(x, group, perm, recv_shape, tuple(x.shape))


def _named(x, axes, perm):
    """Send ``x`` along the ``(src, dst)`` pairs of ``perm`` (indices within the ``dim_name`` group).

    JAX's ``ppermute``: a rank that receives nothing gets zeros. The output
    varies over ``dim_name``; backward: the inverse permutation.

    >>> n = es.spmd.axis_size("sp")                                             # doctest: +SKIP
    >>> right = es.spmd.ppermute(x, "sp", [(i, (i + 1) % n) for i in range(n)])  # doctest: +SKIP
    """
    order = axes.order
    pairs = [tuple(p) for p in perm]
    return permute if order is None else functools.partial(permute, order=order), (x, axes.group, pairs)


def _transpose(group, perm, recv_shape, in_shape):
    """The inverse permutation, receiving the forward's input shape."""
    return group, tuple((d, s) for s, d in perm), in_shape, in_shape if recv_shape is None else recv_shape


def isend_irecv(sends, recvs, group, kind: str = "all_to_all_v") -> list:
    """Start batched point-to-point transfers; returns the works to ``wait()`` on.

    ``sends`` / ``recvs``: ``(group rank, contiguous tensor)`` pairs; received
    tensors are written in place (views of a larger buffer are fine). Records
    one ``kind`` call in :mod:`einshard.comm.comm_stats`, also when nothing moves.

    >>> works = isend_irecv([(1, x)], [(1, buf)], group)  # a swap with group rank 1  # doctest: +SKIP
    >>> for w in works: w.wait()  # doctest: +SKIP
    """
    if _stats.is_active():
        _stats.record(kind, group, sum(t.numel() * t.element_size() for _, t in sends),
                      sum(t.numel() * t.element_size() for _, t in recvs))
    ops = [dist.P2POp(dist.isend, flat(t), global_rank(group, j), group) for j, t in sends]
    ops += [dist.P2POp(dist.irecv, flat(t), global_rank(group, j), group) for j, t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


PPERMUTE: Collective = register(Collective(
    name="ppermute",
    vary=varying,
    check=ppermute,
    eager=_eager,
    traced=_traced,
    forward=lambda x, group, perm, recv_shape, in_shape: PPERMUTE.raw(x, group, perm, recv_shape),
    adjoint="ppermute",
    transpose=_transpose,
    named="ppermute",
    bind=_named,
))
