"""``DTensor`` interop: placements ↔ einshard layouts.

A ``DTensor``'s placements are one of ``Shard(dim)``, ``Partial()`` or
``Replicate()`` per mesh dimension, exactly einshard's three states. Its
uneven shards follow ``torch.chunk`` (blocks of ``ceil(size / n)``, the last
ones smaller or empty, e.g. 9 over 4 → ``[3, 3, 3, 0]``), which differs from
einshard's default :func:`~einshard.comm.helpers.compute_split_shapes`
(``[2, 2, 2, 3]``), so the split shapes are carried over explicitly:

- :func:`from_dtensor` turns a ``DTensor`` into this rank's block of a spec's
  layout (one planned transition from the DTensor's own layout, its uneven
  sizes included; autograd-correct, the gradient arrives as a ``DTensor``);
- :func:`to_dtensor` wraps a local block as a ``DTensor`` with the layout's
  placements, without a copy when the layout's split shapes are
  ``torch.chunk``'s (every even split is), after one transition otherwise.

A tensor axis sharded over several mesh dimensions (``a/dp-tp``) is
``Shard(i)`` on each of them, in mesh order (DTensor's default order).

On a mesh whose rank tensor does not ascend along every dimension
(``[[3, 1], [2, 0]]``), DTensor's own collectives would permute the blocks:
the DTensors handed out live on the mesh's twin (:mod:`einshard.spmd.dtensor_mesh`),
and DTensors on the twin are read back through it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from ..core import _torch_compat
from ..core.layout import Layout
from ..errors import EinshardError
from ..notation import expand
from ..plan.resolve import resolve
from ..runtime.execute import transition
from ._specs import sizes_for
from ._specs import strip_spec as _strip
from .dtensor_mesh import from_twin, to_twin, twin_of

__all__ = [
    "is_dtensor",
    "chunk_splits",
    "from_dtensor",
    "plan_from_dtensor",
    "apply_from_dtensor",
    "to_dtensor",
    "dtensor_layout",
    "layout_placements",
]


def is_dtensor(x) -> bool:
    return isinstance(x, DTensor)



def chunk_splits(size: int, group_sizes) -> tuple[int, ...]:
    """``torch.chunk``-style block sizes of ``size`` split over nested groups (mesh order).

    >>> chunk_splits(9, [4]), chunk_splits(10, [2, 2])
    ((3, 3, 3, 0), (3, 2, 3, 2))
    """
    blocks = [size]
    for n in group_sizes:
        new: list[int] = []
        for b in blocks:
            c = -(-b // n) if b else 0
            new.extend(max(0, min(c, b - j * c)) for j in range(n))
        blocks = new
    return tuple(blocks)


def _on_twin(dt, mesh):
    """The twin of ``mesh`` when ``dt`` lives on it (see :mod:`einshard.spmd.dtensor_mesh`), else ``None``."""
    if mesh.device_mesh is None or dt.device_mesh is mesh.device_mesh:
        return None
    twin = twin_of(mesh)
    return twin if twin is not None and dt.device_mesh is twin.device_mesh else None


def _check_mesh(dt, mesh, where: str):
    dm = dt.device_mesh
    if dm is mesh.device_mesh or _on_twin(dt, mesh) is not None:
        return
    names = tuple(dm.mesh_dim_names or ())
    same = (
        names == tuple(mesh.names)
        and mesh.device_mesh is not None
        and tuple(dm.mesh.shape) == tuple(mesh.shape)
        and torch.equal(dm.mesh, mesh.device_mesh.mesh)
    )
    if not same:
        raise EinshardError(
            f"{where}: the DTensor lives on mesh {names or tuple(dm.mesh.shape)} but shard_map runs on "
            f"{tuple(mesh.names)}; redistribute it to the shard_map mesh first"
        )


def dtensor_layout(dt, whole: Layout, mesh, where: str = "DTensor") -> Layout:
    """The layout of ``dt`` (its placements and ``torch.chunk`` split shapes) over ``whole``'s axes."""
    _check_mesh(dt, mesh, where)
    spec = getattr(dt, "_spec", None)
    order = getattr(spec, "shard_order", None) if spec is not None else None
    if order is not None:
        check = getattr(_torch_compat.DTensorSpec, "is_default_device_order", None)
        if check is not None and not check(order):
            raise EinshardError(f"{where}: DTensors with a non-default shard "
                                "order are not supported; redistribute first")
    if len(whole.axes) != dt.ndim:
        raise EinshardError(f"{where}: the spec names {len(whole.axes)} dimensions but the DTensor has {dt.ndim}")
    shard: list[list[str]] = [[] for _ in whole.axes]
    partial = set()
    for name, p in zip(mesh.names, dt.placements):
        if type(p).__name__ == "_StridedShard":
            raise EinshardError(f"{where}: _StridedShard placements are not supported; redistribute first")
        if isinstance(p, Shard):
            shard[p.dim % dt.ndim].append(name)
        elif isinstance(p, Partial):
            op = getattr(p, "reduce_op", "sum")
            if op not in ("sum", None):
                raise EinshardError(f"{where}: Partial({op!r}) placements are not supported (only sums)")
            partial.add(name)
        elif not isinstance(p, Replicate):
            raise EinshardError(f"{where}: unsupported placement {p!r}")
    splits = []
    for i, dims in enumerate(shard):
        splits.append(chunk_splits(whole.sizes[i], [mesh.size((d,)) for d in dims]) if dims else None)
    return Layout(whole.axes, whole.sizes, tuple(tuple(d) for d in shard), tuple(splits), frozenset(partial))


