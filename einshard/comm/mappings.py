"""Autograd mappings: collectives whose backward is the exact adjoint.

Each mapping is a ``torch.autograd.Function`` in the ``setup_context`` style,
so it composes with ``torch.func.grad`` and ``torch.func.vjp``; its backward
calls the adjoint *mapping* (not the raw collective), so double backward
works. Use the plain functions below.

Layouts, with the inner product that makes each pair adjoint
(``Σ_r`` sums over the ranks of the group):

- *replicated*: the same value on every rank; one copy counts.
- *per-rank* (partial / varying): each rank's own value; ``Σ_r <x_r, y_r>``.
- *sharded*: rank ``r`` holds block ``r``; ``Σ_r <x_r, y_r>``.

The communication guide tabulates every mapping's layouts and backward.

Blocks are in group-rank order; the block mappings (gathers, splits,
scatters, all-to-all, ``ppermute``) also take ``order``, the group rank
holding each block (``es.Mesh.order``), for meshes whose block order is not
the group's rank order. The backward uses the same order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core import _torch_compat, _trace
from ..core._split import compute_split_shapes
from . import collectives as C

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


def _shapes(x: torch.Tensor, group, dim: int, shapes, even: bool) -> tuple[int, ...] | None:
    """``shapes`` as a tuple; ``None``: ``x.shape[dim]`` on every rank (``even``) or ``compute_split_shapes``.

    ``None`` for an out-of-range ``dim``: the collective itself reports it.
    """
    if shapes is not None:
        return tuple(shapes)
    if not -x.dim() <= dim < x.dim():
        return None
    n, size = x.shape[dim], C.group_size(group)
    return (n,) * size if even else tuple(compute_split_shapes(n, size))


_C_APPLY = _torch_compat.function_base_apply
_transforms_active = _torch_compat.functorch_transforms_active
_traced = _trace.traced  # (hot paths: one global read)


def make_mapping(name: str, forward, adjoint):
    """An autograd Function: ``forward(x, *args)`` (raw collectives); backward ``adjoint(grad, *args)``.

    ``adjoint`` is itself a mapping, so double backward works. Returned as a
    fast ``apply`` (every argument positional): ``Function.apply`` binds
    default arguments with ``inspect.signature`` on every call when
    ``setup_context`` is defined (about 15 µs); outside ``torch.func``
    transforms and code that dynamo traces, which need that path, the C
    implementation is called directly (and in traced code that needs no
    gradient, the forward alone).
    """

    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(x, *args):
            return forward(x, *args)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.args = inputs[1:]

        @staticmethod
        def backward(ctx, grad):
            return (adjoint(grad, *ctx.args),) + (None,) * len(ctx.args)

    Mapping.__name__ = Mapping.__qualname__ = name
    raw, slow = _C_APPLY.__get__(None, Mapping), Mapping.apply

    def apply(*args):
        if _traced():  # Function.apply; without a gradient to track, the forward (dynamo would pass it a ctx)
            return slow(*args) if args[0].requires_grad and torch.is_grad_enabled() else forward(*args)
        return slow(*args) if _transforms_active() else raw(*args)

    return apply


def _identity(x, *args):
    return x.view_as(x)


# -- all-reduce / identity / broadcast -----------------------------------------------

_allreduce_identity = make_mapping(
    "AllReduceIdentity", lambda x, g: C.all_reduce(x, g), lambda d, g: identity_forward_allreduce_backward(d, g)
)
_identity_allreduce = make_mapping(
    "IdentityAllReduce", _identity, lambda d, g: allreduce_forward_identity_backward(d, g)
)
_broadcast_allreduce = make_mapping(
    "BroadcastAllReduce", C.broadcast, lambda d, g, src: allreduce_forward_identity_backward(d, g)
)


def allreduce_forward_identity_backward(x: torch.Tensor, group) -> torch.Tensor:
    """Sum a per-rank value over ``group`` (forward); the gradient passes through unchanged.

    Megatron's "reduce from the model-parallel region" and JAX's ``psum``.

    >>> y = allreduce_forward_identity_backward(partial_out, tp_group)  # doctest: +SKIP
    """
    return _allreduce_identity(x, group)


def identity_forward_allreduce_backward(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; sums the gradient over ``group`` in backward.

    Marks a replicated value as feeding per-rank computation (JAX's ``pvary``,
    Megatron's "copy to the model-parallel region").

    >>> h = identity_forward_allreduce_backward(x, tp_group) @ w_shard  # doctest: +SKIP
    """
    return _identity_allreduce(x, group)


def broadcast_forward_allreduce_backward(x: torch.Tensor, group, src: int = 0) -> torch.Tensor:
    """``src``'s ``x`` on every rank (forward); the gradient is summed over ``group`` (backward).

    The output feeds per-rank computation (like
    :func:`identity_forward_allreduce_backward`), so the gradient of ``src``'s
    value is the sum of the ranks' gradients; every rank receives that sum (a
    replicated input gets its full gradient everywhere).

    >>> w = broadcast_forward_allreduce_backward(w, dp_group, src=0)  # doctest: +SKIP
    """
    return _broadcast_allreduce(x, group, src)


# -- all-gather / split / reduce-scatter ------------------------------------------------

