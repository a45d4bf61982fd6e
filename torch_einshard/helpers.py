"""``torch_einshard.helpers``: torch-einshard 1.0's plain collectives, with 1.0's argument names.

Each function keeps 1.0's signature and calls einshard's collective of the same meaning
(:mod:`einshard.comm.collectives`, :mod:`einshard.comm.helpers`): ``input`` is this rank's
tensor, ``group`` a process group, ``shapes`` the per-rank sizes along ``dim``. Where 1.0
returned ``None`` to say "not possible with these arguments" (``all_to_all_repartition`` and
``roll_sharded`` without split shapes), so do these, for the same arguments on every rank; a
block that contradicts ``shapes`` on one rank raises ``EinshardError`` on every rank instead
(1.0 returned ``None`` there on that rank only, and the others waited). ``owner_swap``,
``roll_shards`` and ``roll_sharded`` move the same elements as 1.0's; their autograd forms are in
:mod:`torch_einshard.mappings`.

>>> from torch_einshard.helpers import compute_split_shapes
>>> compute_split_shapes(10, 4)
[3, 3, 3, 1]
"""

from __future__ import annotations

import math

import torch

from einshard.comm import collectives as C
from einshard.comm import helpers as H
from einshard.comm.checks import agree
from einshard.comm.mesh import wrap_mesh
from einshard.errors import EinshardError
from einshard.plan.halo import roll_runs

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all_repartition",
    "broadcast",
    "compute_split_shapes",
    "compute_split_shapes_for_factors",
    "init_process_group",
    "owner_swap",
    "reduce_scatter",
    "resolve_split_shapes",
    "roll_sharded",
    "roll_shards",
    "split",
]


def init_process_group(backend, use_cuda):
    """Start ``torch.distributed`` from torchrun or SLURM variables; ``(local_rank, world_rank, world_size)``."""
    return H.init_process_group(backend, use_cuda)


def all_reduce(input, group, *, async_op=False):
    """The sum of ``input`` over ``group``, as a new tensor (with ``async_op``: ``(tensor, work)``)."""
    return C.all_reduce(input, group, async_op=async_op)


def broadcast(input, group, src=0):
    """Group rank ``src``'s ``input`` on every rank of ``group``, as a new tensor."""
    return C.broadcast(input, group, src)


def split(input, group, dim, shapes):
    """This rank's block of ``input`` along ``dim`` (a contiguous copy; ``shapes=None``: balanced split)."""
    return C.split(input, group, dim, shapes).contiguous()


def all_gather(input, group, dim, shapes):
    """Every rank's block concatenated along ``dim`` (``shapes=None``: every block has this rank's size)."""
    return C.all_gather(input, group, dim, shapes)


def reduce_scatter(input, group, dim, shapes):
    """This rank's block along ``dim`` of the sum over ``group`` (``shapes=None``: balanced split)."""
    return C.reduce_scatter(input, group, dim, shapes)


def all_to_all_repartition(input, group, source_dim, dest_dim, source_shapes, dest_shapes):
    """Sharded along ``source_dim`` and whole along ``dest_dim`` -> whole along ``source_dim``, sharded along
    ``dest_dim``.

    ``None`` (as in 1.0) when ``source_shapes`` or ``dest_shapes`` is ``None``; one rank's
    group returns ``input`` unchanged.
    """
    if C.group_size(group) == 1:
        return input
    if source_shapes is None or dest_shapes is None:
        return None
    return C.all_to_all(input, group, source_dim, dest_dim, list(source_shapes), list(dest_shapes))


def owner_swap_pairs(mesh, source_shard_dims, dest_shard_dims) -> tuple:
    """``(group, perm)`` of an owner swap: the group of every rank of ``mesh`` and ``(src, dst)`` group-rank pairs.

    Every axis ``k`` moves from mesh dimension ``source_shard_dims[k]`` to
    ``dest_shard_dims[k]``. When the two lists name the same dimensions, the block at
    coordinate ``c`` goes to the rank whose ``dest`` coordinate is ``c[source]`` (the
    dimensions are permuted); otherwise the two coordinates of each pair are exchanged.
    The dimensions of a pair must have the same size.
    """
    mesh = wrap_mesh(mesh)
    names = mesh.mesh_dim_names
    source, dest = tuple(source_shard_dims), tuple(dest_shard_dims)
    if len(source) != len(dest):
        raise EinshardError(f"owner_swap: {len(source)} source mesh dimension(s) {source} but {len(dest)} dest {dest}")
    for dim in source + dest:
        if dim not in names:
            raise EinshardError(f"owner_swap: mesh dimension {dim!r} is not one of the mesh's {names}")
    for s, d in zip(source, dest):
        if mesh.size(s) != mesh.size(d):
            raise EinshardError(
                f"owner_swap: mesh dimensions {s!r} (size {mesh.size(s)}) and {d!r} (size {mesh.size(d)}) "
                "differ in size; a block cannot change owner between them"
            )
    index = {name: i for i, name in enumerate(names)}
    grid = [tuple(int(c) for c in coord) for coord in torch.cartesian_prod(
        *[torch.arange(n) for n in mesh.shape]).reshape(-1, len(mesh.shape)).tolist()]
    permuted = set(source) == set(dest)
    everyone = mesh.group(names)
    order = mesh.order(names)
    position = {coord: k for k, coord in enumerate(grid)}  # row-major: the block order of the whole mesh
    perm = []
    for coord in grid:
        target = list(coord)
        for s, d in zip(source, dest):
            target[index[d]] = coord[index[s]]
            if not permuted:
                target[index[s]] = coord[index[d]]
        perm.append((position[coord], position[tuple(target)]))
    if order is not None:  # group rank holding each block
        perm = [(order[s], order[d]) for s, d in perm]
    return everyone, tuple(perm)


