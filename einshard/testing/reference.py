"""Reference helpers: cut a whole tensor into the block a rank holds.

Tests compare every distributed result with the same computation on whole
tensors in one process, split by the same split shapes. :func:`local_block`
does the splitting, independently of the planner: it only reads the spec.
"""

from __future__ import annotations

import math

import torch

from ..comm.mesh import resolve_mesh
from ..core._split import compute_split_shapes, resolve_split_shapes
from ..errors import EinshardError
from ..notation import Axis, EllipsisItem, Group, expand

__all__ = ["local_block"]


def local_block(x: torch.Tensor, spec: str, mesh, shapes=None, sizes=None, families=None) -> torch.Tensor:
    """This rank's block of the whole tensor ``x`` laid out as ``spec``.

    ``shapes`` takes the same forms as ``einshard``'s (per mesh dimension,
    optionally per axis); without an entry an axis is split with
    ``compute_split_shapes``. Partial mesh dimensions are treated like
    replicated ones (every rank gets the whole value). Factored groups need
    ``sizes`` for all but one factor.

    >>> w = torch.arange(12.).reshape(4, 3)                                    # doctest: +SKIP
    >>> local_block(w, "h/tp c", mesh, shapes={"tp": [1, 1, 1, 1]}).shape     # doctest: +SKIP
    torch.Size([1, 3])
    """
    mesh = resolve_mesh(mesh)
    parsed = expand(spec, families)
    tensor = parsed.inputs[0] if parsed.output is None else parsed.output
    sizes = dict(sizes or {})
    named = [i for i in tensor.items if not isinstance(i, EllipsisItem)]
    n_ell = x.dim() - len(named)
    expanded_shape: list[int] = []
    axes: list[Axis | None] = []
    pos = 0
    for item in tensor.items:
        if isinstance(item, EllipsisItem):
            for _ in range(n_ell):
                expanded_shape.append(x.shape[pos])
                axes.append(None)
                pos += 1
            continue
        assert isinstance(item, (Axis, Group))  # an expanded spec: no families left
        members = item.axes if isinstance(item, Group) else (item,)
        known = [sizes.get(a.name) for a in members]
        if known.count(None) > 1:
            raise EinshardError(f"local_block: pass sizes= for all but one factor of '{item}' in {spec!r}")
        if None in known:
            rest = math.prod(k for k in known if k is not None)
            known[known.index(None)] = x.shape[pos] // rest
        expanded_shape.extend(known)
        axes.extend(members)
        pos += 1
    y = x.reshape(expanded_shape)
    for dim, axis in enumerate(axes):
        if axis is None or not axis.mesh:
            continue
        dims = mesh.dims(axis.mesh)
        label = mesh.label(dims)
        n = mesh.size(dims)
        split = None
        if shapes is not None:
            try:
                split = resolve_split_shapes(shapes, label, axis.name)
            except ValueError:
                if not isinstance(shapes, dict):
                    raise
                split = None
        if split is None:
            split = compute_split_shapes(y.shape[dim], n)
        b = mesh.index(dims)
        y = y.narrow(dim, sum(split[:b]), split[b])
    out_shape: list[int] = []
    k = 0
    for item in tensor.items:
        if isinstance(item, EllipsisItem):
            out_shape.extend(y.shape[k : k + n_ell])
            k += n_ell
        elif isinstance(item, Group):
            out_shape.append(math.prod(y.shape[k : k + len(item.axes)]))
            k += len(item.axes)
        else:
            out_shape.append(y.shape[k])
            k += 1
    return y.reshape(out_shape)
