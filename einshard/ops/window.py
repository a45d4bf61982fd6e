"""``es.einwindow``: sharding-aware unfold.

``b h/sp w c -> b h/sp w kh c`` with ``windows={"h": "kh"}`` and
``radius={"h": 1}`` gives, for every position a rank owns, its ``2r+1``
neighbours along the new local axis ``kh`` (offsets ``-r .. r``). It is
:func:`einshard.ops.halo.einhalo` (ghost cells fetched from the owners, the
boundary mode outside the domain) followed by ``Tensor.unfold`` (a view) and
a permutation to the output order.
"""

from __future__ import annotations

from ..core import _trace
from ..errors import EinshardError
from ..notation import expand, freeze_families
from ..runtime import vma as _vma
from ..runtime.pipeline import (
    check_boundary,
    check_kept_sharding,
    check_spec,
    family_table,
    in_vma_scope,
    per_axis,
    pick_mesh,
    traced_plan,
    width_pair,
)
from .halo import halo_plan

__all__ = ["einwindow", "parse_window_formula"]


def parse_window_formula(formula, windows, radius, families):
    """``(input spec, input text, output spec, {axis: window name}, {axis: (left, right)})``, validated."""
    if not isinstance(formula, str) or formula.count("->") != 1:
        raise EinshardError("expects a formula 'input -> output'")
    left, right = (side.strip() for side in formula.split("->"))
    parsed_in, parsed_out = expand(left, families), expand(right, families)
    if parsed_in.output is not None or len(parsed_in.inputs) != 1 or len(parsed_out.inputs) != 1:
        raise EinshardError("expects one input and one output tensor")
    ins, out = parsed_in.inputs[0], parsed_out.inputs[0]
    check_spec(ins, "einwindow", "the input")
    check_spec(out, "einwindow", "the output")
    in_names = [a.name for a in ins.axes]
    wmap = per_axis(windows, in_names, families, "windows")
    table = family_table(families)
    for axis, name in wmap.items():
        if not isinstance(name, str):
            raise EinshardError(f"windows[{axis!r}] must be the name of the window axis, got {name!r}")
        if name in table and len(table[name]) == 1:
            wmap[axis] = table[name][0]
    rad = {k: width_pair(v, k, "radius") for k, v in per_axis(radius, in_names, families, "radius").items()}
    for axis in wmap:
        if axis not in rad:
            raise EinshardError(f"axis {axis!r} has a window but no radius; pass radius={{{axis!r}: r}}")
    for axis in rad:
        if axis not in wmap:
            raise EinshardError(f"radius names axis {axis!r}, which has no window in windows=")
    out_axes = {a.name: a for a in out.axes}
    seen = set()
    for axis, name in wmap.items():
        if name in in_names:
            raise EinshardError(f"window axis {name!r} (of {axis!r}) is already an input axis")
        if name in seen:
            raise EinshardError(f"window axis {name!r} is used for two axes")
        seen.add(name)
        if name not in out_axes:
            raise EinshardError(f"window axis {name!r} (of {axis!r}) is missing from the output")
        if out_axes[name].mesh:
            raise EinshardError(f"window axis {name!r} is sharded ('{out_axes[name]}'); window axes are local")
    for a in ins.axes:
        if a.name not in out_axes:
            raise EinshardError(f"input axis {a.name!r} is missing from the output")
        check_kept_sharding(a, out_axes[a.name])
    for name in out_axes:
        if name not in in_names and name not in seen:
            raise EinshardError(f"output axis {name!r} is neither an input axis nor a window axis")
    return ins, left, out, wmap, rad


def einwindow(formula, x, windows, radius, *, boundary="constant", fill=0, mesh=None, shapes=None, families=None):
    """For every owned position, its neighbourhood along new local window axes (a sharded unfold).

    ``windows`` maps input axes to new window axis names (or a family to a
    family / tuple of names); ``radius`` maps the same axes to ``r`` (window
    ``2r+1``, offsets ``-r..r``) or ``(left, right)`` (window
    ``left+right+1``). Positions outside the domain follow ``boundary`` as
    in :func:`einhalo`. The output holds every input axis with its sharding
    plus the window axes (unsharded), in the output's order; it is a view of
    the halo-extended block (under ``torch.compile``, a copy).

    >>> import torch
    >>> from einshard.ops.window import einwindow
    >>> einwindow("w -> w k", torch.arange(4.), {"w": "k"}, {"w": 1})
    tensor([[0., 0., 1.],
            [0., 1., 2.],
            [1., 2., 3.],
            [2., 3., 0.]])

    Distributed::

        y = es.einwindow("b h/sp w c -> b h/sp w kh kw c", x_block, {"h": "kh", "w": "kw"},
                         {"h": 1, "w": 1}, boundary="periodic", mesh=mesh)
    """
    if in_vma_scope():  # in shard_map(check_vma=True): variance rules
        return _vma.formula_op(lambda f, t, **kw: einwindow(f, t, windows, radius, **kw), formula, (x,),
                               boundary=boundary, fill=fill, mesh=mesh, shapes=shapes, families=families)
    if _trace.traced():  # torch.compile: planned at trace time
        plan, ins, out, wmap, rad = traced_plan(_traced_plan, formula, _trace.static_shape(x), x.dtype, x.device,
                                                windows, radius, boundary, mesh, shapes, families)
    else:
        plan, ins, out, wmap, rad = _plan(formula, x, windows, radius, boundary, mesh, shapes, families)
    y = plan(x, fill)
    names = [a.name for a in ins.axes]
    current = list(names)
    for axis, name in wmap.items():
        left, right = rad[axis]
        dim, size = names.index(axis), left + right + 1
        if y.shape[dim] < size:  # an empty block: no windows (unfold refuses)
            y = y.narrow(dim, 0, 0).unsqueeze(-1)
            y = y.expand(*y.shape[:-1], size)
        else:
            y = y.unfold(dim, size, 1)
        current.append(name)
    order = [current.index(a.name) for a in out.axes]
    if order != list(range(len(order))):
        y = y.permute(order)
    if _trace.traced() and wmap:
        # a copy: AOTAutograd (torch 2.13) gets the gradient of a graph output whose elements overlap (the
        # windows of an unfold) wrong; inside a graph the copy feeds the next op
        y = y.contiguous()
    return y


def _plan(formula, x, windows, radius, boundary, mesh, shapes, families):
    """``(halo plan, input spec, output spec, windows, radii)`` of one call."""
    try:
        check_boundary(boundary)
        ins, in_text, out, wmap, rad = parse_window_formula(formula, windows, radius, families)
        m = pick_mesh(ins, mesh)
        plan = halo_plan(ins, in_text, x, rad, boundary, m, shapes, "einwindow", freeze_families(families))
    except EinshardError as err:
        raise err.within(formula, "einwindow")  # noqa: B904 - the caught error itself, named
    return plan, ins, out, wmap, rad


def _traced_plan(formula, shape, dtype, device, windows, radius, boundary, mesh, shapes, families):
    plan, ins, out, wmap, rad = _plan(formula, _trace.stand_in(shape, dtype, device), windows, radius, boundary,
                                      mesh, shapes, families)
    return plan.prepare_traced(), ins, out, wmap, rad
