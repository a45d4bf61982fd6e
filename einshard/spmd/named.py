"""Named collectives for per-shard code, after JAX's ``jax.lax`` ones.

Every function takes mesh dimensions by name: one dimension (``"dp"``), a
compound name (``"dp-tp"``) or a tuple of names (``("dp", "tp")``). Several
dimensions act as one group whose ranks are ordered by the mesh's own
dimension order (as in the notation: ``a/dp-tp``), whatever order the names
are given in. The mesh is the ambient one (``shard_map`` or ``es.use_mesh``)
unless ``mesh=`` is passed. Indices (``axis_index``, ``ppermute``'s pairs, the
blocks of ``all_gather``, ``psum_scatter`` and ``all_to_all``) follow mesh
coordinates, whatever order the process group numbers its ranks in.

All are autograd-correct. With variance tracking on
(``shard_map(check_vma=True)``) they also follow JAX's typing: an input
that is invariant over a dimension the collective works on is ``pvary``-ed
first (so ``psum`` of an invariant value is ``size * x`` and its gradient is
``size * ct``), and the output's vma is set by the collective's variance rule
in :mod:`einshard.comm.primitives` (invariant over the dimensions of ``psum``,
``pmean``, ``pmax``, ``pmin`` and ``all_gather``; varying over those of
``psum_scatter``, ``all_to_all``, ``ppermute`` and ``pvary``). The shard_map
guide tabulates each one's forward and backward.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import optree
import torch

from ..comm import checks as _checks
from ..comm import collectives as C
from ..comm.entries import COLLECTIVES
from ..comm.grad_sums import leaf_sum
from ..comm.mesh import SubMesh, resolve_mesh
from ..comm.primitives import PRIMITIVES
from ..core import _context, _trace
from ..core._cache import BoundedCache
from ..core._torch_compat import in_traced_code
from ..errors import EinshardError
from ..runtime import vma as _vma

__all__ = ["psum", "pmean", "pmax", "pmin", "pvary", "axis_index", "axis_size"]  # and the entries' named forms

_Tensor = torch.Tensor


class _Axes:
    """Resolved mesh dimensions of one call."""

    __slots__ = ("mesh", "dims", "tracker", "mask", "_group", "_order")

    def __init__(self, names, mesh, what):
        tracker = _vma.current()
        if in_traced_code():  # resolved at trace time: dynamo would trace the mesh's caches and guard on them
            m, dims, self._group, self._order = _trace.lookup(
                _resolved_at_trace_time(mesh, _context.current().mesh, names, what))
        else:
            m = resolve_mesh(mesh)  # None: the ambient mesh (the body's, or a nested es.use_mesh's)
            dims = _atomic(m, names, what)
            self._group = self._order = None
        if tracker is not None and not _vma.same_mesh(tracker.info, m):
            tracker = None  # another mesh: not tracked
        self.mesh = m
        self.dims = dims
        self.tracker = tracker
        self.mask = tracker.info.mask(dims) if tracker is not None else 0

    @property
    def group(self):
        if self._group is not None:
            return self._group
        if self.tracker is not None:
            return self.tracker.info.group(self.mask)
        return self.mesh.group(self.dims)

    @property
    def size(self) -> int:
        return self.mesh.size(self.dims)

    @property
    def order(self):
        """The group rank holding each block (``None``: block ``k`` on group rank ``k``)."""
        if self._group is not None:  # (traced code: resolved at trace time)
            return self._order
        return self.mesh.order(self.dims)


_RESOLVED = BoundedCache(4096, name="einshard.spmd.named.resolved")


@_trace.constant_result
def _resolved_at_trace_time(mesh, ambient, names, what) -> str:
    """``(mesh, atomic dimensions, their group, its block order)`` of a call in traced code (registered once per
    mesh and names)."""
    with _context.at_trace_time(ambient, {}):
        m = resolve_mesh(mesh)
    key = (m, names if isinstance(names, str) else tuple(names))
    found = _RESOLVED.get(key)
    if found is None or found[0] is not m:
        dims = _atomic(m, names, what)
        grouped = m.device_mesh is not None
        found = _RESOLVED.put(key, (m, dims, m.group(dims) if grouped else None, m.order(dims) if grouped else None))
    return _trace.register(found)


def _agreeing(fn):
    """With checks on, a ``ValueError`` raised by ``fn`` on some ranks only (a tensor's dtype,
    rank or shape) is agreed on: every rank of the group raises it (the others at the agreement
    of their collective)."""

    @functools.wraps(fn)
    def wrapper(x, dims, *args, mesh=None, **kwargs):
        try:
            return fn(x, dims, *args, mesh=mesh, **kwargs)
        except ValueError as err:
            if not _checks.ENABLED or _checks.was_agreed(err):
                raise
            try:
                group = _Axes(dims, mesh, fn.__name__).group
            except ValueError:  # the dimensions themselves are wrong: every rank sees that
                raise err from None
            _checks.agree(group, err, point=fn.__name__)
            raise

    return wrapper


def _atomic(mesh, names, what) -> tuple[str, ...]:
    if isinstance(names, str):
        parts = [names]
    else:
        try:
            parts = list(names)
        except TypeError:
            raise EinshardError(f"{what}: mesh dimensions must be a name or a tuple of names, got {names!r}") from None
        if not parts or not all(isinstance(p, str) for p in parts):
            raise EinshardError(f"{what}: mesh dimensions must be a name or a tuple of names, got {names!r}")
    atoms: list[str] = []
    for p in parts:
        # each component is checked by the mesh; compound groups are library-internal here, so an
        # unwrapped mesh accepts them too. A sub-mesh (mesh["dp-sp"]) resolves the whole name: its
        # dimensions may themselves be compound.
        dims = mesh.dims(p) if isinstance(mesh, SubMesh) else (d for c in p.split("-") for d in mesh.dims(c))
        for d in dims:
            if d in atoms:
                raise EinshardError(f"{what}: mesh dimension {d!r} is named twice in {names!r}")
            atoms.append(d)
    return tuple(sorted(atoms, key=mesh.names.index))


def _check_tensor(x, what):
    if not isinstance(x, _Tensor):
        raise EinshardError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")


def _widen(ax: _Axes, x: _Tensor) -> tuple[_Tensor, int]:
    """``x`` pvary-ed over the collective's dimensions it does not vary over; its new mask."""
    tr = ax.tracker
    assert tr is not None  # called when tracking
    m = tr.mask_of(x)
    missing = ax.mask & ~m
    if missing:
        with _vma.suspended(tr):  # x.requires_grad would go through the mode otherwise
            if x.requires_grad and torch.is_grad_enabled():
                x = tr.pvary(x, m, missing)
    return x, m


