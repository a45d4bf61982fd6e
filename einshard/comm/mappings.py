"""Autograd mappings: collectives whose backward is the exact adjoint.

Each mapping is the autograd form of an entry of :mod:`einshard.comm.entries`
(:attr:`einshard.comm.collective.Collective.autograd`), a ``torch.autograd.Function``
in the ``setup_context`` style, so it composes with ``torch.func.grad`` and
``torch.func.vjp``; its backward calls the adjoint entry's autograd form (not
the raw collective), so double backward works. The functions below are
torch-einshard 1.0's names for them, with its default shapes.

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

from .arguments import default_shapes as _shapes
from .collective import make_mapping, mapping_forms  # noqa: F401 (the executor makes its mappings with them)
from .entries import COLLECTIVES
from .entries.all_to_all import repartition
from .entries.ppermute import permute

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

_allreduce_identity = COLLECTIVES["all_reduce"].autograd
_identity_allreduce = COLLECTIVES["pvary"].autograd
_broadcast_allreduce = COLLECTIVES["broadcast"].autograd


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
_allgather_split = COLLECTIVES["all_gather"].autograd
_split_allgather = COLLECTIVES["split"].autograd
_reducescatter_allgather = COLLECTIVES["reduce_scatter"].autograd
_allgather_reducescatter = COLLECTIVES["all_gather_varying"].autograd


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
    return repartition(x, group, src_dim, dst_dim, src_shapes, dst_shapes, order)


def ppermute(x: torch.Tensor, group, perm, *, recv_shape=None, order=None) -> torch.Tensor:
    """Send ``x`` along the ``(src, dst)`` group-rank pairs of ``perm``; backward sends gradients back.

    A rank that receives nothing gets zeros (and a rank that sends nothing
    gets a zero gradient). ``recv_shape`` defaults to ``x.shape``. With
    ``order`` (the group rank holding each block), ``perm`` pairs blocks.

    >>> y = ppermute(x, sp_group, [(i, (i + 1) % P) for i in range(P)])  # doctest: +SKIP
    """
    return permute(x, group, perm, recv_shape=recv_shape, order=order)