def plan_from_dtensor(dt, spec: str, mesh, *, shapes=None, sizes=None, families=None, where: str = "DTensor"):
    """``(src, target)``: the layout of ``dt`` and the layout ``spec`` of the same tensor (no data moves)."""
    parsed_spec = expand(spec, families).inputs[0]
    if parsed_spec.has_groups:
        raise EinshardError(f"{where}: DTensor arguments need specs without factored groups, got {spec!r}")
    formula = expand(f"{_strip(parsed_spec)} -> {spec}", families)
    resolved = resolve(formula, [tuple(dt.shape)], mesh, shapes=shapes, sizes=sizes_for(formula, sizes, families),
                       axes=None)
    whole, target = resolved.operands[0], resolved.output
    return dtensor_layout(dt, whole, mesh, where), target


def apply_from_dtensor(dt, src: Layout, target: Layout, mesh) -> torch.Tensor:
    """This rank's block of ``dt`` in ``target`` (planned by :func:`plan_from_dtensor`)."""
    grad_placements = [Replicate() if isinstance(p, Partial) else p for p in dt.placements]
    local = dt.to_local(grad_placements=grad_placements)
    twin = _on_twin(dt, mesh)
    if twin is not None:  # its block at this rank's twin coordinate: brought to its mesh coordinate
        local = from_twin(local, src, mesh, twin)
    return transition(src, target, mesh)(local)


def from_dtensor(dt, spec: str, mesh, *, shapes=None, sizes=None, families=None, where: str = "DTensor"):
    """This rank's block of ``dt`` in the layout ``spec`` (autograd-correct); returns ``(local, layout)``.

    The split shapes of ``spec``'s sharded axes come from ``shapes=`` or
    :func:`~einshard.comm.helpers.compute_split_shapes` of the global size. The
    gradient arrives on ``dt`` as a ``DTensor`` with ``dt``'s placements
    (``Replicate`` where ``dt`` is partial: a partial value's cotangent is
    the full cotangent on every rank).
    """
    src, target = plan_from_dtensor(dt, spec, mesh, shapes=shapes, sizes=sizes, families=families, where=where)
    return apply_from_dtensor(dt, src, target, mesh), target


def layout_placements(layout: Layout, mesh) -> list:
    placements: list[Placement] = []
    for name in mesh.names:
        i = layout.owner(name)
        if i is not None:
            placements.append(Shard(i))
        elif name in layout.partial:
            placements.append(Partial())
        else:
            placements.append(Replicate())
    return placements


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def to_dtensor(local: torch.Tensor, layout: Layout, mesh, where: str = "output"):
    """Wrap ``local`` (this rank's block of ``layout``) as a ``DTensor`` (no copy for chunk-style splits)."""
    if mesh.device_mesh is None:
        raise EinshardError(f"{where}: a virtual mesh cannot hold DTensors")
    if local.dim() != len(layout.axes):
        raise EinshardError(f"{where}: DTensor outputs need specs without factored groups")
    chunked = tuple(chunk_splits(layout.sizes[i], [mesh.size((d,)) for d in dims]) if dims else None
                    for i, dims in enumerate(layout.shard))
    target = layout
    if chunked != layout.splits:
        target = Layout(layout.axes, layout.sizes, layout.shard, chunked, layout.partial)
        local = transition(layout, target, mesh)(local)
    device_mesh, twin = mesh.device_mesh, twin_of(mesh)
    if twin is not None:  # DTensor gathers in group-rank order: on the twin, that is its coordinate order
        local, device_mesh = to_twin(local, target, mesh, twin), twin.device_mesh
    placements = layout_placements(layout, mesh)
    grad_placements = [Replicate() if isinstance(p, Partial) else p for p in placements]
    shape = torch.Size(layout.sizes)
    kwargs: dict[str, Any] = {"run_check": False, "shape": shape, "stride": _contiguous_stride(shape)}
    try:
        return DTensor.from_local(local, device_mesh, placements, grad_placements=grad_placements, **kwargs)
    except TypeError:  # pragma: no cover - torch without grad_placements on from_local
        return DTensor.from_local(local, device_mesh, placements, **kwargs)
