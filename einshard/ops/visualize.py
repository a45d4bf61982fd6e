"""``es.visualize``: which ranks hold which block of a tensor."""

from __future__ import annotations

import re

from ..comm.mesh import resolve_mesh
from ..core.layout import MeshShape
from ..errors import EinshardError
from ..notation import expand
from ..plan.resolve import resolve

__all__ = ["visualize"]


def _block_text(axes, box, sizes) -> str:
    parts = []
    for axis, (a, b), size in zip(axes, box, sizes):
        parts.append(f"{axis}[:]" if (a, b) == (0, size) else f"{axis}[{a}:{b}]")
    return " ".join(parts)


def visualize(spec: str, shape, *, mesh=None, shapes=None, sizes=None, families=None, file=None) -> str:
    """Print (and return) which ranks hold which block of a tensor laid out as ``spec``.

    ``shape`` is the whole (logical) shape, written like the spec (a
    factored group is one dimension). Ranks holding the same block are listed
    together, like ``jax.debug.visualize_array_sharding``; partial layouts
    say that each rank holds a per-rank contribution.

    >>> print(es.visualize("a/tp b", (10, 4), mesh=es.Mesh.virtual((4,), ("tp",))))  # doctest: +SKIP
    'a/tp b' (10, 4) on Mesh(tp=4)
      tp=0    rank 0  a[0:3] b[:]
      ...
    """
    mesh = resolve_mesh(mesh)
    if expand(spec, families).output is not None:
        raise EinshardError(f"visualize: {spec!r} must be one tensor spec, not a formula")
    # the whole tensor converted to the spec: its output layout is what every rank holds
    conversion = expand(f"{_whole(spec)} -> {spec}", families)
    layout = resolve(conversion, [tuple(shape)], mesh, shapes=shapes, sizes=sizes).output
    mshape = MeshShape.of(mesh)
    by_block: dict[tuple, list[tuple]] = {}
    for coord in mshape.coords():
        by_block.setdefault(layout.box(coord, mshape), []).append(coord)
    lines = [f"{spec!r} {tuple(shape)} on {mesh!r}"]
    if layout.partial:
        lines.append(f"  partial over {', '.join(sorted(layout.partial))}: each rank holds a per-rank contribution")
    rank_of = mesh.rank_of if mesh.device_mesh is not None else (lambda c: mshape.index(mshape.names, c))
    rows = []
    for box, coords in by_block.items():
        where = "; ".join(
            ",".join(f"{n}={c[k]}" for k, n in enumerate(mshape.names)) for c in coords[:4]
        ) + ("; ..." if len(coords) > 4 else "")
        ranks = ",".join(str(rank_of(c)) for c in coords)
        who = f"rank{'s' if len(coords) > 1 else ''} {ranks}"
        rows.append((where, who, _block_text(layout.axes, box, layout.sizes)))
    widths = [max(len(r[k]) for r in rows) for k in range(2)]
    for where, ranks, block in rows:
        lines.append(f"  {where.ljust(widths[0])}  {ranks.ljust(widths[1])}  {block}")
    text = "\n".join(lines)
    print(text, file=file)
    return text


def _whole(spec: str) -> str:
    """The spec with every sharding and partial removed."""
    return re.sub(r"//\s*(\([^)]*\)|[\w-]+)|/\s*[\w-]+", "", spec)
