"""Primitives: every communication primitive and planner step kind, defined once.

A :class:`Primitive` declares everything the library knows about one kind:

- ``run(step, site)``: a planned step bound to this rank, a callable ``x -> y``
  calling ``site.C`` (:mod:`einshard.comm.collectives` eagerly,
  :mod:`einshard.comm._traced_collectives` under ``torch.compile``);
- ``traffic(p, n, root)``: the bytes one call sends and receives over a group
  of ``p`` ranks, ``n`` the bytes of the buffer that defines it (the rank's
  padded block, the whole buffer, ...); ``root`` is this rank's role for
  asymmetric ones, ``None`` for the group's mean. ``count_communication``
  records these numbers and the planner prices them;
- ``basis(step, mesh)``: for a planned step, that buffer in elements,
  averaged over the ranks; ``transport`` names the primitive whose traffic a
  step kind has (an ``exchange`` runs on ``all_to_all_v``);
- ``what(step)``: how :func:`einshard.ops.explain` describes it;
- ``vary(mask, dims)``: in ``shard_map``, the mesh dimensions (bit masks) the
  output varies over, given the input's and the collective's.

:func:`price` in :mod:`einshard.plan.cost` and ``Step`` in
:mod:`einshard.plan.transition` read the registry; so do the executor, the
named collectives and the raw collectives' accounting. The local step kinds
and those that run on another's transport are defined here; every
collective is a :class:`einshard.comm.collective.Collective`, a primitive
defined in its own module of :mod:`einshard.comm.entries`, which registers
it here.

>>> Primitive("copy").communicates(None)
False
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..core.layout import Layout, MeshShape, grouped, interval_grid

__all__ = [
    "Primitive",
    "PRIMITIVES",
    "Site",
    "rel_slices",
    "narrow",
    "moved_numel",
    "moved",
    "padded_block",
    "padded_step",
    "invariant",
    "varying",
    "same",
]


@dataclass(frozen=True)
class Primitive:
    """One communication primitive or planner step kind (see the module docstring)."""

    name: str
    what: Callable | None = None  # step -> explain text
    run: Callable | None = None  # (step, site) -> x -> y
    basis: Callable | None = None  # (step, mesh) -> mean elements of the defining buffer
    traffic: Callable | None = None  # (p, n bytes, root) -> (sent, received) bytes of one call
    transport: str = ""  # the primitive whose traffic a step kind has ("": its own)
    collective: Callable | None = None  # step -> communicates (default: whether it has a traffic)
    vary: Callable | None = None  # (input mask, dims mask) -> output mask in shard_map

    def communicates(self, step) -> bool:
        if self.collective is not None:
            return self.collective(step)
        return self.traffic is not None or bool(self.transport)

    def sent(self, step, mesh: MeshShape, itemsize: int) -> float:
        """Bytes each rank sends for ``step``, averaged over the ranks."""
        if not self.communicates(step):
            return 0.0
        carrier = PRIMITIVES[self.transport] if self.transport else self
        traffic, basis = carrier.traffic, self.basis
        assert traffic is not None and basis is not None, self.name  # a communicating step kind has both
        return traffic(mesh.size(step.dims), basis(step, mesh) * itemsize, None)[0]


PRIMITIVES: dict[str, Primitive] = {}


def _define(**fields) -> Primitive:
    prim = Primitive(**fields)
    PRIMITIVES[prim.name] = prim
    return prim


class Site:
    """Where a step runs: this rank's coordinate on ``mesh``, the collectives ``C``, the exchange."""

    __slots__ = ("mesh", "shape", "coord", "C", "exchange")

    def __init__(self, mesh, C, exchange):
        self.mesh, self.C, self.exchange = mesh, C, exchange
        self.shape = MeshShape.of(mesh)
        self.coord = mesh.coordinate

    def group(self, dims):
        return self.mesh.group(dims)

    def order(self, dims):
        """The group rank holding each block over ``dims`` (``None``: block ``k`` on group rank ``k``)."""
        return self.mesh.order(dims)

    def sizes(self, layout: Layout, i: int, dims) -> list[int]:
        """Axis ``i``'s block lengths of ``layout`` on the group's members, in block order (mesh order)."""
        members = self.shape.group_coords(dims, self.coord)
        return [b - a for a, b in (layout.interval(i, m, self.shape) for m in members)]

    def rel(self, inner: Layout, outer: Layout):
        return rel_slices(inner.box(self.coord, self.shape), outer.box(self.coord, self.shape))


# -- block geometry -------------------------------------------------------------------


def rel_slices(inner, outer):
    """Per-axis ``(start, length)`` of box ``inner`` inside box ``outer`` (empty: ``(0, 0)``)."""
    return [(a - c, b - a) if b > a else (0, 0) for (a, b), (c, _) in zip(inner, outer)]


def narrow(x: torch.Tensor, rel) -> torch.Tensor:
    for dim, (start, length) in enumerate(rel):
        if start != 0 or length != x.shape[dim]:
            x = x.narrow(dim, start, length)
    return x


