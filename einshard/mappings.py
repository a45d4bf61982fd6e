"""Autograd mappings: collectives whose backward is the exact adjoint (SPEC §3, §8).

Each mapping is a ``torch.autograd.Function`` in the ``setup_context`` style,
so it composes with ``torch.func.grad`` and ``torch.func.vjp``; its backward
calls the adjoint *mapping* (not the raw collective), so double backward
works. Use the plain functions below.

Layouts, with the inner product that makes each pair adjoint
(``Σ_r`` sums over the ranks of the group):

- *replicated*: the same value on every rank; one copy counts.
- *per-rank* (partial / varying): each rank's own value; ``Σ_r <x_r, y_r>``.
- *sharded*: rank ``r`` holds block ``r``; ``Σ_r <x_r, y_r>``.

=========================================== ============== ============== =========================
mapping                                     input          output         backward
=========================================== ============== ============== =========================
allreduce_forward_identity_backward         per-rank       replicated     identity
identity_forward_allreduce_backward         replicated     per-rank       all-reduce
broadcast_forward_allreduce_backward        src's copy     per-rank       all-reduce (every rank)
allgather_forward_split_backward            sharded        replicated     own block
split_forward_allgather_backward            replicated     sharded        all-gather
reducescatter_forward_allgather_backward    per-rank       sharded        all-gather
allgather_forward_reducescatter_backward    sharded        per-rank       reduce-scatter
alltoall_repartition                        sharded (src)  sharded (dst)  inverse all-to-all
ppermute                                    per-rank       per-rank       inverse permutation
=========================================== ============== ============== =========================
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import collectives as C
from ._split import compute_split_shapes

__all__ = [
    "allreduce_forward_identity_backward",
    "identity_forward_allreduce_backward",
    "broadcast_forward_allreduce_backward",
    "allgather_forward_split_backward",
    "split_forward_allgather_backward",
    "reducescatter_forward_allgather_backward",
    "allgather_forward_reducescatter_backward",
    "alltoall_repartition",
    "ppermute",
]


def _norm_dim(dim: int, ndim: int) -> int:
    # Out-of-range dims are reported by the collective itself.
    return dim % ndim if ndim and -ndim <= dim < ndim else dim


def _even(x: torch.Tensor, dim: int, size: int) -> tuple[int, ...]:
    return (x.shape[_norm_dim(dim, x.dim())],) * size


def _split_shapes(x: torch.Tensor, dim: int, size: int, shapes) -> tuple[int, ...] | None:
    if shapes is not None:
        return tuple(shapes)
    d = _norm_dim(dim, x.dim())
    if not 0 <= d < x.dim():
        return None
    return tuple(compute_split_shapes(x.shape[d], size))


# -- all-reduce / identity / broadcast -----------------------------------------------


class _AllReduceIdentity(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return C.all_reduce(x, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _IdentityAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return allreduce_forward_identity_backward(grad, ctx.group), None


class _BroadcastAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group, src):
        return C.broadcast(x, group, src)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, grad):
        return allreduce_forward_identity_backward(grad, ctx.group), None, None


def allreduce_forward_identity_backward(x: torch.Tensor, group) -> torch.Tensor:
    """Sum a per-rank value over ``group`` (forward); the gradient passes through unchanged.

    Megatron's "reduce from the model-parallel region" and JAX's ``psum``.

    >>> y = allreduce_forward_identity_backward(partial_out, tp_group)  # doctest: +SKIP
    """
    return _AllReduceIdentity.apply(x, group)


def identity_forward_allreduce_backward(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; sums the gradient over ``group`` in backward.

    Marks a replicated value as feeding per-rank computation (JAX's ``pvary``,
    Megatron's "copy to the model-parallel region").

    >>> h = identity_forward_allreduce_backward(x, tp_group) @ w_shard  # doctest: +SKIP
    """
    return _IdentityAllReduce.apply(x, group)