def _run(ax: _Axes, kind: str, fn, x, *args):
    """``fn(x, *args)``; tracked, ``x`` is pvary-ed first where it must be and the output varies as
    primitive ``kind``'s rule says."""
    if ax.tracker is None:
        return fn(x, *args)
    x, m = _widen(ax, x)
    vary = PRIMITIVES[kind].vary
    assert vary is not None, kind  # every named collective's primitive has a variance rule
    return _vma.library_call(ax.tracker, fn, (x, *args), {}, vary(m, ax.mask))


def _reduce(x, ax: _Axes, what: str, number, fn, *args, numbers=(int, float, complex)):
    """An all-reduce of every tensor of the pytree ``x``; a Python number ``t`` gives ``number(t)``."""

    def one(t):
        if isinstance(t, numbers) and not isinstance(t, bool):
            return number(t)
        _check_tensor(t, what)
        if ax.tracker is None:  # the hot path: no frame more than the call itself
            return fn(t, ax.group, *args)
        return _run(ax, "all_reduce", fn, t, ax.group, *args)

    return _map(one, x)


def _map(fn, tree):
    if isinstance(tree, _Tensor):
        return fn(tree)
    return optree.tree_map(fn, tree, none_is_leaf=False)


# -- reductions ----------------------------------------------------------------------------


@_agreeing
def psum(x, dims, *, mesh=None):
    """Sum over the ranks of ``dims``; the result is invariant over them (JAX's ``psum``).

    ``x`` is a tensor or a pytree of tensors; a Python number gives
    ``x * size`` (``psum(1, "dp")`` is the size of ``dp``). Backward: the
    identity (the cotangent of an invariant value is the same on every rank).

    >>> total = es.spmd.psum(local_loss, "dp")            # doctest: +SKIP
    >>> grads = es.spmd.psum(grads, ("dp", "sp"))         # a dict of tensors  # doctest: +SKIP
    """
    ax = _Axes(dims, mesh, "psum")
    return _reduce(x, ax, "psum", lambda t: t * ax.size, _vma.psum_tensor)


@_agreeing
def pmean(x, dims, *, mesh=None):
    """Mean over the ranks of ``dims`` (``psum(x, dims) / size``); invariant over them.

    >>> loss = es.spmd.pmean(local_loss, "dp")  # doctest: +SKIP
    """
    ax = _Axes(dims, mesh, "pmean")
    return _reduce(x, ax, "pmean", lambda t: t, _mean, ax.size)


def _mean(t, group, n):
    return _vma.psum_tensor(t, group) / n


class _PExtreme(torch.autograd.Function):
    """All-reduce max/min; the gradient goes to the ranks holding the extreme, split among ties."""

    @staticmethod
    def forward(x, group, op):
        return C.all_reduce(x, group, op=op)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ctx.group, _ = inputs
        ctx.save_for_backward(x == output)  # local; the tie count is summed in backward (every rank runs it)

    @staticmethod
    def backward(ctx, grad):
        (hit,) = ctx.saved_tensors
        hit = hit.to(grad.dtype)
        count = C.all_reduce(hit, ctx.group).clamp_min(1)
        # the cotangent of the invariant result becomes per-rank: pvary it (identity here), so that
        # double backward sums over the ranks
        return _vma.pvary_tensor(grad, ctx.group) * (hit / count), None, None


