"""``es.einhalo``: ghost cells on named axes of sharded grids.

A halo widens every rank's block of the named axes by ``left`` cells before
and ``right`` cells after. Cells inside the global domain come from the
ranks that own them; cells outside it follow the boundary mode
(``constant`` with ``fill``, ``periodic``, ``replicate``).

How data moves: the axes that are sharded over mesh dimensions of more
than one rank are exchanged *at once*, over the group of all the mesh
dimensions that shard them, in one :class:`~einshard.exchange.Exchange`
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
import operator
from collections.abc import Mapping, Sequence

import torch

from .. import vma as _vma
from .. import _context, checks
from ..exchange import exchange_group, runs_exchange
from ..layout import Layout, MeshShape
from ..mesh import resolve_mesh
from ..notation import Formula, Group, TensorSpec, expand, freeze_families
from ..plan.halo import BOUNDARIES, halo_axis, halo_runs
from ..resolve import freeze_shapes, resolve

__all__ = ["einhalo", "HaloPlan", "halo_plan"]


# -- argument handling shared by einhalo / einwindow / einconv / einroll --------------------


def parse_spec(text: str, families, what: str) -> TensorSpec:
    """The one tensor spec of ``text`` (families expanded), validated for the stencil ops."""
    if not isinstance(text, str):
        raise ValueError(f"{what}: the spec must be a string like 'b h/sp w c', got {type(text).__name__}")
    parsed = expand(text, freeze_families(families))
    if parsed.output is not None or len(parsed.inputs) != 1:
        raise ValueError(f"{what}: expects one tensor spec like 'b h/sp w c' (no '->', no ','), got {text!r}")
    spec = parsed.inputs[0]
    check_spec(spec, text, what)
    return spec


def check_spec(spec: TensorSpec, text: str, what: str, where: str = "the spec") -> None:
    """No ``...``, factored axes, partial sums or repeated names (ValueErrors naming the axis)."""
    if spec.has_ellipsis:
        raise ValueError(f"{what}: {text!r}: '...' is not supported in {where}; name every axis")
    for item in spec.items:
        if isinstance(item, Group):
            names = " ".join(a.name for a in item.axes)
            raise ValueError(
                f"{what}: {text!r}: factored axis '({names})' in {where} (axis {item.axes[0].name!r}) is not "
                f"supported; reshape first and name the axes separately"
            )
    if spec.partial:
        raise ValueError(f"{what}: {text!r}: {where} is partial ('// ...'); reduce it first (es.einshard)")
    seen = set()
    for a in spec.axes:
        if a.name in seen:
            raise ValueError(f"{what}: {text!r}: axis {a.name!r} appears twice in {where}")
        seen.add(a.name)


def family_table(families) -> dict[str, tuple[str, ...]]:
    """``{family: (member names without shardings)}``."""
    table = {}
    for name, members in freeze_families(families):
        table[name] = tuple(str(m).split("/")[0].strip() for m in members)
    return table


def per_axis(mapping, names: Sequence[str], families, what: str, arg: str, text: str) -> dict:
    """``{axis: value}`` from a mapping keyed by axes or families (a family key takes a tuple)."""
    if mapping is None:
        return {}
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{what}: {arg} must be a dict keyed by axis (or family) names, got {mapping!r}")
    table = family_table(families)
    out: dict = {}
    for key, value in mapping.items():
        if key in names:
            targets, values = (key,), (value,)
        elif key in table:
            members = table[key]
            if isinstance(value, str) and value in table:
                value = table[value]
            if not isinstance(value, (tuple, list)) or len(value) != len(members):
                raise ValueError(
                    f"{what}: {arg}[{key!r}] names family {key!r} with {len(members)} members "
                    f"{list(members)}; give a tuple of {len(members)} values, got {value!r}"
                )
            targets, values = members, tuple(value)
        else:
            raise ValueError(
                f"{what}: {text!r}: {arg} names axis {key!r}, which is not in the spec (axes: {list(names)})"
            )
        for t, v in zip(targets, values):
            if t not in names:
                raise ValueError(
                    f"{what}: {text!r}: {arg} names axis {t!r} (family {key!r}), which is not in the spec "
                    f"(axes: {list(names)})"
                )
            if t in out:
                raise ValueError(f"{what}: {arg} gives axis {t!r} twice")
            out[t] = v
    return out


def _nonneg_int(v) -> bool:
    if isinstance(v, bool):
        return False
    try:
        return operator.index(v) >= 0
    except TypeError:
        return False


def width_pair(value, axis: str, what: str, arg: str) -> tuple[int, int]:
    """``w`` or ``(left, right)`` as ``(left, right)`` of non-negative ints."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2 or not all(_nonneg_int(v) for v in value):
            raise ValueError(f"{what}: {arg} of axis {axis!r} must be an int or (left, right) of ints >= 0, got {value!r}")
        return int(value[0]), int(value[1])
    if not _nonneg_int(value):
        raise ValueError(f"{what}: {arg} of axis {axis!r} must be an int >= 0 or (left, right), got {value!r}")
    return int(value), int(value)


