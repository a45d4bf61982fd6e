"""``es.einhalo``: ghost cells on named axes of sharded grids.

A halo widens every rank's block of the named axes by ``left`` cells before
and ``right`` cells after. Cells inside the global domain come from the
ranks that own them; cells outside it follow the boundary mode
(``constant`` with ``fill``, ``periodic``, ``replicate``).

How data moves: the axes that are sharded over mesh dimensions of more
than one rank are exchanged *at once*, over the group of all the mesh
dimensions that shard them, with one ``all_to_all_v`` (per-rank split sizes;
ranks that exchange nothing send zero bytes). Each rank receives, from each
owner, the product over the exchanged axes of the runs it reads from that
owner's block (:mod:`einshard.plan.halo`), so corner cells of 2-D/3-D halos
come straight from the diagonal neighbour and every remote element crosses
the network exactly once per receiver. (Exchanging the axes one after the
other, widening progressively, would need fewer peers but moves each corner
cell twice.) Halos wider than a neighbour's block read from several ranks,
empty blocks send and receive nothing, and repeated cells (a periodic halo
wider than the axis, a replicate edge) are moved once and copied locally.

The exchange is an autograd Function whose backward is the reverse exchange
with summation into the owners (scatter-add); the local expansion (fill,
wrap, edge repetition) is ordinary differentiable torch code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import _context
from .. import collectives as C
from .. import vma as _vma
from .._cache import BoundedCache
from ..errors import EinshardError
from ..mappings import make_mapping
from ..layout import Layout, MeshShape
from ..notation import TensorSpec, freeze_families
from ..plan.halo import halo_axis, halo_needed, halo_runs
from ..resolve import freeze_shapes
from .pipeline import (
    agree_before_communicating,
    ambient_key,
    build_plan,
    check_boundary,
    freeze,
    in_vma_scope,
    parse_spec,
    per_axis,
    pick_mesh,
    spec_layout,
    width_pair,
)

__all__ = ["einhalo", "BoxExchange", "HaloPlan", "halo_plan"]


# -- the exchange of rectangular pieces ------------------------------------------------------


def _take(t: torch.Tensor, axes, runs_per_axis, which: int) -> torch.Tensor:
    """The piece of ``t``: on each axis the concatenation of the runs' ``which`` side (0 src, 1 dst)."""
    for dim, runs in zip(axes, runs_per_axis):
        if len(runs) == 1:
            r = runs[0]
            if r[which] != 0 or r[2] != t.shape[dim]:
                t = t.narrow(dim, r[which], r[2])
        else:
            t = torch.cat([t.narrow(dim, r[which], r[2]) for r in runs], dim)
    return t


def _place(out: torch.Tensor, piece: torch.Tensor, axes, runs_per_axis, which: int, add: bool) -> None:
    """Copy (or add) the sub-boxes of ``piece`` to the runs' ``which`` side of ``out``."""
    per_axis = []
    for runs in runs_per_axis:
        offsets, off = [], 0
        for r in runs:
            offsets.append((off, r[which], r[2]))
            off += r[2]
        per_axis.append(offsets)
    for combo in itertools.product(*per_axis):
        src, dst = piece, out
        for dim, (poff, pos, n) in zip(axes, combo):
            src = src.narrow(dim, poff, n)
            dst = dst.narrow(dim, pos, n)
        if add:
            dst.add_(src)
        else:
            dst.copy_(src)


class BoxExchange:
    """One exchange of rectangular pieces between the ranks of a group (bound to this rank).

    ``sends[j]`` / ``recvs[j]``: per exchanged tensor dimension (``axes``),
    the runs ``(src, dst, length)`` of the piece this rank sends to / receives
    from group rank ``j`` (``None``: nothing). A piece is the product of its
    runs; the sender reads the ``src`` side of its input block, the receiver
    writes the ``dst`` side of its output buffer. Forward copies (every
    output element is written exactly once), the adjoint sends the output
    gradient back along the same pieces and adds it into the owners' blocks.
    """

    __slots__ = ("group", "axes", "in_shape", "out_shape", "sends", "recvs", "send_numels", "recv_numels",
                 "send_shapes", "recv_shapes")

    def __init__(self, group, axes, in_shape, out_shape, sends, recvs):
        self.group = group
        self.axes = tuple(axes)
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.sends, self.recvs = list(sends), list(recvs)
        self.send_shapes = [self._shape(self.in_shape, s) for s in self.sends]
        self.recv_shapes = [self._shape(self.out_shape, r) for r in self.recvs]
        self.send_numels = [0 if s is None else math.prod(s) for s in self.send_shapes]
        self.recv_numels = [0 if s is None else math.prod(s) for s in self.recv_shapes]
        assert sum(self.recv_numels) == math.prod(self.out_shape), "exchange does not cover its output"

    def _shape(self, base, runs_per_axis):
        if runs_per_axis is None:
            return None
        shape = list(base)
        for dim, runs in zip(self.axes, runs_per_axis):
            shape[dim] = sum(r[2] for r in runs)
        return tuple(shape)

    def forward_raw(self, x: torch.Tensor) -> torch.Tensor:
        empty = x.new_empty(0)
        chunks = [empty if s is None else _take(x, self.axes, s, 0) for s in self.sends]
        got = C.all_to_all_v(chunks, self.recv_numels, self.group, pairwise=True)
        out = x.new_empty(self.out_shape)
        for r, shape, flat in zip(self.recvs, self.recv_shapes, got):
            if r is not None and flat.numel():
                _place(out, flat.view(shape), self.axes, r, 1, add=False)
        return out

    def adjoint_raw(self, g: torch.Tensor) -> torch.Tensor:
        empty = g.new_empty(0)
        chunks = [empty if r is None else _take(g, self.axes, r, 1) for r in self.recvs]
        got = C.all_to_all_v(chunks, self.send_numels, self.group, pairwise=True)
        out = g.new_zeros(self.in_shape)
        for s, shape, flat in zip(self.sends, self.send_shapes, got):
            if s is not None and flat.numel():
                _place(out, flat.view(shape), self.axes, s, 0, add=True)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _exchange(x, self)