@_agreeing
def _extreme(x, dims, name, op, mesh=None):
    return _reduce(x, _Axes(dims, mesh, name), name, lambda t: t, _PExtreme.apply, op, numbers=(int, float))


def pmax(x, dims, *, mesh=None):
    """Element-wise maximum over the ranks of ``dims``; invariant over them.

    Backward: the gradient goes to the ranks whose value is the maximum,
    split evenly among ties (like ``torch.amax``).

    >>> m = es.spmd.pmax(x.abs().amax(), "tp")  # doctest: +SKIP
    """
    return _extreme(x, dims, "pmax", "max", mesh=mesh)


def pmin(x, dims, *, mesh=None):
    """Element-wise minimum over the ranks of ``dims``; invariant over them.

    Backward: the gradient goes to the ranks whose value is the minimum,
    split evenly among ties (like ``torch.amin``).

    >>> m = es.spmd.pmin(x.amin(), ("dp", "tp"))  # doctest: +SKIP
    """
    return _extreme(x, dims, "pmin", "min", mesh=mesh)


# -- the named forms of the collective entries (all_gather, psum_scatter, all_to_all, ppermute, ...) ----------


def _named_form(entry):
    """The named form of collective ``entry``: ``(x, dim_name, *args, mesh=None, **options)``, the entry's
    ``bind(x, axes, *args, **options)`` on the resolved dimensions, tracked by its variance rule."""
    bind, what, kind = entry.bind, entry.named, entry.name

    def named(x, dim_name, *args, mesh=None, **options):
        _check_tensor(x, what)
        ax = _Axes(dim_name, mesh, what)
        fn, fargs = bind(x, ax, *args, **options)
        return _run(ax, kind, fn, *fargs)

    named.__name__ = named.__qualname__ = what
    named.__doc__ = bind.__doc__
    params = list(inspect.signature(bind).parameters.values())
    dim_name = inspect.Parameter("dim_name", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    mesh = inspect.Parameter("mesh", inspect.Parameter.KEYWORD_ONLY, default=None)
    named.__signature__ = inspect.Signature([params[0], dim_name, *params[2:], mesh])  # type: ignore[attr-defined]
    return _agreeing(named)


_NAMED = {entry.named: _named_form(entry) for entry in COLLECTIVES.values() if entry.named}
globals().update(_NAMED)


def __getattr__(name: str) -> Any:
    """(Only for type checkers: the forms above are made from the entries, so a checker cannot list them;
    a name that is not one of them is missing, as for any module.)"""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def pvary(x, dims, *, mesh=None):
    """Mark ``x`` as varying over ``dims``: identity forward, gradient summed over ``dims`` backward.

    JAX's ``pvary``. Use it where an invariant value feeds per-rank
    computation in plain torch code with ``check_vma=False`` (with
    ``check_vma=True`` shard_map inserts it). When variance is tracked,
    dimensions ``x`` already varies over are left alone. ``x`` may be a
    pytree of tensors.

    >>> w = es.spmd.pvary(w, "dp")   # w replicated over dp, multiplied with per-rank data  # doctest: +SKIP
    """
    ax = _Axes(dims, mesh, "pvary")

    def one(t):
        _check_tensor(t, "pvary")
        if ax.tracker is None:
            if t.is_leaf and t.requires_grad and torch.is_grad_enabled() and not in_traced_code():  # (a parameter:
                # its sum may wait for the end of backward; traced code sums with a functional all-reduce)
                return leaf_sum(t, ax.group)
            return _vma.pvary_tensor(t, ax.group)
        tr = ax.tracker
        m = tr.mask_of(t)
        missing = ax.mask & ~m
        if not missing:
            return t
        return tr.pvary(t, m, missing)

    return _map(one, x)


# -- indices ---------------------------------------------------------------------------------------


def axis_index(dim_name, *, mesh=None) -> torch.Tensor:
    """This rank's index along ``dim_name`` as a 0-d int64 tensor that varies over it, on the mesh's device.

    For several dimensions: the index in their group, mesh order (``a/dp-tp``
    block order).

    >>> i = es.spmd.axis_index("tp")   # tensor(2) on tp-rank 2  # doctest: +SKIP
    """
    ax = _Axes(dim_name, mesh, "axis_index")
    value = ax.mesh.index(ax.dims)
    device = ax.mesh.device_type  # the mesh's device ("cuda": the current one)
    # filled on the device (torch.tensor would copy a host value there: a synchronising copy on CUDA)
    if ax.tracker is None:
        return torch.full((), value, dtype=torch.int64, device=device)
    with _vma.suspended(ax.tracker):
        t = torch.full((), value, dtype=torch.int64, device=device)
    ax.tracker.tag(t, ax.mask)
    return t


def axis_size(dim_name, *, mesh=None) -> int:
    """The number of ranks along ``dim_name`` (a product for several dimensions).

    >>> es.spmd.axis_size(("dp", "tp"))   # 8 on a 2x4 mesh  # doctest: +SKIP
    """
    ax = _Axes(dim_name, mesh, "axis_size")
    return ax.size

__all__ += list(_NAMED)  # all_gather, psum_scatter, all_to_all, ppermute
