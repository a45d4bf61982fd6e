"""Raw collectives on process groups (the plain collectives of ``es.helpers``).

These are *not* differentiable (their inputs are detached); the autograd
versions are in :mod:`einshard.comm.mappings`. Every function

- accepts ``group=None`` for the default (world) group;
- returns a new contiguous tensor (except :func:`split`, which returns a
  view like ``torch.narrow``);
- supports uneven split shapes, including empty blocks, on gloo and NCCL:
  ``all_gather`` and ``reduce_scatter`` pad every block to the largest one
  and use the native collective; ``all_to_all`` uses ``all_to_all_single``
  with split sizes;
- raises ``ValueError`` before communicating: errors every rank can see
  from the shared arguments (a ``shapes`` list of the wrong length,
  negative sizes, a bad ``src`` or ``perm``) on every rank; rank-local
  errors (this rank's size disagrees with ``shapes``) through
  :func:`einshard.comm.checks.agree`, so with checks on every rank raises the
  same error;
- records its calls and bytes in :mod:`einshard.comm.comm_stats`, as its
  :mod:`einshard.comm.primitives` entry prices them (the planner's numbers).

Blocks are in group-rank order: block ``j`` is group rank ``j``'s. The block
collectives (:func:`split`, :func:`all_gather`, :func:`reduce_scatter`,
:func:`all_to_all`) also take ``order``, the group rank holding each block
(``order[k]``: block ``k``'s), for meshes whose block order (mesh
coordinates) is not the group's rank order (``es.Mesh.order``); ``shapes``
are then in block order too.

Groups of one rank communicate nothing. In code that ``torch.compile``
traces, each function checks (and agrees) as here, then communicates with
its functional twin in :mod:`einshard.comm._traced_collectives`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core import _trace
from ..core._split import compute_split_shapes
from ..errors import EinshardError
from . import _traced_collectives as _TC
from . import checks as _checks
from . import comm_stats as _stats
from .primitives import PRIMITIVES

__all__ = [
    "group_size",
    "group_rank",
    "all_reduce",
    "all_reduce_owned",
    "broadcast",
    "split",
    "all_gather",
    "reduce_scatter",
    "reduce_scatter_rows",
    "all_gather_start",
    "PendingGather",
    "all_to_all",
    "all_to_all_v",
    "isend_irecv",
    "ppermute",
]

# torch 2.13 renamed the tensor collectives; older versions only have the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# -- small helpers -------------------------------------------------------------


def group_size(group=None) -> int:
    """The number of ranks in ``group`` (``None``: the world).

    A ``ProcessGroup`` is asked directly (the hot path skips ``dist``'s Python checks).

    >>> group_size(mesh.get_group("tp"))  # doctest: +SKIP
    4
    """
    if type(group) is dist.ProcessGroup:
        return group.size()
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    """This rank's index in ``group`` (``None``: the world).

    >>> group_rank(mesh.get_group("tp"))  # doctest: +SKIP
    2
    """
    if type(group) is dist.ProcessGroup:
        return group.rank()
    return dist.get_rank(group)


_size, _rank = group_size, group_rank


def _global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def _agree(group, err, point: str = "", x: torch.Tensor | None = None, shape=None, extra=(), **kw) -> None:
    """Raise ``err``; with checks on, agree first on it and on ``x``'s shape (or ``shape``), dtype and device.

    Call it when ``err is not None or _checks.agreement_needed()`` only, so that nothing is built with
    checks off.
    """
    facts: tuple = ()
    if x is not None:
        facts = (("shape", tuple(x.shape) if shape is None else shape), ("dtype", x.dtype), ("device", x.device))
    _checks.agree(group, err, facts=facts + tuple(extra), point=point, **kw)


def _masked(shape, dim):
    """``shape`` with ``dim`` (a size that may differ across ranks) left out of the comparison."""
    if dim is None:
        return tuple(shape)
    return tuple(shape[:dim]) + ("*",) + tuple(shape[dim + 1 :])


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat real view of a contiguous tensor (complex as pairs of reals)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(-1)


def _real_factor(t: torch.Tensor) -> int:
    return 2 if t.is_complex() else 1


def _sizes(shapes, what: str, size: int) -> list[int]:
    """Validate a split-shapes list shared by every rank (raises on every rank)."""
    if isinstance(shapes, (str, bytes)) or not isinstance(shapes, Sequence):
        try:
            shapes = list(shapes)
        except TypeError:
            raise EinshardError(f"{what} must be a list of per-rank sizes, got {shapes!r}") from None
    out = []
    for s in shapes:
        if isinstance(s, bool) or (not isinstance(s, (int, torch.SymInt)) and int(s) != s):
            raise EinshardError(f"{what} must hold integers, got {list(shapes)!r}")
        out.append(int(s))
    if len(out) != size:
        raise EinshardError(f"{what} {out} has {len(out)} entries but the group has {size} ranks")
    if any(s < 0 for s in out):
        raise EinshardError(f"{what} {out} holds a negative size")
    return out


def _dim(dim, ndim: int, fn: str, what: str = "dim"):
    """(normalised dim, error or None)."""
    try:
        d = int(dim)
    except (TypeError, ValueError):
        return 0, EinshardError(f"{fn}: {what} must be an int, got {dim!r}")
    if not -max(ndim, 1) <= d < max(ndim, 1) or ndim == 0:
        return 0, EinshardError(f"{fn}: {what}={dim} is out of range for a tensor with {ndim} dimensions")
    return d % ndim, None


def _along(x, group, dim, shapes, fn: str):
    """``(size, shapes, dim, error)`` along ``dim``: the group's size, ``shapes`` checked, ``dim`` normalised."""
    size = _size(group)
    return (size, None if shapes is None else _sizes(shapes, f"{fn}: shapes", size), *_dim(dim, x.dim(), fn))


def _order(order, size: int, fn: str) -> tuple[int, ...]:
    """``order`` as a tuple, checked to be a permutation of the group's ranks."""
    try:
        order = tuple(int(j) for j in order)
    except (TypeError, ValueError):
        raise EinshardError(f"{fn}: order must be a sequence of group ranks, got {order!r}") from None
    if sorted(order) != list(range(size)):
        raise EinshardError(f"{fn}: order {list(order)} is not a permutation of the group's {size} ranks")
    return order


def _holder(rank: int, me: int) -> str:
    return f"group rank {rank}" if rank == me else f"group rank {rank}, block {me}"


def _whole_split(shapes, length: int, size: int, what: str, dim_text: str):
    """``(shapes, error)`` for splitting a whole axis of ``length``: the default split, or a check of ``shapes``."""
    if shapes is None:
        return compute_split_shapes(length, size), None
    if sum(shapes) != length:
        return shapes, EinshardError(
            f"{what} {shapes} sum to {sum(shapes)} but the tensor has size {length} along {dim_text}"
        )
    return shapes, None


def _offsets(shapes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in shapes:
        out.append(acc)
        acc += s
    return out


def _record(kind: str, group, size: int, n: int, root=None) -> None:
    """Account one call: its primitive's traffic over ``size`` ranks, ``n`` the bytes of its defining buffer."""
    traffic = PRIMITIVES[kind].traffic
    assert traffic is not None, kind  # a collective's primitive has a traffic
    _stats.record(kind, group, *traffic(size, n, root))


def _contiguous_clone(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


class _CompletedWork:
    """The ``Work`` of an asynchronous collective on a one-rank group."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


# -- all_reduce / broadcast ------------------------------------------------------

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": None, "mean": None}


def all_reduce(x: torch.Tensor, group=None, *, op: str = "sum", async_op: bool = False):
    """The element-wise reduction of ``x`` over the ranks of ``group``, as a new tensor.

    ``op`` is ``"sum"``, ``"max"``, ``"min"`` or ``"avg"`` (alias ``"mean"``;
    floating or complex dtypes, computed as the sum of ``x / P``). With
    ``async_op=True`` returns ``(tensor, work)``; call ``work.wait()`` before
    reading the tensor.

    >>> y = all_reduce(torch.ones(3), group)  # doctest: +SKIP
    >>> y  # on 4 ranks  # doctest: +SKIP
    tensor([4., 4., 4.])
    """
    if op == "sum" and not (async_op or _checks.ENABLED or _stats.is_active() or _trace.traced()):
        return _sum_copy(x, group)  # the steady state: nothing to check, count or trace
    name = op.lower() if isinstance(op, str) else op
    if name not in _REDUCE_OPS:
        raise EinshardError(f"all_reduce: op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    err = None  # depends on the dtype, which may differ on one rank: agreed
    if x.is_complex() and name in ("max", "min"):
        err = EinshardError(f"all_reduce: op={op!r} is not defined for complex tensors")
    elif name in ("avg", "mean") and not (x.is_floating_point() or x.is_complex()):
        err = EinshardError(f"all_reduce: op={op!r} needs a floating or complex tensor, got {x.dtype}")
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "all_reduce", x, extra=(("op", name),))
    size = _size(group)
    x = x.detach()
    if _trace.traced():
        mean = name in ("avg", "mean")
        y = _TC.all_reduce(x / size if mean else x, group, "sum" if mean else name)
        return (y, _CompletedWork()) if async_op else y
    if name in ("avg", "mean"):
        y = (x / size).contiguous() if size > 1 else _contiguous_clone(x)
        reduce_op = dist.ReduceOp.SUM
    else:
        y = _contiguous_clone(x)
        op_name = _REDUCE_OPS[name]
        assert op_name is not None  # avg and mean are handled above
        reduce_op = getattr(dist.ReduceOp, op_name)
    return _reduce_in_place(y, group, size, reduce_op, async_op)


def _sum_copy(x: torch.Tensor, group) -> torch.Tensor:
    """``all_reduce(x, group)`` with checks off, uncounted and untraced: a contiguous copy summed in place."""
    y = x.detach().clone(memory_format=torch.contiguous_format)
    if _size(group) > 1:
        dist.all_reduce(torch.view_as_real(y) if y.is_complex() else y, group=group)
    return y


def all_reduce_owned(x: torch.Tensor, group=None) -> torch.Tensor:
    """The sum of ``x`` over the ranks of ``group``, written into ``x`` itself where it is contiguous.

    For a tensor the caller owns, which nothing else reads (a fresh matmul
    result), as hand-written tensor-parallel code reduces: no copy. A
    non-contiguous ``x`` is summed in a contiguous copy.

    >>> y = all_reduce_owned(torch.ones(3), group)  # doctest: +SKIP
    >>> y  # on 4 ranks  # doctest: +SKIP
    tensor([4., 4., 4.])
    """
    if _checks.agreement_needed():
        _agree(group, None, "all_reduce", x, extra=(("op", "sum"),))
    return _reduce_in_place(x.detach().contiguous(), group, _size(group), dist.ReduceOp.SUM, False)


def _reduce_in_place(y: torch.Tensor, group, size: int, reduce_op, async_op: bool):
    if size == 1:
        return (y, _CompletedWork()) if async_op else y
    if _stats.is_active():
        _record("all_reduce", group, size, y.numel() * y.element_size())
    work = dist.all_reduce(_flat(y), op=reduce_op, group=group, async_op=async_op)
    return (y, work) if async_op else y


def broadcast(x: torch.Tensor, group=None, src: int = 0) -> torch.Tensor:
    """Rank ``src``'s ``x`` on every rank of ``group``, as a new tensor.

    ``src`` is the rank *within the group*. The other ranks' ``x`` only give
    the shape and dtype (they must match ``src``'s).

    >>> y = broadcast(torch.full((2,), float(rank)), group, src=1)  # doctest: +SKIP
    >>> y  # on every rank  # doctest: +SKIP
    tensor([1., 1.])
    """
    size = _size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise EinshardError(f"broadcast: src={src!r} is not a rank of the group (size {size})")
    if _checks.agreement_needed():
        _agree(group, None, "broadcast", x, extra=(("src", src),))
    x = x.detach()
    if _trace.traced():
        return _TC.broadcast(x, group, src)
    if size == 1:
        return _contiguous_clone(x)
    rank = _rank(group)
    y = _contiguous_clone(x) if rank == src else torch.empty_like(x, memory_format=torch.contiguous_format)
    if _stats.is_active():
        _record("broadcast", group, size, y.numel() * y.element_size(), rank == src)
    dist.broadcast(_flat(y), src=_global_rank(group, src), group=group)
    return y


# -- split / all_gather / reduce_scatter -----------------------------------------


def split(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None) -> torch.Tensor:
    """This rank's block of ``x`` along ``dim`` (a view; no communication).

    ``shapes`` are the per-rank block sizes (default
    ``compute_split_shapes(x.shape[dim], P)``); they must sum to ``x.shape[dim]``.
    ``order``: the group rank holding each block (default: block ``j`` on group rank ``j``).

    >>> split(torch.arange(10), group, 0)  # rank 3 of 4 → shapes [3, 3, 3, 1]  # doctest: +SKIP
    tensor([9])
    """
    size, shapes, d, err = _along(x, group, dim, shapes, "split")
    if order is not None:
        order = _order(order, size, "split")
    if err is None:
        shapes, err = _whole_split(shapes, x.shape[d], size, "split: shapes", f"dim {dim}")
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "split")
    rank = _rank(group) if size > 1 else 0
    me = rank if order is None else order.index(rank)
    return x.detach().narrow(d, sum(shapes[:me]), shapes[me])


def all_gather(x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group-rank order (block order with ``order``).

    ``shapes`` are the per-rank sizes along ``dim`` (default: even, every
    rank holds ``x.shape[dim]``). Uneven blocks are padded to the largest.
    ``order``: the group rank holding each block (default: block ``j`` on group rank ``j``).

    >>> all_gather(torch.full((1, 2), float(rank)), group, 0)  # 2 ranks  # doctest: +SKIP
    tensor([[0., 0.],
            [1., 1.]])
    >>> all_gather(x, group, dim=1, shapes=[3, 3, 3, 0])  # doctest: +SKIP
    """
    size, shapes, d, err = _along(x, group, dim, shapes, "all_gather")
    if order is not None:
        order = _order(order, size, "all_gather")
    rank = _rank(group) if size > 1 else 0
    me = rank if order is None else order.index(rank)
    if err is None and shapes is not None and x.shape[d] != shapes[me]:
        err = EinshardError(
            f"all_gather: this rank ({_holder(rank, me)}) holds {x.shape[d]} elements along dim {dim} "
            f"but shapes[{me}] = {shapes[me]} (shapes {shapes})"
        )
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "all_gather", x, _masked(x.shape, d if shapes is not None and err is None else None),
               (("dim", d), ("shapes", shapes)))
    x = x.detach()
    if _trace.traced():
        return _TC.all_gather(x, group, d, [x.shape[d]] * size if shapes is None else shapes, order)
    if size == 1:
        return _contiguous_clone(x)
    local = x.shape[d]
    if shapes is None:
        shapes = [local] * size
    m = max(shapes)
    even = all(s == m for s in shapes)
    if local == m:
        block = x.contiguous()
    else:
        block = x.new_zeros(x.shape[:d] + (m,) + x.shape[d + 1 :])
        block.narrow(d, 0, local).copy_(x)
    out = block.new_empty((size,) + block.shape)
    if block.numel() > 0:
        if _stats.is_active():
            _record("all_gather", group, size, block.numel() * block.element_size())
        _all_gather_tensor(_flat(out), _flat(block), group=group)
    if even:
        if order is not None:
            out = out[list(order)]  # block k came from group rank order[k]
        return out.movedim(0, d).reshape(x.shape[:d] + (size * m,) + x.shape[d + 1 :])
    holders = range(size) if order is None else order
    return torch.cat([out[j].narrow(d, 0, s) for j, s in zip(holders, shapes)], dim=d)


def reduce_scatter(
    x: torch.Tensor, group, dim: int, shapes: Sequence[int] | None = None, order=None
) -> torch.Tensor:
    """This rank's block along ``dim`` of the sum over ranks of ``x``.

    Every rank passes the whole (same-shaped) ``x``; ``shapes`` (default
    ``compute_split_shapes(x.shape[dim], P)``) must sum to ``x.shape[dim]``.
    Uneven blocks are padded to the largest. ``order``: the group rank
    holding each block (default: block ``j`` on group rank ``j``).

    >>> reduce_scatter(torch.ones(4), group, 0)  # 2 ranks  # doctest: +SKIP
    tensor([2., 2.])
    """
    size, shapes, d, err = _along(x, group, dim, shapes, "reduce_scatter")
    if order is not None:
        order = _order(order, size, "reduce_scatter")
    if err is None:
        shapes, err = _whole_split(shapes, x.shape[d], size, "reduce_scatter: shapes", f"dim {dim}")
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "reduce_scatter", x, extra=(("dim", d), ("shapes", shapes)))
    x = x.detach()
    if _trace.traced():
        return _TC.reduce_scatter(x, group, d, shapes, order)
    if size == 1:
        return _contiguous_clone(x)
    rank = _rank(group)
    mine = shapes[rank if order is None else order.index(rank)]
    m = max(shapes)
    if all(s == m for s in shapes):
        buf = x.unflatten(d, (size, m)).movedim(d, 0)
        # slot j goes to group rank j: the block it holds
        buf = buf.contiguous() if order is None else buf[[order.index(j) for j in range(size)]]
    else:
        buf = x.new_zeros((size,) + x.shape[:d] + (m,) + x.shape[d + 1 :])
        holders = range(size) if order is None else order
        for j, off, s in zip(holders, _offsets(shapes), shapes):
            if s:
                buf[j].narrow(d, 0, s).copy_(x.narrow(d, off, s))
    out = buf.new_empty(buf.shape[1:])
    if out.numel() == 0:
        return out.narrow(d, 0, mine).contiguous()
    if _stats.is_active():
        _record("reduce_scatter", group, size, out.numel() * out.element_size())
    _reduce_scatter_tensor(_flat(out), _flat(buf), op=dist.ReduceOp.SUM, group=group)
    if mine == m:
        return out
    return out.narrow(d, 0, mine).contiguous()


class PendingGather:
    """An all-gather in flight (:func:`all_gather_start`); :meth:`wait` returns the concatenated tensor."""

    __slots__ = ("out", "work", "dim", "shapes", "holders", "_done")

    def __init__(self, out, work, dim, shapes, holders=None):
        self.out, self.work, self.dim, self.shapes, self._done = out, work, dim, shapes, None
        self.holders = range(len(shapes)) if holders is None else holders  # the group rank of each block

    @property
    def in_flight(self) -> bool:
        """Started and not waited for yet."""
        return self._done is None

    def wait(self) -> torch.Tensor:
        if self._done is None:
            self.work.wait()
            d, out = self.dim, self.out
            self._done = torch.cat([out[j].narrow(d, 0, s) for j, s in zip(self.holders, self.shapes)], dim=d)
            self.out = self.work = None
        return self._done


def all_gather_start(x: torch.Tensor, group, dim: int, shapes: Sequence[int], order=None) -> PendingGather:
    """Start :func:`all_gather` (``shapes``: every block's size along ``dim``; uneven ones padded) without
    waiting for it: the prefetched gathers of :mod:`einshard.params.zero`. ``order``: the group rank holding
    each block (default: block ``j`` on group rank ``j``), as for :func:`all_gather`.

    >>> pending = all_gather_start(x, group, 0, [2, 2])  # doctest: +SKIP
    >>> pending.wait().shape  # doctest: +SKIP
    torch.Size([4])
    """
    size = _size(group)
    d, err = _dim(dim, x.dim(), "all_gather_start")
    if err is not None:
        raise err
    shapes = list(shapes)
    if order is not None:
        order = _order(order, size, "all_gather_start")
    me = 0 if size == 1 else _rank(group) if order is None else order.index(_rank(group))
    if len(shapes) != size or x.shape[d] != shapes[me]:
        raise EinshardError(f"all_gather_start: shapes {shapes} do not fit this rank's {tuple(x.shape)} along {dim}")
    x = x.detach()
    m = max(shapes)
    block = x.new_zeros(x.shape[:d] + (m,) + x.shape[d + 1 :])
    block.narrow(d, 0, x.shape[d]).copy_(x)
    out = block.new_empty((size,) + block.shape)
    if size == 1 or block.numel() == 0:
        out.copy_(block.expand_as(out))
        return PendingGather(out, _CompletedWork(), d, shapes, order)
    if _stats.is_active():
        _record("all_gather", group, size, block.numel() * block.element_size())
    work = _all_gather_tensor(_flat(out), _flat(block), group=group, async_op=True)
    return PendingGather(out, work, d, shapes, order)


def reduce_scatter_rows(rows: torch.Tensor, group, *, async_op: bool = False):
    """Row ``j`` of the sum over ranks of ``rows`` (shape ``(P, M)``) on group rank ``j``: a flat
    reduce-scatter (the buckets of :mod:`einshard.comm.grad_sums`). With ``async_op=True``: ``(row, work)``.

    >>> reduce_scatter_rows(torch.ones(2, 3), group)  # 2 ranks  # doctest: +SKIP
    tensor([2., 2., 2.])
    """
    size = _size(group)
    if rows.dim() != 2 or rows.shape[0] != size:
        raise EinshardError(f"reduce_scatter_rows: rows must have shape ({size}, M), got {tuple(rows.shape)}")
    rows = rows.detach().contiguous()
    if size == 1:
        out = rows[0].clone()
        return (out, _CompletedWork()) if async_op else out
    out = rows.new_empty(rows.shape[1:])
    if _stats.is_active():
        _record("reduce_scatter", group, size, out.numel() * out.element_size())
    work = _reduce_scatter_tensor(out, rows.reshape(-1), op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    return (out, work) if async_op else out


# -- all_to_all ------------------------------------------------------------------


def all_to_all(
    x: torch.Tensor,
    group,
    src_dim: int,
    dst_dim: int,
    src_shapes: Sequence[int] | None = None,
    dst_shapes: Sequence[int] | None = None,
    order=None,
) -> torch.Tensor:
    """Repartition: sharded along ``src_dim`` and whole along ``dst_dim`` → the reverse.

    This rank holds ``src_shapes[rank]`` along ``src_dim`` (default: even)
    and the whole ``dst_dim``; it gets the whole ``src_dim`` and
    ``dst_shapes[rank]`` along ``dst_dim`` (default
    ``compute_split_shapes(x.shape[dst_dim], P)``). One ``all_to_all_single``
    with split sizes, so uneven and empty blocks cost no padding. ``order``:
    the group rank holding each block of both dims (default: block ``j`` on
    group rank ``j``); the shapes are then indexed by block.

    >>> x = torch.randn(2, 8)              # rows 2r, 2r+1 of a (8, 8) matrix, 4 ranks  # doctest: +SKIP
    >>> all_to_all(x, group, 0, 1).shape   # every row, columns 2r, 2r+1  # doctest: +SKIP
    torch.Size([8, 2])
    """
    size = _size(group)
    if src_shapes is not None:
        src_shapes = _sizes(src_shapes, "all_to_all: src_shapes", size)
    if dst_shapes is not None:
        dst_shapes = _sizes(dst_shapes, "all_to_all: dst_shapes", size)
    if order is not None:
        order = _order(order, size, "all_to_all")
    rank = _rank(group) if size > 1 else 0
    me = rank if order is None else order.index(rank)
    sd, err = _dim(src_dim, x.dim(), "all_to_all", "src_dim")
    dd, err2 = _dim(dst_dim, x.dim(), "all_to_all", "dst_dim")
    err = err or err2
    if err is None and sd == dd:
        err = EinshardError(f"all_to_all: src_dim ({src_dim}) and dst_dim ({dst_dim}) must differ")
    if err is None:
        if src_shapes is None:
            src_shapes = [x.shape[sd]] * size
        elif x.shape[sd] != src_shapes[me]:
            err = EinshardError(
                f"all_to_all: this rank ({_holder(rank, me)}) holds {x.shape[sd]} elements along src_dim "
                f"{src_dim} but src_shapes[{me}] = {src_shapes[me]} (src_shapes {src_shapes})"
            )
    if err is None:
        dst_shapes, err = _whole_split(dst_shapes, x.shape[dd], size, "all_to_all: dst_shapes", f"dst_dim {dst_dim}")
    if err is not None or _checks.agreement_needed():
        uneven = err is None and src_shapes is not None and any(s != src_shapes[0] for s in src_shapes)
        _agree(group, err, "all_to_all", x, _masked(x.shape, sd if uneven else None),
               (("dims", (sd, dd)), ("src_shapes", src_shapes), ("dst_shapes", dst_shapes)))
    x = x.detach()
    if _trace.traced():
        return _TC.all_to_all(x, group, sd, dd, src_shapes, dst_shapes, order)
    if size == 1:
        return _contiguous_clone(x)
    # blocks[j]: the block group rank j holds (its dst block goes there, its src block comes from there)
    blocks = range(size) if order is None else [order.index(j) for j in range(size)]
    # Pack the blocks for the destination ranks one after the other, each in x's own dimension order, so
    # that the received blocks are this rank's result pieces along src_dim (no unpacking when nothing
    # precedes src_dim).
    assert src_shapes is not None and dst_shapes is not None  # set above when there is no error
    m = max(dst_shapes)
    if all(s == m for s in dst_shapes):
        send = x.unflatten(dd, (size, m)).movedim(dd, 0)  # one copy below (a view for dd == 0)
        send = (send if order is None else send[blocks]).reshape(-1)
    else:
        offsets = _offsets(dst_shapes)
        send = torch.cat([x.narrow(dd, offsets[b], dst_shapes[b]).reshape(-1) for b in blocks])
    other = math.prod(x.shape[k] for k in range(x.dim()) if k not in (sd, dd))
    mine = dst_shapes[me]
    factor = _real_factor(x)
    in_splits = [dst_shapes[b] * other * x.shape[sd] for b in blocks]
    out_splits = [mine * other * src_shapes[b] for b in blocks]
    out = x.new_empty(sum(out_splits))
    # Skip only when nobody moves anything (decided from shared sizes, so every rank agrees).
    if sum(src_shapes) * sum(dst_shapes) * other:
        if _stats.is_active():
            isz = x.element_size()
            _stats.record(
                "all_to_all",
                group,
                (sum(in_splits) - in_splits[rank]) * isz,
                (sum(out_splits) - out_splits[rank]) * isz,
            )
        dist.all_to_all_single(
            _flat(out),
            _flat(send.contiguous()),
            [s * factor for s in out_splits],
            [s * factor for s in in_splits],
            group=group,
        )
    result_shape = list(x.shape)
    result_shape[sd] = sum(src_shapes)
    result_shape[dd] = mine
    if order is None and math.prod(x.shape[:sd]) == 1:  # the pieces, one after the other, are the result
        return out.view(result_shape)
    piece = list(result_shape)
    received = out.split(out_splits)  # from group rank j: block blocks[j]
    parts = []
    for s, j in zip(src_shapes, range(size) if order is None else order):
        if s:
            piece[sd] = s
            parts.append(received[j].view(piece))
    return torch.cat(parts, sd)


def all_to_all_v(chunks: Sequence[torch.Tensor], recv_numels: Sequence[int], group) -> list[torch.Tensor]:
    """General exchange: ``chunks[j]`` goes to group rank ``j``; returns what each rank sent here.

    Chunks may have any shape (they are flattened) and must share one dtype;
    ``recv_numels[j]`` is the element count rank ``j`` sends to this rank.
    Returns flat 1-D tensors, one per source rank. This rank's own chunk is
    passed through without communication (the result may share its memory).
    One ``all_to_all_single`` with split sizes (for point-to-point transfers
    with only some peers, see :func:`isend_irecv`).

    >>> got = all_to_all_v([torch.full((j,), float(rank)) for j in range(P)], [rank] * P, group)  # doctest: +SKIP
    >>> got[j]  # rank j's chunk for this rank: `rank` elements equal to j  # doctest: +SKIP
    """
    size = _size(group)
    chunks = list(chunks)
    if len(chunks) != size:
        raise EinshardError(f"all_to_all_v: got {len(chunks)} chunks but the group has {size} ranks")
    recv_numels = _sizes(recv_numels, "all_to_all_v: recv_numels", size)
    rank = _rank(group) if size > 1 else 0
    err = None
    dtype = chunks[rank].dtype
    if any(c.dtype != dtype for c in chunks):
        err = EinshardError(f"all_to_all_v: chunks have different dtypes {sorted({str(c.dtype) for c in chunks})}")
    elif chunks[rank].numel() != recv_numels[rank]:
        err = EinshardError(
            f"all_to_all_v: this rank (group rank {rank}) keeps {chunks[rank].numel()} elements for itself "
            f"but recv_numels[{rank}] = {recv_numels[rank]}"
        )
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "all_to_all_v", extra=(("dtype", dtype), ("device", chunks[rank].device)))
    if _trace.traced():
        return _TC.all_to_all_v([c.detach() for c in chunks], recv_numels, group)
    own = chunks[rank].detach().reshape(-1)
    if size == 1:
        return [own]
    in_splits = [0 if j == rank else c.numel() for j, c in enumerate(chunks)]
    out_splits = [0 if j == rank else n for j, n in enumerate(recv_numels)]
    send = [c.detach().reshape(-1) for j, c in enumerate(chunks) if j != rank and c.numel()]
    inp = torch.cat(send) if send else own.new_empty(0)
    out = own.new_empty(sum(out_splits))
    # Always called: a rank cannot know whether the others exchange anything.
    if _stats.is_active():
        isz = own.element_size()
        _stats.record("all_to_all_v", group, sum(in_splits) * isz, sum(out_splits) * isz)
    factor = _real_factor(own)
    dist.all_to_all_single(
        _flat(out),
        _flat(inp.contiguous()),
        [s * factor for s in out_splits],
        [s * factor for s in in_splits],
        group=group,
    )
    result = list(out.split(out_splits))
    result[rank] = own
    return result


def isend_irecv(sends, recvs, group, kind: str = "all_to_all_v") -> list:
    """Start batched point-to-point transfers; returns the works to ``wait()`` on.

    ``sends`` / ``recvs``: ``(group rank, contiguous tensor)`` pairs; received
    tensors are written in place (views of a larger buffer are fine). Records
    one ``kind`` call in :mod:`einshard.comm.comm_stats`, also when nothing moves.

    >>> works = isend_irecv([(1, x)], [(1, buf)], group)  # a swap with group rank 1  # doctest: +SKIP
    >>> for w in works: w.wait()  # doctest: +SKIP
    """
    if _stats.is_active():
        _stats.record(kind, group, sum(t.numel() * t.element_size() for _, t in sends),
                      sum(t.numel() * t.element_size() for _, t in recvs))
    ops = [dist.P2POp(dist.isend, _flat(t), _global_rank(group, j), group) for j, t in sends]
    ops += [dist.P2POp(dist.irecv, _flat(t), _global_rank(group, j), group) for j, t in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


# -- ppermute --------------------------------------------------------------------


def check_perm(perm, size: int) -> list[tuple[int, int]]:
    """``perm`` as ``(source, destination)`` pairs, checked against a group of ``size`` ranks."""
    pairs = []
    try:
        for pair in perm:
            s, d = pair
            if isinstance(s, bool) or isinstance(d, bool) or int(s) != s or int(d) != d:
                raise TypeError
            pairs.append((int(s), int(d)))
    except (TypeError, ValueError):
        raise EinshardError(f"ppermute: perm must be a list of (src, dst) rank pairs, got {perm!r}") from None
    for s, d in pairs:
        if not (0 <= s < size and 0 <= d < size):
            raise EinshardError(f"ppermute: pair {(s, d)} names a rank outside the group (size {size})")
    srcs = [s for s, _ in pairs]
    dsts = [d for _, d in pairs]
    if len(set(srcs)) != len(srcs):
        raise EinshardError(f"ppermute: a rank sends more than once in {pairs}")
    if len(set(dsts)) != len(dsts):
        raise EinshardError(f"ppermute: a rank receives more than once in {pairs}")
    return pairs


def ppermute(x: torch.Tensor, group, perm, recv_shape=None) -> torch.Tensor:
    """Send ``x`` along the ``(src, dst)`` pairs of ``perm`` (group ranks), like ``jax.lax.ppermute``.

    Each rank sends at most once and receives at most once; a rank that
    receives nothing gets zeros. ``recv_shape`` (default ``x.shape``) is the
    shape this rank receives. Batched ``isend``/``irecv``.

    >>> ring = [(i, (i + 1) % P) for i in range(P)]  # doctest: +SKIP
    >>> ppermute(torch.tensor([float(rank)]), group, ring)  # rank r gets r-1  # doctest: +SKIP
    """
    size = _size(group)
    pairs = check_perm(perm, size)
    x = x.detach()
    recv_shape = tuple(x.shape) if recv_shape is None else tuple(int(s) for s in recv_shape)
    rank = _rank(group) if size > 1 else 0
    dst = next((d for s, d in pairs if s == rank), None)
    src = next((s for s, d in pairs if d == rank), None)
    err = None
    if src == rank and math.prod(recv_shape) != x.numel():
        err = EinshardError(f"ppermute: rank {rank} sends to itself but recv_shape {recv_shape} != {tuple(x.shape)}")
    if err is not None or _checks.agreement_needed():
        _agree(group, err, "ppermute", extra=(("dtype", x.dtype), ("device", x.device), ("perm", pairs)),
               sent=x.numel() if dst is not None else -1, received=math.prod(recv_shape) if src is not None else -1,
               pairs=pairs)
    if _trace.traced():
        return _TC.ppermute(x, group, pairs, recv_shape)
    if src is None:
        out = x.new_zeros(recv_shape)
    elif src == rank:
        out = _contiguous_clone(x).view(recv_shape)
    else:
        out = x.new_empty(recv_shape)
    if size == 1:
        return out
    ops = []
    sent = received = 0
    if dst is not None and dst != rank and x.numel():
        xc = x.contiguous()
        ops.append(dist.P2POp(dist.isend, _flat(xc), _global_rank(group, dst), group))
        sent = xc.numel() * xc.element_size()
    if src is not None and src != rank and out.numel():
        ops.append(dist.P2POp(dist.irecv, _flat(out), _global_rank(group, src), group))
        received = out.numel() * out.element_size()
    if _stats.is_active():
        _stats.record("ppermute", group, sent, received)
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return out
