"""``torch_einshard.mesh``: torch-einshard 1.0's ``CompoundDeviceMesh`` and ``wrap_mesh``, einshard's ``Mesh``.

``CompoundDeviceMesh(device_mesh)`` is ``wrap_mesh(device_mesh)``: an :class:`einshard.comm.mesh.Mesh`
(``isinstance(wrap_mesh(m), CompoundDeviceMesh)`` holds). It has 1.0's ``device_mesh``,
``mesh``, ``mesh_dim_names`` and ``mesh["dp-sp"].get_group()``.
"""

from __future__ import annotations

from einshard.comm.mesh import Mesh, wrap_mesh

from .sharding import LegacyName

__all__ = ["CompoundDeviceMesh", "wrap_mesh"]


class CompoundDeviceMesh(metaclass=LegacyName):
    """1.0's mesh wrapper with compound dimensions (``"dp-sp"``): einshard's :class:`~einshard.comm.mesh.Mesh`."""

    target = Mesh

    def __new__(cls, device_mesh):
        return wrap_mesh(device_mesh)