# the exchange and its adjoint (scatter-add back to the owners), each the other's backward
_exchange = make_mapping("HaloExchange", lambda x, ex: ex.forward_raw(x), lambda g, ex: _exchange_adjoint(g, ex))
_exchange_adjoint = make_mapping("HaloExchangeAdjoint", lambda g, ex: ex.adjoint_raw(g), lambda d, ex: _exchange(d, ex))


def exchange_group(layout: Layout, axes: Sequence[int], mesh):
    """``(exchanged axes, mesh dims)``: the axes sharded over more than one rank, and their dims."""
    if mesh is None:
        return (), ()
    shape = MeshShape.of(mesh)
    ex = [i for i in axes if layout.shard[i] and shape.size(layout.shard[i]) > 1]
    dims = shape.sort(d for i in ex for d in layout.shard[i])
    return tuple(ex), dims


def compile_exchange(layout: Layout, ex_axes, dims, mesh, runs_fn, out_sizes) -> BoxExchange:
    """A :class:`BoxExchange` over the group of ``dims``.

    ``runs_fn(i, owner_interval, dest_interval)`` gives the runs on axis ``i``
    from an owner block to a destination; ``out_sizes[i]`` is this rank's
    output buffer size on axis ``i``.
    """
    shape = MeshShape.of(mesh)
    coord = mesh.coordinate
    members = shape.group_coords(dims, coord)
    mine = {i: layout.interval(i, coord, shape) for i in ex_axes}
    sends, recvs = [], []
    for m in members:
        theirs = {i: layout.interval(i, m, shape) for i in ex_axes}
        s = tuple(runs_fn(i, mine[i], theirs[i]) for i in ex_axes)
        r = tuple(runs_fn(i, theirs[i], mine[i]) for i in ex_axes)
        sends.append(None if any(not x for x in s) else s)
        recvs.append(None if any(not x for x in r) else r)
    in_shape = layout.local_shape(coord, shape)
    out_shape = list(in_shape)
    for i in ex_axes:
        out_shape[i] = out_sizes[i]
    return BoxExchange(mesh.group(dims), ex_axes, in_shape, out_shape, sends, recvs)


# -- the halo plan ------------------------------------------------------------------------------