def owner_swap(input, mesh, source_shard_dims, dest_shard_dims, output_shape):
    """Give this rank's block to the rank that owns it once each axis moves from ``source_shard_dims`` to
    ``dest_shard_dims``.

    ``output_shape`` is the shape of the block this rank receives.
    """
    group, perm = owner_swap_pairs(mesh, source_shard_dims, dest_shard_dims)
    return C.ppermute(input, group, perm, tuple(output_shape))


def roll_shards_perm(group, shard_shift) -> tuple:
    """The ``(src, dst)`` pairs of a roll of whole blocks by ``shard_shift`` group ranks."""
    size = C.group_size(group)
    return tuple((r, (r + shard_shift) % size) for r in range(size))


def roll_shards(input, group, shard_shift):
    """Group rank ``r``'s block goes to rank ``(r + shard_shift) mod P``; every block must have one shape."""
    if C.group_size(group) == 1 or shard_shift % C.group_size(group) == 0:
        return input
    return C.ppermute(input, group, roll_shards_perm(group, shard_shift))


def _offsets(shapes):
    out, total = [], 0
    for s in shapes:
        out.append(total)
        total += s
    return out


def roll_sharded(input, group, dim, shift, shapes):
    """``torch.roll(whole, shift, dim)`` of a tensor sharded along ``dim`` by ``shapes``; the result keeps ``shapes``.

    Each rank sends every other rank exactly the slices of its block that land in that
    rank's block (one ``all_to_all_v``). ``None`` (as in 1.0) when ``shapes`` is ``None``
    or does not have one entry per rank.
    """
    size = C.group_size(group)
    if shapes is None or len(shapes) != size:
        return None
    shapes = [int(s) for s in shapes]
    total = sum(shapes)
    if size == 1:
        return torch.roll(input, shifts=shift, dims=dim)
    rank = C.group_rank(group)
    d = dim % input.dim()
    err = None
    if input.shape[d] != shapes[rank]:
        err = EinshardError(
            f"roll_sharded: this rank (group rank {rank}) holds {input.shape[d]} elements along dim {dim} "
            f"but shapes[{rank}] = {shapes[rank]} (shapes {shapes})"
        )
    agree(group, err, point="roll_sharded", always=True)  # one rank's block can contradict shapes: all raise
    shift = shift % total if total else 0
    if shift == 0:
        return input
    blocks = [(a, a + n) for a, n in zip(_offsets(shapes), shapes)]
    per = math.prod(input.shape[:d] + input.shape[d + 1:])
    chunks, incoming = [], []
    for j in range(size):  # runs: (source offset, dest offset, length) along dim
        sent = roll_runs(blocks[rank], blocks[j], shift, total)
        pieces = [input.narrow(d, s, n).reshape(-1) for s, _, n in sent]
        chunks.append(torch.cat(pieces) if pieces else input.new_zeros(0))
        incoming.append(roll_runs(blocks[j], blocks[rank], shift, total))
    got = C.all_to_all_v(chunks, [sum(n for _, _, n in runs) * per for runs in incoming], group)
    out = input.new_empty(input.shape)
    for flat, runs in zip(got, incoming):
        at = 0
        for _, t, n in runs:
            out.narrow(d, t, n).copy_(flat[at:at + n * per].view(input.shape[:d] + (n,) + input.shape[d + 1:]))
            at += n * per
    return out


def resolve_split_shapes(shapes, shard_dim, axis_name, group=None):
    """The split shapes of ``axis_name`` over ``shard_dim`` from ``shapes=`` (a list, or
    ``{dim: list or {axis: list}}``)."""
    return H.resolve_split_shapes(shapes, shard_dim, axis_name, group)


def compute_split_shapes(size, num_chunks):
    """The balanced split of ``size`` elements into ``num_chunks`` blocks (the remainder in the last)."""
    return H.compute_split_shapes(size, num_chunks)


def compute_split_shapes_for_factors(size, num_chunks, factor):
    """Like :func:`compute_split_shapes` in whole multiples of ``factor`` (the remainder in the last block)."""
    return H.compute_split_shapes_for_factors(size, num_chunks, factor)