# ``*a`` is ``(group, dim, shapes, order)``.
_allgather_split = make_mapping("AllGatherSplit", C.all_gather, lambda d, *a: split_forward_allgather_backward(d, *a))
_split_allgather = make_mapping(
    "SplitAllGather", lambda x, *a: C.split(x, *a).contiguous(), lambda d, *a: allgather_forward_split_backward(d, *a)
)
_reducescatter_allgather = make_mapping(
    "ReduceScatterAllGather", C.reduce_scatter, lambda d, *a: allgather_forward_reducescatter_backward(d, *a)
)
_allgather_reducescatter = make_mapping(
    "AllGatherReduceScatter", C.all_gather, lambda d, *a: reducescatter_forward_allgather_backward(d, *a)
)


def allgather_forward_split_backward(
    x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None
):
    """Gather a sharded ``x`` along ``dim`` into a replicated tensor; backward keeps this rank's block.

    ``shapes``: per-rank sizes along ``dim`` (``None``: even); ``order``: the
    group rank holding each block (``None``: block ``j`` on group rank ``j``).

    >>> full = allgather_forward_split_backward(x_shard, tp_group, 0, [3, 3, 3, 1])  # doctest: +SKIP
    """
    return _allgather_split(x, group, dim, _shapes(x, group, dim, shapes, True), order)


def split_forward_allgather_backward(
    x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None
):
    """This rank's block of a replicated ``x`` along ``dim``; backward all-gathers the gradient.

    ``shapes``: per-rank sizes (``None``: ``compute_split_shapes(x.shape[dim], P)``).
    The result is a contiguous copy of the block.

    >>> x_shard = split_forward_allgather_backward(x, tp_group, 0, None)  # doctest: +SKIP
    """
    return _split_allgather(x, group, dim, _shapes(x, group, dim, shapes, False), order)


def reducescatter_forward_allgather_backward(
    x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None
):
    """This rank's block of the sum over ranks of per-rank ``x``; backward all-gathers the gradient.

    ``shapes``: per-rank sizes (``None``: ``compute_split_shapes(x.shape[dim], P)``).

    >>> out_shard = reducescatter_forward_allgather_backward(partial, tp_group, 0, None)  # doctest: +SKIP
    """
    return _reducescatter_allgather(x, group, dim, _shapes(x, group, dim, shapes, False), order)


def allgather_forward_reducescatter_backward(
    x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None
):
    """Gather a sharded ``x`` for per-rank use; backward reduce-scatters the gradient.

    Sequence parallelism's entry to a tensor-parallel region.

    >>> full = allgather_forward_reducescatter_backward(x_shard, tp_group, 1, None)  # doctest: +SKIP
    """
    return _allgather_reducescatter(x, group, dim, _shapes(x, group, dim, shapes, True), order)


# -- all-to-all / ppermute -----------------------------------------------------------------


_alltoall = make_mapping(
    "AllToAll",
    C.all_to_all,
    lambda d, g, src_dim, dst_dim, src_shapes, dst_shapes, order: alltoall_repartition(
        d, g, dst_dim, src_dim, dst_shapes, src_shapes, order
    ),
)


def alltoall_repartition(
    x: torch.Tensor,
    group,
    src_dim: int,
    dst_dim: int,
    src_shapes: Sequence[int] | None = None,
    dst_shapes: Sequence[int] | None = None,
    order=None,
) -> torch.Tensor:
    """Move the sharding of ``x`` from ``src_dim`` to ``dst_dim`` (all-to-all); backward moves it back.

    ``src_shapes`` default to even; ``dst_shapes`` to
    ``compute_split_shapes(x.shape[dst_dim], P)``; ``order``: the group rank
    holding each block (``None``: block ``j`` on group rank ``j``).

    >>> y = alltoall_repartition(x, sp_group, 1, 2, [3, 3, 2], None)  # doctest: +SKIP
    """
    src_shapes = _shapes(x, group, src_dim, src_shapes, True)
    dst_shapes = _shapes(x, group, dst_dim, dst_shapes, False)
    return _alltoall(x, group, src_dim, dst_dim, src_shapes, dst_shapes, order)


_ppermute = make_mapping(
    "PPermute",
    lambda x, g, perm, recv_shape, in_shape: C.ppermute(x, g, perm, recv_shape),
    lambda d, g, perm, recv_shape, in_shape: ppermute(d, g, [(dst, src) for src, dst in perm], recv_shape=in_shape),
)


def ppermute(x: torch.Tensor, group, perm, *, recv_shape=None, order=None) -> torch.Tensor:
    """Send ``x`` along the ``(src, dst)`` group-rank pairs of ``perm``; backward sends gradients back.

    A rank that receives nothing gets zeros (and a rank that sends nothing
    gets a zero gradient). ``recv_shape`` defaults to ``x.shape``. With
    ``order`` (the group rank holding each block), ``perm`` pairs blocks.

    >>> y = ppermute(x, sp_group, [(i, (i + 1) % P) for i in range(P)])  # doctest: +SKIP
    """
    perm = tuple((int(s), int(d)) for s, d in C.check_perm(perm, C.group_size(group)))
    if order is not None:
        perm = tuple((order[s], order[d]) for s, d in perm)
    recv_shape = tuple(recv_shape) if recv_shape is not None else None
    return _ppermute(x, group, perm, recv_shape, tuple(x.shape))
