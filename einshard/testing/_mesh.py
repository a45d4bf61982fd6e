"""Picklable mesh descriptions that ranks turn into ``DeviceMesh`` objects."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ..errors import EinshardError
from ._device import rank_device

__all__ = ["MeshSpec", "make_mesh"]

# (shape, names) -> (world group the mesh was built in, DeviceMesh)
_MESH_CACHE: dict[tuple, tuple[object, object]] = {}
_MESH_LOCK = threading.Lock()


@dataclass(frozen=True)
class MeshSpec:
    """A picklable description of a device mesh (CPU, or the GPUs of a script ``launch`` put on CUDA).

    Pass it to a rank function (``run_on_ranks``, ``RankPool.run``,
    ``spawn`` or a ``@pytest.mark.ranks`` test's fixture) and every rank
    receives the built ``DeviceMesh`` in its place. Inside a rank,
    :meth:`build` creates the mesh with
    ``init_device_mesh(rank_device().type, shape, mesh_dim_names=names)`` (``"cpu"`` but in a
    rank ``launch(..., device="cuda")`` started); meshes are
    cached per process, so building the same spec twice returns the same
    object.

    >>> spec = MeshSpec((2, 4), ("dp", "tp"))
    >>> spec.size, str(spec)
    (8, '2x4(dp,tp)')
    >>> run_on_ranks(8, my_fn, spec)   # my_fn receives a DeviceMesh  # doctest: +SKIP
    """

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(int(s) for s in self.shape)
        names = (self.names,) if isinstance(self.names, str) else tuple(str(n) for n in self.names)
        if len(shape) != len(names):
            raise EinshardError(f"MeshSpec: shape {shape} and names {names} differ in length")
        if not shape or any(s < 1 for s in shape):
            raise EinshardError(f"MeshSpec: shape must be a non-empty tuple of positive sizes, got {shape}")
        if len(set(names)) != len(names):
            raise EinshardError(f"MeshSpec: duplicate mesh dimension names in {names}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "names", names)

    @property
    def size(self) -> int:
        """Number of ranks the mesh spans (the product of ``shape``)."""
        return math.prod(self.shape)

    def __str__(self) -> str:
        return "x".join(map(str, self.shape)) + "(" + ",".join(self.names) + ")"

    def build(self):
        """Build (or fetch from the per-process cache) the ``DeviceMesh``.

        Call it inside a rank, on every rank, in the same order (creating a
        mesh creates process groups, a collective operation).

        >>> mesh = MeshSpec((2, 4), ("dp", "tp")).build()   # doctest: +SKIP
        >>> mesh.mesh_dim_names                             # doctest: +SKIP
        ('dp', 'tp')
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "MeshSpec.build() needs an initialised torch.distributed process group; "
                "call it inside a rank (einshard.testing.run_on_ranks / spawn / RankPool)"
            )
        world = dist.group.WORLD
        if dist.get_world_size() != self.size:
            raise EinshardError(
                f"mesh {self} spans {self.size} ranks but the process group has "
                f"{dist.get_world_size()} (use @pytest.mark.ranks({self.size}) / a pool of {self.size})"
            )
        key = (self.shape, self.names)
        with _MESH_LOCK:
            hit = _MESH_CACHE.get(key)
            if hit is not None and hit[0] is world:
                return hit[1]
            mesh = init_device_mesh(rank_device().type, self.shape, mesh_dim_names=self.names)
            _MESH_CACHE[key] = (world, mesh)
            return mesh


def make_mesh(shape: Sequence[int] | int, names: Sequence[str] | str):
    """Build a cached ``DeviceMesh`` inside a rank: ``MeshSpec(shape, names).build()``.

    >>> def fn():
    ...     mesh = make_mesh((2, 4), ("dp", "tp"))
    ...     return mesh.get_coordinate()
    >>> run_on_ranks(8, fn)[5]     # doctest: +SKIP
    (1, 1)
    """
    return MeshSpec(shape, names).build()  # type: ignore[arg-type]  # MeshSpec normalizes an int or a sequence
