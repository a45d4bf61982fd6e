"""``all_reduce``: the element-wise reduction over a group (JAX's ``psum``); its adjoint is ``pvary``."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...core._torch_compat import functional_collectives as fc
from ...core._torch_compat import in_traced_code
from ...errors import EinshardError
from .. import checks as _checks
from .. import comm_stats as _stats
from ..arguments import CompletedWork, agree, back, contiguous_clone, flat, group_size, real, record
from ..collective import Collective, register
from ..primitives import invariant

__all__ = ["ALL_REDUCE", "all_reduce", "all_reduce_owned"]

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
    if op == "sum" and not (async_op or _checks.ENABLED or _stats.is_active() or in_traced_code()):
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
        agree(group, err, "all_reduce", x, extra=(("op", name),))
    size = group_size(group)
    x = x.detach()
    mean = name in ("avg", "mean")
    if in_traced_code():
        y = _traced(x / size if mean else x, group, "sum" if mean else name)
        return (y, CompletedWork()) if async_op else y
    if mean:
        y = (x / size).contiguous() if size > 1 else contiguous_clone(x)
        name = "sum"
    else:
        y = contiguous_clone(x)
    op_name = _REDUCE_OPS[name]
    assert op_name is not None  # avg and mean are handled above
    return _reduce_in_place(y, group, size, getattr(dist.ReduceOp, op_name), async_op)


def _sum_copy(x: torch.Tensor, group) -> torch.Tensor:
    """``all_reduce(x, group)`` with checks off, uncounted and untraced: a contiguous copy summed in place."""
    y = x.detach().clone(memory_format=torch.contiguous_format)
    if group_size(group) > 1:
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
        agree(group, None, "all_reduce", x, extra=(("op", "sum"),))
    return _reduce_in_place(x.detach().contiguous(), group, group_size(group), dist.ReduceOp.SUM, False)


def _reduce_in_place(y: torch.Tensor, group, size: int, reduce_op, async_op: bool):
    if size == 1:
        return (y, CompletedWork()) if async_op else y
    if _stats.is_active():
        record("all_reduce", group, size, y.numel() * y.element_size())
    work = dist.all_reduce(flat(y), op=reduce_op, group=group, async_op=async_op)
    return (y, work) if async_op else y


def _check(x: torch.Tensor, group=None, op: str = "sum"):
    """The transports' arguments of ``all_reduce(x, group, op=op)`` (``"sum"``, ``"max"``, ``"min"``)."""
    return x.detach(), group, op


def _eager(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """The reduction of a copy of ``x``, in place (``torch.distributed.all_reduce``)."""
    return _reduce_in_place(contiguous_clone(x), group, group_size(group), getattr(dist.ReduceOp, op.upper()), False)


def _traced(x: torch.Tensor, group, op: str = "sum") -> torch.Tensor:
    """The reduction of ``x`` (``op``: ``"sum"``, ``"max"``, ``"min"``) as a functional collective."""
    if group.size() == 1:
        return x.clone()
    return back(fc.all_reduce(real(x), op, group), x)


def _run(step, site):
    group, C = site.group(step.dims), site.C
    return lambda x: C.all_reduce(x, group)


ALL_REDUCE = register(Collective(
    name="all_reduce",
    what=lambda s: "all-reduce",
    run=_run,
    basis=lambda s, mesh: s.src.mean_numel(mesh),
    traffic=lambda p, n, root: (2 * (p - 1) * n / p,) * 2,  # ring
    vary=invariant,
    check=_check,
    eager=_eager,
    traced=_traced,
    form=all_reduce,
    adjoint="pvary",
))