def check_boundary(boundary: str, what: str) -> str:
    if boundary not in BOUNDARIES:
        raise ValueError(f"{what}: boundary must be one of {list(BOUNDARIES)}, got {boundary!r}")
    return boundary


def freeze(value):
    """A hashable form of nested dicts / lists of plain values."""
    if isinstance(value, Mapping):
        return ("dict",) + tuple(sorted((str(k), freeze(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("seq",) + tuple(freeze(v) for v in value)
    if isinstance(value, bool):  # True == 1 would share a cache entry with a valid width
        return ("bool", value)
    return value


def pick_mesh(spec: TensorSpec, mesh):
    """The mesh a spec needs: ``None`` for a local spec, else ``mesh=`` or the ambient one."""
    if not any(a.mesh for a in spec.axes):
        return None
    return resolve_mesh(mesh)


def ambient_key():
    amb = _context.current().shapes
    return tuple(sorted(amb.items(), key=repr)) if amb else None


def spec_layout(spec: TensorSpec, text: str, shape: tuple, mesh, shapes, what: str):
    """``(Layout, local_error)`` of a tensor of local shape ``shape`` laid out as ``spec``."""
    names = [a.name for a in spec.axes]
    if len(shape) != len(names):
        raise ValueError(
            f"{what}: {text!r}: the spec names {len(names)} dimensions but the tensor has {len(shape)}"
        )
    if mesh is None:
        n = len(names)
        return Layout(tuple(names), tuple(int(s) for s in shape), ((),) * n, (None,) * n), None
    formula = Formula(text, (spec,), spec)
    res = resolve(formula, [tuple(shape)], mesh, shapes=shapes, ambient=_context.shapes_for(mesh))
    return res.operands[0], res.local_error


def agree_before_communicating(mesh, local_error, x: torch.Tensor) -> None:
    """Raise a rank-local error on every rank (checks on) or here (checks off).

    With checks on the ranks also agree on ``x``'s dtype and device (the exchange would abort on a mismatch).
    """
    if mesh is None:
        if local_error is not None:
            raise ValueError(local_error)
        return
    if local_error is not None or checks.checks_enabled():
        checks.agree(mesh.group(tuple(mesh.names)), None if local_error is None else ValueError(local_error),
                     facts=(("dtype", x.dtype), ("device", x.device)), point="exchange")


def build_plan(cache: dict, key, mesh, build):
    """``cache[key]``, or ``build()`` stored there; with checks on, ranks agree on a build error."""
    plan = cache.get(key)
    if plan is not None:
        return plan
    try:
        plan = build()
    except ValueError as err:
        if mesh is not None and checks.checks_enabled():
            checks.agree(mesh.group(tuple(mesh.names)), err)
        raise
    if len(cache) > 4096:
        cache.clear()
    cache[key] = plan
    return plan


# -- the halo plan ------------------------------------------------------------------------------


class HaloPlan:
    """A halo of one spec, local shape, layout and mesh, bound to this rank: ``plan(x, fill)``.

    One :class:`~einshard.exchange.Exchange` writes the widened block: owned
    and fetched cells at their place, cells outside a constant boundary set
    to ``fill``. Cells read twice (a periodic halo wider than the axis, a
    replicate edge) move once; an ``index_select`` repeats them.
    """

    __slots__ = ("layout", "mesh", "exchange", "indices", "local_error")

    def __init__(self, layout: Layout, widths: dict[int, tuple[int, int]], boundary: str, mesh, device,
                 local_error=None):
        self.layout, self.mesh, self.local_error = layout, mesh, local_error
        axes = [i for i, (l, r) in sorted(widths.items()) if l or r]
        ex_axes, dims = exchange_group(layout, axes, mesh)
        read = functools.lru_cache(None)(lambda i, iv: halo_axis(*iv, *widths[i], layout.sizes[i], boundary))

        def runs(i, owner, dest):
            h = read(i, dest)
            return tuple((s, d + h.left_fill, n) for s, d, n in halo_runs(owner, h.needed))

        shape = MeshShape.of(mesh) if mesh is not None else None
        local = layout.local_shape(mesh.coordinate, shape) if mesh is not None else layout.sizes
        mine = {i: read(i, layout.interval(i, mesh.coordinate, shape) if mesh is not None else (0, local[i]))
                for i in axes}
        sizes = {i: h.left_fill + h.buffer_size + h.right_fill for i, h in mine.items()}
        out = [sizes.get(d, n) for d, n in enumerate(local)]
        blank = [tuple((start, n) if d == i else (0, m) for d, m in enumerate(out))  # constant-boundary cells
                 for i, h in mine.items() for start, n in ((0, h.left_fill), (out[i] - h.right_fill, h.right_fill)) if n]
        self.exchange = None if local_error is not None else runs_exchange(
            layout, layout, dims if ex_axes else (), mesh, runs, axes, sizes, blank)
        self.indices = [(i, torch.tensor(h.index, dtype=torch.long, device=device))
                        for i, h in mine.items() if h.index is not None]

    def __call__(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        agree_before_communicating(self.mesh, self.local_error, x)
        t = self.exchange(x, fill)
        for dim, index in self.indices:
            t = t.index_select(dim, index)
        return t


_PLANS: dict = {}
_FAST: dict = {}  # the raw arguments of einhalo -> plan (skips parsing and validation on repeat calls)


def halo_plan(spec: TensorSpec, text: str, x: torch.Tensor, widths: dict[str, tuple[int, int]], boundary: str,
              mesh, shapes, what: str, families_key=()) -> HaloPlan:
    """The cached :class:`HaloPlan` of ``spec`` for ``x`` (``widths`` keyed by axis name)."""
    key = (text, families_key, spec, tuple(sorted(widths.items())), boundary, tuple(x.shape),
           freeze_shapes(shapes), mesh, ambient_key(),
           x.dtype, x.device)

    def build():
        layout, local_error = spec_layout(spec, text, tuple(x.shape), mesh, shapes, what)
        names = list(layout.axes)
        for name, (left, right) in widths.items():
            i = names.index(name)
            if (left or right) and boundary in ("periodic", "replicate") and layout.sizes[i] == 0:
                raise ValueError(
                    f"{what}: {text!r}: axis {name!r} is empty; a {boundary} halo needs at least one cell"
                )
        return HaloPlan(layout, {names.index(k): v for k, v in widths.items()}, boundary, mesh, x.device,
                        local_error)

    return build_plan(_PLANS, key, mesh, build)


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
    if _vma.ACTIVE and _vma.current() is not None:  # in shard_map(check_vma=True): variance rules
        return _vma.formula_op(lambda s, t, **kw: einhalo(s, t, halos, **kw), spec, (x,), boundary=boundary,
                               fill=fill, mesh=mesh, shapes=shapes, families=families)
    try:
        fast = (spec, freeze(halos), boundary, freeze(families), freeze_shapes(shapes), mesh,
                _context.current().mesh, ambient_key(), x.shape, x.dtype, x.device)
        plan = _FAST.get(fast)
    except TypeError:  # unhashable arguments: take the checked path (it reports them)
        fast, plan = None, None
    if plan is None:
        what = "einhalo"
        check_boundary(boundary, what)
        tspec = parse_spec(spec, families, what)
        names = [a.name for a in tspec.axes]
        raw = per_axis(halos, names, families, what, "halos", spec)
        widths = {k: width_pair(v, k, what, "halos") for k, v in raw.items()}
        m = pick_mesh(tspec, mesh)
        plan = halo_plan(tspec, spec, x, widths, boundary, m, shapes, what, freeze_families(families))
        if fast is not None:
            if len(_FAST) > 4096:
                _FAST.clear()
            _FAST[fast] = plan
    return plan(x, fill)
