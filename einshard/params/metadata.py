"""Shard metadata: which slice of a global parameter this rank holds under the parameter's layout.

The split rule is einshard's (``compute_split_shapes_for_factors``): blocks of
``ceil(size / n)``, the remainder last (floor when the last block would be empty).
The rank's index in a compound group ``dp-sp`` is the row-major flattening of its
mesh coordinates over the components in mesh order, so ``dp-sp`` and ``sp-dp`` agree.

>>> import einshard as es
>>> s = es.params.ParameterState.from_layout("out/tp in")
>>> mesh = es.Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(0, 3))
>>> param_local_slices(s, (10, 6), mesh), param_local_shape(s, (10, 6), mesh)
((slice(9, 10, None), slice(None, None, None)), (1, 6))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..comm.mesh import Mesh
from ..core._split import compute_split_shapes_for_factors
from ..errors import EinshardError
from ..notation import Axis, EllipsisItem, Group
from .names import components
from .state import ParameterState, check_state
from .store import get_parameter_state, set_parameter_state

__all__ = ["ParamShardMetadata", "param_shard_dims", "param_local_slices", "param_local_shape", "param_shard_metadata",
           "named_sizes", "global_shape_from_sizes", "record_global_shape_", "recorded_global_shape", "storage_slice",
           "group_size"]


@dataclass(frozen=True)
class ParamShardMetadata:
    """Where this rank's block of a parameter sits in the global tensor."""

    global_shape: tuple[int, ...]
    local_slices: tuple[slice, ...]
    local_shape: tuple[int, ...]
    shard_dims: tuple[str, ...]


def _state_of(p_or_state) -> ParameterState:
    state = p_or_state if isinstance(p_or_state, ParameterState) else get_parameter_state(p_or_state)
    if state is None:
        raise EinshardError("the parameter has no ParameterState (register a layout first)")
    return state


def param_shard_dims(p_or_state) -> tuple[str, ...]:
    """The shard groups of a parameter's layout, in axis order.

    >>> import einshard as es
    >>> param_shard_dims(es.params.ParameterState.from_layout("a/tp b/dp-sp"))
    ('tp', 'dp-sp')
    """
    return _state_of(p_or_state).layout_shard_dims


class _Coordinates:
    """Group sizes and this rank's group index, from an ``es.Mesh`` or a ``DeviceMesh``."""

    def __init__(self, mesh):
        if isinstance(mesh, Mesh):
            self.names, self.shape, self.compound = mesh.names, mesh.shape, mesh.allow_compound
            self._coordinate = lambda: mesh.coordinate
        elif isinstance(mesh, DeviceMesh):
            self.names, self.shape, self.compound = tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape), False
            self._coordinate = lambda: _device_mesh_coordinate(mesh)
        else:
            raise TypeError(f"mesh must be an es.Mesh or a DeviceMesh, got {type(mesh).__name__}")

    def dims(self, group: str) -> tuple[str, ...]:
        parts = components(group)
        missing = [c for c in parts if c not in self.names]
        if missing:
            raise EinshardError(f"mesh dimension {missing[0]!r} (in {group!r}) is not in the mesh {self.names!r}")
        if len(parts) > 1 and not self.compound:
            raise EinshardError(f"compound group {group!r} on a raw DeviceMesh: pass es.wrap_mesh(device_mesh)")
        return tuple(sorted(parts, key=self.names.index))

    def size_and_index(self, group: str) -> tuple[int, int]:
        coordinate = self._coordinate()
        size, index = 1, 0
        for d in self.dims(group):
            i = self.names.index(d)
            size *= self.shape[i]
            index = index * self.shape[i] + coordinate[i]
        return size, index


def _device_mesh_coordinate(mesh) -> tuple[int, ...]:
    if not dist.is_initialized():
        raise RuntimeError("a sharded parameter on a DeviceMesh needs an initialized process group")
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise EinshardError("this rank is not part of the given DeviceMesh")
    return tuple(coordinate)


def param_local_slices(p_or_state, global_shape, mesh, factors=None) -> tuple[slice, ...]:
    """One slice per top-level layout item: this rank's block of a tensor of ``global_shape``.

    ``factors``: ``{axis: k}`` keeps block sizes multiples of ``k`` (the leftover goes last).
    """
    state = _state_of(p_or_state)
    if state.spec is None:
        raise EinshardError("a layout-free ParameterState has no local slices")
    items = state.spec.items
    if any(isinstance(i, EllipsisItem) for i in items):
        raise EinshardError(f"layout {state.layout!r} has '...': its shard metadata is unknown")
    global_shape = tuple(int(s) for s in global_shape)
    if len(items) != len(global_shape):
        raise EinshardError(f"layout {state.layout!r} has rank {len(items)} but "
                            f"global_shape {global_shape} has rank {len(global_shape)}")
    factors = {} if factors is None else factors
    if not isinstance(factors, Mapping):
        raise TypeError(f"factors must be a Mapping from axis names to ints, got {type(factors).__name__}")
    coords = _Coordinates(mesh)
    out = []
    for item, size in zip(items, global_shape):
        if isinstance(item, Group):
            if any(a.mesh for a in item.axes):
                raise NotImplementedError(f"factored-axis shards ({item}) have no contiguous local slice")
            out.append(slice(None))
        elif isinstance(item, Axis) and item.mesh:
            n, r = coords.size_and_index(item.mesh)
            splits = compute_split_shapes_for_factors(size, n, factors.get(item.name, 1))
            start = sum(splits[:r])
            out.append(slice(start, start + splits[r]))
        else:
            out.append(slice(None))
    return tuple(out)


def _length(s: slice, size: int) -> int:
    return len(range(*s.indices(size)))


