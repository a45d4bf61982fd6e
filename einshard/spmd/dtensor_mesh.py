"""The ``DeviceMesh`` DTensors are handed out on: one whose groups number their ranks in its coordinate order.

A ``DTensor`` places a rank's block by the rank's coordinate in its
``DeviceMesh`` but gathers over a mesh dimension's process group in
group-rank order, and a process group numbers its ranks in ascending global
rank order (``torch.distributed.new_group`` sorts them). On a mesh built
from a rank tensor that does not ascend along every dimension
(``DeviceMesh("cpu", [[3, 1], [2, 0]])``, ``DeviceMesh("cpu", [1, 0])``) the
two disagree, and ``full_tensor()`` or ``redistribute`` of a DTensor on it
would permute the blocks (its local shards and offsets, which
``torch.distributed.checkpoint`` uses, are right).

There, DTensors live on the mesh's **twin** (:func:`twin_of`): the same
ranks, shape and dimension names, the ranks laid out in ascending order (so
every dimension's groups ascend), each rank holding the block at its twin
coordinate. Moving a block between the two is one point-to-point exchange
(:func:`to_twin`, and back :func:`from_twin`), an autograd mapping whose
backward sends the gradients back. Meshes whose rank tensor ascends along
every dimension (every mesh of ``init_device_mesh``) have no twin: their
DTensors live on their own ``DeviceMesh``.

>>> twin = twin_of(es.wrap_mesh(DeviceMesh("cpu", [[3, 1], [2, 0]], mesh_dim_names=("dp", "tp"))))  # doctest: +SKIP
>>> twin.device_mesh.mesh  # doctest: +SKIP
tensor([[0, 1],
        [2, 3]])
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.mappings import ppermute
from ..core.layout import Layout, MeshShape

__all__ = ["Twin", "twin_of", "to_twin", "from_twin"]


class Twin:
    """A mesh's twin: ``device_mesh`` (the ranks in ascending order) and ``pairs``, the ``(block, block)``
    moves of the exchange to it (blocks numbered by the mesh's coordinates, mesh-order flattened)."""

    __slots__ = ("device_mesh", "pairs")

    def __init__(self, device_mesh, pairs):
        self.device_mesh, self.pairs = device_mesh, pairs


_TWINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DeviceMesh -> Twin, or None (none needed)


def _ascends(grid: np.ndarray) -> bool:
    return all(bool(np.all(np.diff(grid, axis=d) > 0)) for d in range(grid.ndim) if grid.shape[d] > 1)


def twin_of(mesh) -> Twin | None:
    """The twin of ``mesh`` (an ``es.Mesh`` with process groups), or ``None`` when its rank tensor ascends
    along every dimension. Decided from the rank tensor (the same on every rank); built once per mesh, its
    groups created by their members only (once per ``DeviceMesh``, however it is wrapped)."""
    try:
        return _TWINS[mesh.device_mesh]
    except KeyError:
        pass
    grid = np.asarray(mesh.mesh)
    twin = None
    if not _ascends(grid):
        flat = grid.reshape(-1).tolist()
        ranked = sorted(flat)
        layout = np.asarray(ranked).reshape(grid.shape)
        device_mesh = _device_mesh(mesh, layout)
        twin = Twin(device_mesh, tuple((k, flat.index(r)) for k, r in enumerate(ranked)))  # block k goes to ranked[k]
    _TWINS[mesh.device_mesh] = twin
    return twin


def _device_mesh(mesh, layout: np.ndarray):
    """A ``DeviceMesh`` over ``layout`` (ascending along every dimension) with ``mesh``'s names."""
    me = dist.get_rank()
    coordinate = tuple(int(c) for c in np.argwhere(layout == me)[0])
    groups: list[dist.ProcessGroup] = []
    for d in range(layout.ndim):
        index = tuple(slice(None) if i == d else c for i, c in enumerate(coordinate))
        ranks = layout[index].reshape(-1).tolist()
        if ranks == list(range(dist.get_world_size())):
            assert dist.group.WORLD is not None  # initialized: this rank has a rank
            groups.append(dist.group.WORLD)
        else:
            groups.append(dist.new_group(ranks, use_local_synchronization=True))
    return DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], mesh.device_type,
                                 mesh=torch.as_tensor(layout, device="cpu"), mesh_dim_names=tuple(mesh.names))


def _exchange(x: torch.Tensor, mesh, pairs, recv_shape) -> torch.Tensor:
    names = tuple(mesh.names)
    return ppermute(x, mesh.group(names), pairs, recv_shape=recv_shape, order=mesh.order(names))


def to_twin(local: torch.Tensor, layout: Layout, mesh, twin: Twin) -> torch.Tensor:
    """This rank's block of ``layout`` at its twin coordinate, from ``local``, its block at its mesh
    coordinate (autograd: the gradient goes back the same way)."""
    shape = MeshShape.of(mesh)
    me = mesh.index(tuple(mesh.names))
    block = next(k for k, j in twin.pairs if j == me)  # the block this rank holds on the twin
    coordinate = tuple(int(c) for c in np.unravel_index(block, mesh.shape))
    return _exchange(local, mesh, twin.pairs, layout.local_shape(coordinate, shape))


def from_twin(local: torch.Tensor, layout: Layout, mesh, twin: Twin) -> torch.Tensor:
    """This rank's block of ``layout`` at its mesh coordinate, from ``local``, its block at its twin
    coordinate (the inverse of :func:`to_twin`)."""
    back = tuple((j, k) for k, j in twin.pairs)
    return _exchange(local, mesh, back, layout.local_shape(tuple(mesh.coordinate), MeshShape.of(mesh)))