def _block_numel(layout: Layout, mesh: MeshShape) -> np.ndarray:
    """Every rank's block size (elements), shaped like the mesh."""
    lo, hi = interval_grid(layout, mesh)
    return np.prod(hi - lo, axis=0)


def padded_block(layout: Layout, dims, mesh: MeshShape) -> float:
    """The largest block of each group over ``dims`` (what padded collectives send), averaged."""
    return float(np.mean(grouped(_block_numel(layout, mesh), mesh, dims).max(axis=1)))


def moved_numel(src: Layout, dst: Layout, mesh: MeshShape) -> np.ndarray:
    """Elements every rank must receive to turn ``src`` into ``dst`` (needed, not held), shaped like the mesh."""
    s0, s1 = interval_grid(src, mesh)
    d0, d1 = interval_grid(dst, mesh)
    need = np.prod(d1 - d0, axis=0)
    own = np.prod(np.clip(np.minimum(s1, d1) - np.maximum(s0, d0), 0, None), axis=0)
    return need - own


# -- variance rules (shard_map) and traffic rules ------------------------------------------

def invariant(mask: int, dims: int) -> int:
    """The output is the same across the group."""
    return mask & ~dims


def varying(mask: int, dims: int) -> int:
    """The output differs across the group."""
    return mask | dims


def same(p: int, n: float, root) -> tuple:
    """Traffic ``n`` sent and ``n`` received (``n``: the bytes for, and from, the other ranks)."""
    return n, n


def padded_step(name: str, text: str, side: str) -> dict:
    """The planner fields of a collective of blocks padded to the group's largest: ``side``'s blocks along
    ``step.axis`` (``run`` calls ``site.C.<name>(x, group, axis, sizes[, order])``)."""

    def run(step, site):
        group, fn, i, order = site.group(step.dims), getattr(site.C, name), step.axis, site.order(step.dims)
        sizes = site.sizes(getattr(step, side), i, step.dims)
        if order is None:
            return lambda x: fn(x, group, i, sizes)
        return lambda x: fn(x, group, i, sizes, order)

    return {
        "what": lambda s: f"{text} along {s.src.axes[s.axis]}" if s.axis >= 0 else text,
        "run": run,
        "basis": lambda s, mesh: padded_block(getattr(s, side), s.dims, mesh),  # n: the own (padded) block
        "traffic": lambda p, n, root: ((p - 1) * n,) * 2,
    }


# -- local steps --------------------------------------------------------------------------


def _run_slice(step, site):
    rel = site.rel(step.dst, step.src)
    return lambda x: narrow(x, rel)


def _run_keep_root(step, site):  # contributions: the value on group rank 0, zeros elsewhere
    return (lambda x: x) if site.shape.index(step.dims, site.coord) == 0 else torch.zeros_like


def _run_embed(step, site):
    """The block zero-padded to the contribution's extent; zeros on every rank but group rank 0 of
    the embedded dimensions that shard nothing in the result (a replicated result kept once)."""
    rel, out_shape = site.rel(step.src, step.dst), step.dst.local_shape(site.coord, site.shape)
    root = tuple(d for d in step.dims if step.src.owner(d) is None)
    keep = not root or site.shape.index(root, site.coord) == 0

    def embed(x):
        out = x.new_zeros(out_shape)
        if keep:
            narrow(out, rel).copy_(x)
        return out

    return embed


def _run_embed_adjoint(step, site):
    """The cotangent's block; broadcast from group rank 0 over ``dims`` (a result kept there only)."""
    rel = site.rel(step.dst, step.src)
    if not step.dims:
        return lambda g: narrow(g, rel).contiguous()
    group, C, order = site.group(step.dims), site.C, site.order(step.dims)
    root = 0 if order is None else order[0]  # the group rank holding block 0
    return lambda g: C.broadcast(narrow(g, rel).contiguous(), group, root)


_define(name="slice", what=lambda s: "local slice", run=_run_slice)
_define(name="keep_root", what=lambda s: "kept on group rank 0, zeros elsewhere", run=_run_keep_root)
_define(name="embed", what=lambda s: "embed as contributions (zero-padded)", run=_run_embed)
_define(
    name="embed_adjoint",
    what=lambda s: "broadcast from group rank 0" if s.dims else "local slice",
    run=_run_embed_adjoint,
    basis=lambda s, mesh: s.dst.mean_numel(mesh),
    transport="broadcast",
    collective=lambda s: bool(s.dims),
)


# -- step kinds that run on a collective's transport ------------------------------------------


def _run_exchange(step, site):  # the executor supplies the exchange (it builds on all_to_all_v)
    return site.exchange(step.src, step.dst, step.dims, site.mesh, site.C)


def moved(step, mesh: MeshShape) -> float:
    """The elements a rank receives for ``step``, averaged over the ranks."""
    return float(np.mean(moved_numel(step.src, step.dst, mesh)))


_define(
    name="exchange",
    what=lambda s: "exchange (all-to-all, per-rank sizes)",
    run=_run_exchange,
    basis=moved,
    transport="all_to_all_v",
)