def param_local_shape(p_or_state, global_shape, mesh, factors=None) -> tuple[int, ...]:
    """This rank's block shape (ints)."""
    slices = param_local_slices(p_or_state, global_shape, mesh, factors)
    return tuple(_length(s, int(n)) for s, n in zip(slices, global_shape))


def param_shard_metadata(p_or_state, global_shape, mesh, factors=None) -> ParamShardMetadata:
    """Global shape, local slices, local shape and shard groups together.

    >>> import einshard as es
    >>> m = param_shard_metadata(es.params.ParameterState.from_layout("v/dp-tp c"), (7, 5),
    ...                          es.Mesh.virtual((2, 4), ("dp", "tp"), coordinate=(1, 2)))
    >>> m.local_shape, m.shard_dims
    ((0, 5), ('dp-tp',))
    """
    slices = param_local_slices(p_or_state, global_shape, mesh, factors)
    global_shape = tuple(int(s) for s in global_shape)
    return ParamShardMetadata(
        global_shape, slices, tuple(_length(s, n) for s, n in zip(slices, global_shape)),
        _state_of(p_or_state).layout_shard_dims
    )



# -- global shapes -----------------------------------------------------------------------------------------
# A state may record the whole tensor's shape (``global_shape``): registration with ``sizes=``, ``es.tree_shard``
# of whole values and ``es.params.load_from_dtensor_`` record it. Wherever a global size is known, a tensor of
# another size where a block is expected is an error (``shard_map``, the formulas), and the split shapes of
# uneven layouts follow from it.


def named_sizes(spec, shape) -> dict | None:
    """``{axis: size}`` for a spec of plain axes (no ``( )``, no ``...``) and a shape of its rank, else ``None``.

    >>> from einshard import parse_sharding
    >>> named_sizes(parse_sharding("f/tp c").inputs[0], (6, 3))
    {'f': 6, 'c': 3}
    """
    items = spec.items
    if len(items) != len(shape) or not all(type(i) is Axis for i in items):
        return None
    return {a.name: int(n) for a, n in zip(items, shape)}


def global_shape_from_sizes(state: ParameterState, local_shape, sizes) -> tuple[int, ...] | None:
    """The global shape ``sizes=`` (``{axis: whole size}``) gives a parameter of ``local_shape``: unsharded
    axes keep their local size, sharded ones need a size; ``None`` when one is missing.

    >>> import einshard as es
    >>> global_shape_from_sizes(es.params.ParameterState.from_layout("f/tp c"), (3, 4), {"f": 6})
    (6, 4)
    """
    if not sizes or state.spec is None or len(state.spec.items) != len(local_shape):
        return None
    if not all(type(i) is Axis for i in state.spec.items):
        return None
    out = []
    for axis, local in zip(state.spec.items, local_shape):
        assert isinstance(axis, Axis)  # checked above
        size = sizes.get(axis.name)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise EinshardError(f"sizes[{axis.name!r}] must be a non-negative int, got {size!r}")
        if axis.mesh is None:
            if size is not None and size != local:
                raise EinshardError(
                    f"sizes= gives axis {axis.name!r} the size {size}, but the parameter holds {local} of it and "
                    f"its layout {state.layout!r} does not shard it"
                )
            out.append(int(local))
        elif size is None:
            return None
        else:
            out.append(size)
    return tuple(out)


def recorded_global_shape(p) -> tuple[int, ...] | None:
    """The global shape recorded on ``p``'s state, or ``None``."""
    state = get_parameter_state(p) if isinstance(p, torch.nn.Parameter) else None
    return None if state is None else state.global_shape


def record_global_shape_(p, global_shape):
    """Record ``global_shape`` on ``p``'s state (a ValueError if another one is recorded); returns ``p``.

    A Parameter without a state, or with a layout-free one, records nothing.
    """
    state = get_parameter_state(p)
    if state is None or state.spec is None:
        return p
    shape = tuple(int(n) for n in global_shape)
    if state.global_shape == shape:
        return p
    if state.global_shape is not None:
        raise EinshardError(
            f"the parameter's recorded global shape is {state.global_shape}, but a whole value of shape {shape} "
            "was given for it"
        )
    new = replace(state, global_shape=shape)
    check_state(new)
    set_parameter_state(p, new)
    return p


def storage_slice(state: ParameterState, block_shape, mesh) -> tuple[int, slice, bool]:
    """``(dim, slice, even)``: the part of a compute block of ``block_shape`` this rank stores (``store=``).

    The storage group splits the block's axis ``dim`` (unsplit by the compute layout) by einshard's rule;
    ``even``: every rank of the group holds the same length.

    >>> import einshard as es
    >>> s = es.params.ParameterState.from_layout("f/tp c", mesh_dim_names=("dp", "tp"), store="dp")
    >>> storage_slice(s, (3, 5), es.Mesh.virtual((2, 2), ("dp", "tp"), coordinate=(1, 0)))
    (1, slice(3, 5, None), False)
    """
    dim = state.store_axis
    assert dim is not None and state.store is not None  # a stored parameter's state
    n, r = _Coordinates(mesh).size_and_index(state.store)
    splits = compute_split_shapes_for_factors(int(block_shape[dim]), n, 1)
    start = sum(splits[:r])
    return dim, slice(start, start + splits[r]), len(set(splits)) == 1


def group_size(mesh, group: str) -> int:
    """The number of ranks in a (compound) mesh group.

    >>> import einshard as es
    >>> group_size(es.Mesh.virtual((2, 3), ("dp", "tp"), coordinate=(0, 0)), "dp-tp")
    6
    """
    return _Coordinates(mesh).size_and_index(group)[0]
