"""``es.einhalo``: ghost cells on named axes of sharded grids.

A halo widens every rank's block of the named axes by ``left`` cells before
and ``right`` cells after. Cells inside the global domain come from the
ranks that own them; cells outside it follow the boundary mode
(``constant`` with ``fill``, ``periodic``, ``replicate``).

How data moves: the axes that are sharded over mesh dimensions of more
than one rank are exchanged *at once*, over the group of all the mesh
dimensions that shard them, in one :class:`~einshard.comm.exchange.Exchange`
(point-to-point with the ranks that hold the cells; ranks that exchange
nothing take no part). Each rank receives, from each owner, the product over
the exchanged axes of the runs it reads from that owner's block
(:mod:`einshard.plan.halo`), so corner cells of 2-D/3-D halos come straight
from the diagonal neighbour and every remote element crosses the network
exactly once per receiver. (Exchanging the axes one after the other,
widening progressively, would need fewer peers but moves each corner cell
twice.) Halos wider than a neighbour's block read from several ranks, empty
blocks send and receive nothing, and repeated cells (a periodic halo wider
than the axis, a replicate edge) are moved once and copied locally.

The exchange writes the widened block directly (fetched cells received in
place where they are contiguous, the owned block copied while messages are
in flight, constant-boundary cells filled); it is an autograd Function whose
backward moves the gradient back, adding into the owners.
"""

from __future__ import annotations

import functools

import torch

from ..comm.exchange import exchange_group, runs_exchange
from ..core._cache import BoundedCache
from ..core.layout import Layout, MeshShape
from ..errors import EinshardError
from ..notation import TensorSpec, freeze_families
from ..plan.halo import halo_axis, halo_runs
from ..plan.resolve import freeze_shapes
from ..runtime.dispatch import Operation
from ..runtime.pipeline import (
    agree_before_communicating,
    agrees_always,
    ambient_key,
    build_plan,
    check_boundary,
    parse_spec,
    per_axis,
    pick_mesh,
    spec_layout,
    width_pair,
)

__all__ = ["einhalo", "HaloPlan", "halo_plan"]


# -- the halo plan ------------------------------------------------------------------------------


class HaloPlan:
    """A halo of one spec, local shape, layout and mesh, bound to this rank: ``plan(x, fill)``.

    One :class:`~einshard.comm.exchange.Exchange` writes the widened block: owned
    and fetched cells at their place, cells outside a constant boundary set
    to ``fill``. Cells read twice (a periodic halo wider than the axis, a
    replicate edge) move once; an ``index_select`` repeats them.
    """

    __slots__ = ("layout", "mesh", "exchange", "indices", "local_error", "always")

    def __init__(self, layout: Layout, widths: dict[int, tuple[int, int]], boundary: str, mesh, device,
                 local_error=None, always=False):
        self.layout, self.mesh, self.local_error, self.always = layout, mesh, local_error, always
        axes = [i for i, (left, right) in sorted(widths.items()) if left or right]
        ex_axes, dims = exchange_group(layout, axes, mesh)
        read = functools.lru_cache(None)(
            lambda i, iv: halo_axis(iv[0], iv[1], widths[i][0], widths[i][1], layout.sizes[i], boundary))

        def runs(i, owner, dest):
            h = read(i, dest)
            return tuple((s, d + h.left_fill, n) for s, d, n in halo_runs(owner, h.needed))

        shape = MeshShape.of(mesh) if mesh is not None else None
        local = layout.local_shape(mesh.coordinate, shape) if shape is not None else layout.sizes
        mine = {i: read(i, layout.interval(i, mesh.coordinate, shape) if shape is not None else (0, local[i]))
                for i in axes}
        sizes = {i: h.left_fill + h.buffer_size + h.right_fill for i, h in mine.items()}
        out = [sizes.get(d, n) for d, n in enumerate(local)]
        blank = [tuple((start, n) if d == i else (0, m) for d, m in enumerate(out))  # constant-boundary cells
                 for i, h in mine.items()
                 for start, n in ((0, h.left_fill), (out[i] - h.right_fill, h.right_fill)) if n]
        self.exchange = None if local_error is not None else runs_exchange(
            layout, layout, dims if ex_axes else (), mesh, runs, axes, sizes, blank)
        self.indices = [(i, torch.tensor(h.index, dtype=torch.long, device=device))
                        for i, h in mine.items() if h.index is not None]

    def prepare_traced(self) -> HaloPlan:
        """This plan ready for traced code (its exchange's adjoint built)."""
        if self.exchange is not None:
            self.exchange.prepare_traced()
        return self

    def __call__(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        agree_before_communicating(self.mesh, self.local_error, x, self.always)
        assert self.exchange is not None  # none only with a local error, raised above
        t = self.exchange(x, fill)
        for dim, index in self.indices:
            t = t.index_select(dim, index)
        return t


_PLANS = BoundedCache(name="einshard.ops.halo.plans")


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
                        local_error, agrees_always(mesh, shapes))

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
    return _EINHALO.dispatch(spec, (x,), ((halos, boundary), mesh, shapes, families, (fill,)))


def _plan(spec, tensors, args, mesh, shapes, families) -> HaloPlan:
    halos, boundary = args
    check_boundary(boundary)
    tspec = parse_spec(spec, families, "einhalo")
    names = [a.name for a in tspec.axes]
    widths = {k: width_pair(v, k, "halos") for k, v in per_axis(halos, names, families, "halos").items()}
    m = pick_mesh(tspec, mesh)
    return halo_plan(tspec, spec, tensors[0], widths, boundary, m, shapes, "einhalo", freeze_families(families))


def _run(plan, tensors, run_args):
    return plan(tensors[0], run_args[0])


_EINHALO = Operation("einhalo", plan=_plan, run=_run, cache=BoundedCache(name="einshard.ops.halo.calls"))