def broadcast_forward_allreduce_backward(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """``src``'s ``x`` on every rank (forward); the gradient is summed over ``group`` (backward).

    The output feeds per-rank computation (like
    :func:`identity_forward_allreduce_backward`), so the gradient of ``src``'s
    value is the sum of the ranks' gradients; every rank receives that sum (a
    replicated input gets its full gradient everywhere, SPEC §3).

    >>> w = broadcast_forward_allreduce_backward(w, dp_group, src=0)  # doctest: +SKIP
    """
    return _BroadcastAllReduce.apply(x, group, src)


# -- all-gather / split / reduce-scatter ------------------------------------------------


class _AllGatherSplit(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim, shapes):
        return C.all_gather(x, group, dim, shapes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim, ctx.shapes = inputs

    @staticmethod
    def backward(ctx, grad):
        return split_forward_allgather_backward(grad, ctx.group, ctx.dim, ctx.shapes), None, None, None


class _SplitAllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim, shapes):
        return C.split(x, group, dim, shapes).contiguous()

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim, ctx.shapes = inputs

    @staticmethod
    def backward(ctx, grad):
        return allgather_forward_split_backward(grad, ctx.group, ctx.dim, ctx.shapes), None, None, None


class _ReduceScatterAllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim, shapes):
        return C.reduce_scatter(x, group, dim, shapes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim, ctx.shapes = inputs

    @staticmethod
    def backward(ctx, grad):
        return allgather_forward_reducescatter_backward(grad, ctx.group, ctx.dim, ctx.shapes), None, None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(x, group, dim, shapes):
        return C.all_gather(x, group, dim, shapes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.dim, ctx.shapes = inputs

    @staticmethod
    def backward(ctx, grad):
        return reducescatter_forward_allgather_backward(grad, ctx.group, ctx.dim, ctx.shapes), None, None, None


def allgather_forward_split_backward(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None):
    """Gather a sharded ``x`` along ``dim`` into a replicated tensor; backward keeps this rank's block.

    ``shapes``: per-rank sizes along ``dim`` (``None``: even).

    >>> full = allgather_forward_split_backward(x_shard, tp_group, 0, [3, 3, 3, 1])  # doctest: +SKIP
    """
    shapes = tuple(shapes) if shapes is not None else _even(x, dim, C.group_size(group))
    return _AllGatherSplit.apply(x, group, dim, shapes)


def split_forward_allgather_backward(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None):
    """This rank's block of a replicated ``x`` along ``dim``; backward all-gathers the gradient.

    ``shapes``: per-rank sizes (``None``: ``compute_split_shapes(x.shape[dim], P)``).
    The result is a contiguous copy of the block.

    >>> x_shard = split_forward_allgather_backward(x, tp_group, 0, None)  # doctest: +SKIP
    """
    shapes = _split_shapes(x, dim, C.group_size(group), shapes)
    return _SplitAllGather.apply(x, group, dim, shapes)


def reducescatter_forward_allgather_backward(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None):
    """This rank's block of the sum over ranks of per-rank ``x``; backward all-gathers the gradient.

    ``shapes``: per-rank sizes (``None``: ``compute_split_shapes(x.shape[dim], P)``).

    >>> out_shard = reducescatter_forward_allgather_backward(partial, tp_group, 0, None)  # doctest: +SKIP
    """
    shapes = _split_shapes(x, dim, C.group_size(group), shapes)
    return _ReduceScatterAllGather.apply(x, group, dim, shapes)


def allgather_forward_reducescatter_backward(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None):
    """Gather a sharded ``x`` for per-rank use; backward reduce-scatters the gradient.

    Sequence parallelism's entry to a tensor-parallel region.

    >>> full = allgather_forward_reducescatter_backward(x_shard, tp_group, 1, None)  # doctest: +SKIP
    """
    shapes = tuple(shapes) if shapes is not None else _even(x, dim, C.group_size(group))
    return _AllGatherReduceScatter.apply(x, group, dim, shapes)


# -- all-to-all / ppermute -----------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, group, src_dim, dst_dim, src_shapes, dst_shapes):
        return C.all_to_all(x, group, src_dim, dst_dim, src_shapes, dst_shapes)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.group, ctx.src_dim, ctx.dst_dim, ctx.src_shapes, ctx.dst_shapes = inputs

    @staticmethod
    def backward(ctx, grad):
        g = alltoall_repartition(grad, ctx.group, ctx.dst_dim, ctx.src_dim, ctx.dst_shapes, ctx.src_shapes)
        return g, None, None, None, None, None


def alltoall_repartition(
    x: torch.Tensor,
    group,
    src_dim: int,
    dst_dim: int,
    src_shapes: Sequence[int] | None = None,
    dst_shapes: Sequence[int] | None = None,
) -> torch.Tensor:
    """Move the sharding of ``x`` from ``src_dim`` to ``dst_dim`` (all-to-all); backward moves it back.

    ``src_shapes`` default to even; ``dst_shapes`` to
    ``compute_split_shapes(x.shape[dst_dim], P)``.

    >>> y = alltoall_repartition(x, sp_group, 1, 2, [3, 3, 2], None)  # doctest: +SKIP
    """
    size = C.group_size(group)
    if src_shapes is not None:
        src_shapes = tuple(src_shapes)
    elif -x.dim() <= src_dim < x.dim():
        src_shapes = _even(x, src_dim, size)
    dst_shapes = _split_shapes(x, dst_dim, size, dst_shapes)
    return _AllToAll.apply(x, group, src_dim, dst_dim, src_shapes, dst_shapes)


class _PPermute(torch.autograd.Function):
    @staticmethod
    def forward(x, group, perm, recv_shape):
        return C.ppermute(x, group, perm, recv_shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.group, ctx.perm, _ = inputs
        ctx.in_shape = tuple(x.shape)

    @staticmethod
    def backward(ctx, grad):
        inverse = [(d, s) for s, d in ctx.perm]
        return ppermute(grad, ctx.group, inverse, recv_shape=ctx.in_shape), None, None, None


def ppermute(x: torch.Tensor, group, perm, *, recv_shape=None) -> torch.Tensor:
    """Send ``x`` along the ``(src, dst)`` group-rank pairs of ``perm``; backward sends gradients back.

    A rank that receives nothing gets zeros (and a rank that sends nothing
    gets a zero gradient). ``recv_shape`` defaults to ``x.shape``.

    >>> y = ppermute(x, sp_group, [(i, (i + 1) % P) for i in range(P)])  # doctest: +SKIP
    """
    perm = tuple((int(s), int(d)) for s, d in C._check_perm(perm, C.group_size(group)))
    recv_shape = tuple(recv_shape) if recv_shape is not None else None
    return _PPermute.apply(x, group, perm, recv_shape)
