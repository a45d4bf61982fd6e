"""``es.einroll``: ``torch.roll`` on named axes of sharded tensors.

On a sharded axis the rolled tensor keeps the input's layout (the same split
shapes), so each rank's new block is made of at most two slices of the
global axis. Each owner sends each destination exactly the part of its
block that lands there (one :class:`~einshard.comm.exchange.Exchange` over the
mesh dimensions that shard the rolled axes; several sharded axes move
together, so a cell that crosses two block boundaries moves once, straight
to its destination). The part of a block that stays on its rank is copied
locally, and unsharded axes roll in the same exchange (without one,
``torch.roll``). Backward moves the pieces back (a roll by the opposite
shifts).
"""

from __future__ import annotations

import operator

import torch

from ..comm.exchange import exchange_group, runs_exchange
from ..core._cache import BoundedCache
from ..core.layout import Layout
from ..errors import EinshardError
from ..notation import freeze_families
from ..plan.halo import roll_runs
from ..plan.resolve import freeze_shapes
from ..runtime.dispatch import Operation
from ..runtime.pipeline import (
    agree_before_communicating,
    agrees_always,
    ambient_key,
    build_plan,
    parse_spec,
    per_axis,
    pick_mesh,
    spec_layout,
)

__all__ = ["einroll", "RollPlan"]


class RollPlan:
    """A roll of one spec, local shape, layout and mesh, bound to this rank: ``plan(x)``."""

    __slots__ = ("layout", "mesh", "dims", "shifts", "exchange", "local_error", "always")

    def __init__(self, layout: Layout, shifts: dict[int, int], mesh, local_error=None, always=False):
        self.layout, self.mesh, self.local_error, self.always = layout, mesh, local_error, always
        moving = {i: s % layout.sizes[i] for i, s in sorted(shifts.items()) if layout.sizes[i] > 0}
        moving = {i: s for i, s in moving.items() if s}
        self.dims, self.shifts = tuple(moving), tuple(moving.values())
        ex_axes, dims = exchange_group(layout, moving, mesh)
        self.exchange = None
        if ex_axes and local_error is None:  # every moving axis in one exchange (unsharded ones locally)
            self.exchange = runs_exchange(layout, layout, dims, mesh,
                                          lambda i, owner, dest: roll_runs(owner, dest, moving[i], layout.sizes[i]),
                                          self.dims)

    def prepare_traced(self) -> RollPlan:
        """This plan ready for traced code (its exchange's adjoint built)."""
        if self.exchange is not None:
            self.exchange.prepare_traced()
        return self

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        agree_before_communicating(self.mesh, self.local_error, x, self.always)
        if self.exchange is not None:
            return self.exchange(x)
        return torch.roll(x, self.shifts, self.dims) if self.dims else x


_PLANS = BoundedCache(name="einshard.ops.roll.plans")


def _shift(value, axis: str) -> int:
    try:
        if not isinstance(value, bool):
            return operator.index(value)
    except TypeError:
        pass
    raise EinshardError(f"the shift of axis {axis!r} must be an int, got {value!r}")


def einroll(spec, x, shifts, *, mesh=None, shapes=None, families=None):
    """``torch.roll`` on named axes; sharded axes move only the slices that cross block boundaries.

    ``shifts`` maps axes (or families, with a tuple per member) to integer
    shifts: the result at global position ``t`` holds the input at
    ``(t - shift) mod size``, like ``torch.roll``. The result keeps the
    input's layout. Without ``shapes=`` a sharded axis is assumed evenly split.

    >>> import torch
    >>> from einshard.ops.roll import einroll
    >>> einroll("b w", torch.arange(6.).reshape(2, 3), {"w": 1})
    tensor([[2., 0., 1.],
            [5., 3., 4.]])

    Distributed (each rank holds its block of ``h`` over ``sp``)::

        y = es.einroll("b h/sp w", x_block, {"h": 3, "w": -1}, mesh=mesh, shapes={"sp": [5, 5, 6]})
    """
    return _EINROLL.dispatch(spec, (x,), ((shifts,), mesh, shapes, families, ()))


def _plan(spec, tensors, args, mesh, shapes, families) -> RollPlan:
    x, (shifts,) = tensors[0], args
    tspec = parse_spec(spec, families, "einroll")
    names = [a.name for a in tspec.axes]
    by_name = {k: _shift(v, k) for k, v in per_axis(shifts, names, families, "shifts").items()}
    m = pick_mesh(tspec, mesh)
    key = (spec, freeze_families(families), tspec, tuple(sorted(by_name.items())), tuple(x.shape),
           freeze_shapes(shapes), m, ambient_key(), x.dtype, x.device)

    def build():
        layout, local_error = spec_layout(tspec, spec, tuple(x.shape), m, shapes)
        return RollPlan(layout, {names.index(k): v for k, v in by_name.items()}, m, local_error,
                        agrees_always(m, shapes))

    return build_plan(_PLANS, key, m, build, (spec, "einroll"))


def _run(plan, tensors, run_args):
    return plan(tensors[0])


_EINROLL = Operation("einroll", plan=_plan, run=_run, cache=BoundedCache(name="einshard.ops.roll.calls"))
