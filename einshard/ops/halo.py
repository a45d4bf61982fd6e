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
import operator
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F

from .. import vma as _vma
from .. import _context, checks
from .. import collectives as C
from ..errors import EinshardError
from ..mappings import make_mapping
from ..layout import Layout, MeshShape
from ..mesh import resolve_mesh
from ..notation import Formula, Group, TensorSpec, expand, freeze_families
from ..plan.halo import BOUNDARIES, halo_axis, halo_needed, halo_runs
from ..resolve import freeze_shapes, resolve

__all__ = ["einhalo", "BoxExchange", "HaloPlan", "halo_plan"]


# -- argument handling shared by einhalo / einwindow / einconv / einroll --------------------


def parse_spec(text: str, families, what: str) -> TensorSpec:
    """The one tensor spec of ``text`` (families expanded), validated for the stencil ops."""
    if not isinstance(text, str):
        raise EinshardError(f"{what}: the spec must be a string like 'b h/sp w c', got {type(text).__name__}")
    parsed = expand(text, freeze_families(families))
    if parsed.output is not None or len(parsed.inputs) != 1:
        raise EinshardError(f"{what}: expects one tensor spec like 'b h/sp w c' (no '->', no ','), got {text!r}")
    spec = parsed.inputs[0]
    check_spec(spec, text, what)
    return spec


def check_spec(spec: TensorSpec, text: str, what: str, where: str = "the spec") -> None:
    """No ``...``, factored axes, partial sums or repeated names (ValueErrors naming the axis)."""
    if spec.has_ellipsis:
        raise EinshardError(f"{what}: {text!r}: '...' is not supported in {where}; name every axis")
    for item in spec.items:
        if isinstance(item, Group):
            names = " ".join(a.name for a in item.axes)
            raise EinshardError(
                f"{what}: {text!r}: factored axis '({names})' in {where} (axis {item.axes[0].name!r}) is not "
                f"supported; reshape first and name the axes separately"
            )
    if spec.partial:
        raise EinshardError(f"{what}: {text!r}: {where} is partial ('// ...'); reduce it first (es.einshard)")
    seen = set()
    for a in spec.axes:
        if a.name in seen:
            raise EinshardError(f"{what}: {text!r}: axis {a.name!r} appears twice in {where}")
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
        raise EinshardError(f"{what}: {arg} must be a dict keyed by axis (or family) names, got {mapping!r}")
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
                raise EinshardError(
                    f"{what}: {arg}[{key!r}] names family {key!r} with {len(members)} members "
                    f"{list(members)}; give a tuple of {len(members)} values, got {value!r}"
                )
            targets, values = members, tuple(value)
        else:
            raise EinshardError(
                f"{what}: {text!r}: {arg} names axis {key!r}, which is not in the spec (axes: {list(names)})"
            )
        for t, v in zip(targets, values):
            if t not in names:
                raise EinshardError(
                    f"{what}: {text!r}: {arg} names axis {t!r} (family {key!r}), which is not in the spec "
                    f"(axes: {list(names)})"
                )
            if t in out:
                raise EinshardError(f"{what}: {arg} gives axis {t!r} twice")
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
            raise EinshardError(f"{what}: {arg} of axis {axis!r} must be an int or (left, right) of ints >= 0, got {value!r}")
        return int(value[0]), int(value[1])
    if not _nonneg_int(value):
        raise EinshardError(f"{what}: {arg} of axis {axis!r} must be an int >= 0 or (left, right), got {value!r}")
    return int(value), int(value)


def check_boundary(boundary: str, what: str) -> str:
    if boundary not in BOUNDARIES:
        raise EinshardError(f"{what}: boundary must be one of {list(BOUNDARIES)}, got {boundary!r}")
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
        raise EinshardError(
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
            raise EinshardError(local_error)
        return
    if local_error is not None or checks.checks_enabled():
        checks.agree(mesh.group(tuple(mesh.names)), None if local_error is None else EinshardError(local_error),
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
                raise EinshardError(
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