class HaloPlan:
    """A halo of one spec, local shape, layout and mesh, bound to this rank: ``plan(x, fill)``."""

    __slots__ = ("layout", "widths", "boundary", "mesh", "exchange", "pads", "indices", "local_error",
                 "out_shape")

    def __init__(self, layout: Layout, widths: dict[int, tuple[int, int]], boundary: str, mesh, device,
                 local_error=None):
        self.layout, self.widths, self.boundary, self.mesh = layout, dict(widths), boundary, mesh
        self.local_error = local_error
        axes = [i for i, (l, r) in sorted(self.widths.items()) if l or r]
        ex_axes, dims = exchange_group(layout, axes, mesh)
        shape = MeshShape.of(mesh) if mesh is not None else None
        coord = mesh.coordinate if mesh is not None else None

        def interval(i, c):
            return layout.interval(i, c, shape) if shape is not None else (0, layout.sizes[i])

        reads = {}
        for i in axes:
            s, e = interval(i, coord)
            left, right = self.widths[i]
            reads[i] = halo_axis(s, e, left, right, layout.sizes[i], boundary)
        self.exchange = None
        if ex_axes and local_error is None:
            needed_cache: dict = {}

            def needed(i, iv):
                key = (i, iv)
                if key not in needed_cache:
                    left, right = self.widths[i]
                    needed_cache[key] = halo_needed(iv[0], iv[1], left, right, layout.sizes[i], boundary)
                return needed_cache[key]

            self.exchange = compile_exchange(
                layout, ex_axes, dims, mesh,
                lambda i, owner, dest: halo_runs(owner, needed(i, dest)),
                {i: reads[i].buffer_size for i in ex_axes},
            )
        ndim = len(layout.axes)
        self.pads = None
        self.indices = []
        if boundary == "constant":
            if any(reads[i].left_fill or reads[i].right_fill for i in axes):
                first = min(axes)
                pads = []
                for d in range(ndim - 1, first - 1, -1):
                    h = reads.get(d)
                    pads += [h.left_fill, h.right_fill] if h is not None else [0, 0]
                self.pads = tuple(pads)
        else:
            for i in axes:
                if reads[i].index is not None:
                    self.indices.append((i, torch.tensor(reads[i].index, dtype=torch.long, device=device)))
        local = list(layout.local_shape(coord, shape)) if shape is not None else list(layout.sizes)
        for i in axes:
            local[i] += sum(self.widths[i])
        self.out_shape = tuple(local)

    def __call__(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        agree_before_communicating(self.mesh, self.local_error, x)
        t = x if self.exchange is None else self.exchange(x)
        if self.pads is not None:
            t = F.pad(t, self.pads, mode="constant", value=fill)
        for dim, index in self.indices:
            t = t.index_select(dim, index)
        return t


_PLANS = BoundedCache()
_FAST = BoundedCache()  # the raw arguments of einhalo -> plan (skips parsing and validation on repeat calls)


def halo_plan(spec: TensorSpec, text: str, x: torch.Tensor, widths: dict[str, tuple[int, int]], boundary: str,
              mesh, shapes, what: str, families_key=()) -> HaloPlan:
    """The cached :class:`HaloPlan` of ``spec`` for ``x`` (``widths`` keyed by axis name)."""
    key = (text, families_key, spec, tuple(sorted(widths.items())), boundary, tuple(x.shape),
           freeze_shapes(shapes), mesh, ambient_key(), x.dtype, x.device)

    def build():
        layout, local_error = spec_layout(spec, text, tuple(x.shape), mesh, shapes)
        names = list(layout.axes)
        for name, (left, right) in widths.items():
            i = names.index(name)
            if (left or right) and boundary in ("periodic", "replicate") and layout.sizes[i] == 0:
                raise EinshardError(f"axis {name!r} is empty; a {boundary} halo needs at least one cell")
        return HaloPlan(layout, {names.index(k): v for k, v in widths.items()}, boundary, mesh, x.device,
                        local_error)

    return build_plan(_PLANS, key, mesh, build, (text, what))


def einhalo(spec, x, halos, *, boundary="constant", fill=0, mesh=None, shapes=None, families=None):
    """Grow named axes by ghost cells; sharded axes fetch them from the ranks that own them.

    ``halos`` maps axes (or families, with a tuple per member) to a width
    ``w`` or ``(left, right)``. Every rank's block grows by ``left + right``
    along each named axis (the result keeps the input's layout). Cells
    outside the global domain follow ``boundary``: ``"constant"`` (``fill``),
    ``"periodic"`` (wrap around) or ``"replicate"`` (repeat the edge cell,
    like ``F.pad(mode="replicate")``). Backward adds every ghost cell's
    gradient back into its owner.

    >>> import torch
    >>> from einshard.ops.halo import einhalo
    >>> x = torch.arange(5.).reshape(1, 5)
    >>> einhalo("b w", x, {"w": (2, 1)}, boundary="periodic")
    tensor([[3., 4., 0., 1., 2., 3., 4., 0.]])
    >>> einhalo("b w", x, {"w": 1}, fill=-1.0)
    tensor([[-1.,  0.,  1.,  2.,  3.,  4., -1.]])

    Distributed (``x_block`` is this rank's block of rows over ``sp``)::

        y = es.einhalo("b h/sp w c", x_block, {"h": 1, "w": 1}, boundary="periodic", mesh=mesh)
    """
    if in_vma_scope():  # in shard_map(check_vma=True): variance rules
        return _vma.formula_op(lambda s, t, **kw: einhalo(s, t, halos, **kw), spec, (x,), boundary=boundary,
                               fill=fill, mesh=mesh, shapes=shapes, families=families)
    try:
        fast = (spec, freeze(halos), boundary, freeze(families), freeze_shapes(shapes), mesh,
                _context.current().mesh, ambient_key(), x.shape, x.dtype, x.device)
        plan = _FAST.get(fast)
    except TypeError:  # unhashable arguments: take the checked path (it reports them)
        fast, plan = None, None
    if plan is None:
        try:
            check_boundary(boundary)
            tspec = parse_spec(spec, families, "einhalo")
            names = [a.name for a in tspec.axes]
            widths = {k: width_pair(v, k, "halos") for k, v in per_axis(halos, names, families, "halos").items()}
            m = pick_mesh(tspec, mesh)
            plan = halo_plan(tspec, spec, x, widths, boundary, m, shapes, "einhalo", freeze_families(families))
        except EinshardError as err:
            raise err.within(spec, "einhalo")
        if fast is not None:
            _FAST.put(fast, plan)
    return plan(x, fill)
