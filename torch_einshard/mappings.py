"""``torch_einshard.mappings``: torch-einshard 1.0's autograd collectives, with 1.0's argument names.

Each backward is the exact adjoint of its forward (and is itself one of these mappings, so
double backward works), built by :func:`einshard.comm.mappings.make_mapping` or taken from
:mod:`einshard.comm.mappings`. ``comm`` is a process group. Layouts and adjoints are those of
einshard's mappings (the communication guide), with one difference kept from 1.0:
``broadcast_forward_allreduce_backward`` treats its input as each rank's own value, so only
``src`` receives the summed gradient and the other ranks get zeros (einshard's
``es.comm.mappings`` version treats the input as replicated and gives every rank the sum).

>>> from torch_einshard.mappings import allgather_forward_split_backward  # doctest: +SKIP
>>> full = allgather_forward_split_backward(x_block, tp_group, 0, [3, 3, 2])  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from einshard.comm import collectives as C
from einshard.comm import mappings as M

from . import helpers as H

__all__ = [
    "allgather_forward_reducescatter_backward",
    "allgather_forward_split_backward",
    "allreduce_forward_identity_backward",
    "alltoall_repartition",
    "broadcast_forward_allreduce_backward",
    "identity_forward_allreduce_backward",
    "owner_swap_forward_backward",
    "reducescatter_forward_allgather_backward",
    "roll_sharded_forward_backward",
    "roll_shards_forward_backward",
    "split_forward_allgather_backward",
]


def allreduce_forward_identity_backward(input, comm):
    """Sum per-rank values over ``comm``; the gradient passes through."""
    return M.allreduce_forward_identity_backward(input, comm)


def identity_forward_allreduce_backward(input, comm):
    """Identity; the gradient is summed over ``comm``."""
    return M.identity_forward_allreduce_backward(input, comm)


def _sum_to_src(x, group, src):
    """The sum over ``group`` on group rank ``src``, zeros elsewhere (the adjoint of a broadcast of per-rank values)."""
    total = C.all_reduce(x, group)
    return total if C.group_rank(group) == src else torch.zeros_like(total)


_broadcast: Callable[..., torch.Tensor] = M.make_mapping(
    "Broadcast", C.broadcast, lambda d, g, src: _reduce(d, g, src))
_reduce: Callable[..., torch.Tensor] = M.make_mapping(
    "SumToSource", _sum_to_src, lambda d, g, src: _broadcast(d, g, src))


def broadcast_forward_allreduce_backward(input, comm, src=0):
    """Group rank ``src``'s ``input`` on every rank; backward: the summed gradient on ``src``, zeros elsewhere."""
    return _broadcast(input, comm, src)


def allgather_forward_split_backward(input, comm, dim, shapes):
    """Gather the blocks along ``dim``; backward keeps this rank's block (``shapes=None``: even blocks)."""
    return M.allgather_forward_split_backward(input, comm, dim, shapes)


def split_forward_allgather_backward(input, comm, dim, shapes):
    """This rank's block along ``dim``; backward all-gathers the gradient (``shapes=None``: balanced split)."""
    return M.split_forward_allgather_backward(input, comm, dim, shapes)


def reducescatter_forward_allgather_backward(input, comm, dim, shapes):
    """This rank's block of the sum over ``comm``; backward all-gathers the gradient."""
    return M.reducescatter_forward_allgather_backward(input, comm, dim, shapes)


def allgather_forward_reducescatter_backward(input, comm, dim, shapes):
    """Gather the blocks along ``dim`` for per-rank use; backward reduce-scatters the gradient."""
    return M.allgather_forward_reducescatter_backward(input, comm, dim, shapes)


def alltoall_repartition(input, comm, source_dim, dest_dim, source_shapes, dest_shapes):
    """Move the sharding from ``source_dim`` to ``dest_dim``; backward moves it back.

    ``None`` shapes: even blocks along ``source_dim``, a balanced split of ``dest_dim``
    (1.0 needed both lists).
    """
    return M.alltoall_repartition(input, comm, source_dim, dest_dim, source_shapes, dest_shapes)


def owner_swap_forward_backward(input, mesh, source_shard_dims, dest_shard_dims, output_shape):
    """:func:`torch_einshard.helpers.owner_swap`; backward sends each gradient block back to its owner."""
    group, perm = H.owner_swap_pairs(mesh, source_shard_dims, dest_shard_dims)
    return M.ppermute(input, group, perm, recv_shape=output_shape)


def roll_shards_forward_backward(input, comm, shard_shift):
    """:func:`torch_einshard.helpers.roll_shards`; backward rolls the gradient blocks back."""
    if C.group_size(comm) == 1 or shard_shift % C.group_size(comm) == 0:
        return input
    return M.ppermute(input, comm, H.roll_shards_perm(comm, shard_shift))


def _roll(x, group, dim, shift, shapes):
    y = H.roll_sharded(x, group, dim, shift, shapes)
    return x.view_as(x) if y is x else y  # a Function's output is a new tensor


_roll_sharded: Callable[..., torch.Tensor] = M.make_mapping(
    "RollSharded",
    _roll,
    lambda d, g, dim, shift, shapes: _roll_sharded(d, g, dim, -shift, shapes),
)


def roll_sharded_forward_backward(input, comm, dim, shift, shapes):
    """:func:`torch_einshard.helpers.roll_sharded` (``None`` where it is); backward rolls the gradient back."""
    if shapes is None or len(shapes) != C.group_size(comm):
        return None
    return _roll_sharded(input, comm, dim, shift, tuple(shapes))
