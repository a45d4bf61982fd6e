"""What every collective entry shares: group queries, argument checks, cross-rank agreement, flat buffers.

The entries of :mod:`einshard.comm.entries` check their arguments with these
functions (errors every rank can see from shared arguments raise at once;
rank-local ones go through :func:`agree`, so with checks on every rank raises
the same error) and hand their transports the flat real buffers
``torch.distributed`` works on.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..core._split import compute_split_shapes
from ..errors import EinshardError
from . import checks as _checks
from . import comm_stats as _stats
from .primitives import PRIMITIVES

__all__ = [
    "group_size",
    "group_rank",
    "global_rank",
    "agree",
    "masked",
    "flat",
    "real",
    "back",
    "pad",
    "real_factor",
    "sizes",
    "dim",
    "along",
    "order",
    "holder",
    "whole_split",
    "offsets",
    "record",
    "contiguous_clone",
    "CompletedWork",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "norm_axis",
    "named_shapes",
    "default_shapes",
    "all_to_all_single",
]

# torch 2.13 renamed the tensor collectives; older versions only have the old names.
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


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


def global_rank(group, rank: int) -> int:
    """The global rank of group rank ``rank``."""
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def agree(group, err, point: str = "", x: torch.Tensor | None = None, shape=None, extra=(), **kw) -> None:
    """Raise ``err``; with checks on, agree first on it and on ``x``'s shape (or ``shape``), dtype and device.

    Call it when ``err is not None or checks.agreement_needed()`` only, so that nothing is built with
    checks off.
    """
    facts: tuple = ()
    if x is not None:
        facts = (("shape", tuple(x.shape) if shape is None else shape), ("dtype", x.dtype), ("device", x.device))
    _checks.agree(group, err, facts=facts + tuple(extra), point=point, **kw)


def masked(shape, dim):
    """``shape`` with ``dim`` (a size that may differ across ranks) left out of the comparison."""
    if dim is None:
        return tuple(shape)
    return tuple(shape[:dim]) + ("*",) + tuple(shape[dim + 1 :])


def flat(t: torch.Tensor) -> torch.Tensor:
    """A flat real view of a contiguous tensor (complex as pairs of reals)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(-1)


def real(x: torch.Tensor) -> torch.Tensor:
    """``x`` contiguous, complex as pairs of reals (what functional collectives take)."""
    return torch.view_as_real(x.contiguous()) if x.is_complex() else x.contiguous()


def back(y: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """:func:`real`'s inverse: ``y`` complex again where ``like`` is."""
    return torch.view_as_complex(y) if like.is_complex() else y


def pad(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """``x`` zero-padded along ``dim`` to ``length``."""
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim)


def all_to_all_single(out: torch.Tensor, send: torch.Tensor, out_splits, in_splits, group) -> None:
    """``torch.distributed.all_to_all_single`` of flat buffers, split sizes in elements (complex ones too)."""
    factor = real_factor(send)
    dist.all_to_all_single(
        flat(out),
        flat(send.contiguous()),
        [s * factor for s in out_splits],
        [s * factor for s in in_splits],
        group=group,
    )


def real_factor(t: torch.Tensor) -> int:
    """Reals per element: 2 for a complex tensor."""
    return 2 if t.is_complex() else 1


def sizes(shapes, what: str, size: int) -> list[int]:
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


def dim(d, ndim: int, fn: str, what: str = "dim"):
    """(normalised dim, error or None)."""
    try:
        n = int(d)
    except (TypeError, ValueError):
        return 0, EinshardError(f"{fn}: {what} must be an int, got {d!r}")
    if not -max(ndim, 1) <= n < max(ndim, 1) or ndim == 0:
        return 0, EinshardError(f"{fn}: {what}={d} is out of range for a tensor with {ndim} dimensions")
    return n % ndim, None


def along(x, group, d, shapes, fn: str):
    """``(size, shapes, dim, error)`` along ``d``: the group's size, ``shapes`` checked, ``d`` normalised."""
    size = group_size(group)
    return (size, None if shapes is None else sizes(shapes, f"{fn}: shapes", size), *dim(d, x.dim(), fn))


def order(blocks, size: int, fn: str) -> tuple[int, ...]:
    """``blocks`` (the group rank holding each block) as a tuple, checked to be a permutation of the ranks."""
    try:
        blocks = tuple(int(j) for j in blocks)
    except (TypeError, ValueError):
        raise EinshardError(f"{fn}: order must be a sequence of group ranks, got {blocks!r}") from None
    if sorted(blocks) != list(range(size)):
        raise EinshardError(f"{fn}: order {list(blocks)} is not a permutation of the group's {size} ranks")
    return blocks


def holder(rank: int, me: int) -> str:
    """Group rank ``rank`` holding block ``me``, in words."""
    return f"group rank {rank}" if rank == me else f"group rank {rank}, block {me}"


def whole_split(shapes, length: int, size: int, what: str, dim_text: str):
    """``(shapes, error)`` for splitting a whole axis of ``length``: the default split, or a check of ``shapes``."""
    if shapes is None:
        return compute_split_shapes(length, size), None
    if sum(shapes) != length:
        return shapes, EinshardError(
            f"{what} {shapes} sum to {sum(shapes)} but the tensor has size {length} along {dim_text}"
        )
    return shapes, None


def offsets(shapes: Sequence[int]) -> list[int]:
    """Where each block starts."""
    out, acc = [], 0
    for s in shapes:
        out.append(acc)
        acc += s
    return out


def record(kind: str, group, size: int, n: int, root=None) -> None:
    """Account one call: its primitive's traffic over ``size`` ranks, ``n`` the bytes of its defining buffer."""
    traffic = PRIMITIVES[kind].traffic
    assert traffic is not None, kind  # a collective's primitive has a traffic
    _stats.record(kind, group, *traffic(size, n, root))


def contiguous_clone(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x``."""
    return x.clone(memory_format=torch.contiguous_format)


class CompletedWork:
    """The ``Work`` of an asynchronous collective on a one-rank group."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


def norm_axis(axis: int, ndim: int, what: str) -> int:
    """``axis`` of a tensor with ``ndim`` dimensions, made non-negative (a named form's argument)."""
    if not -ndim <= axis < ndim:
        raise EinshardError(f"{what}: axis {axis} is out of range for a tensor with {ndim} dimensions")
    return axis % ndim


def named_shapes(shapes, axes, what):
    """A named form's per-rank ``shapes`` (``None``: the default), checked against the group of ``axes``."""
    if shapes is None:
        return None
    shapes = [int(s) for s in shapes]
    if len(shapes) != axes.size:
        raise EinshardError(
            f"{what}: shapes has {len(shapes)} entries but {'-'.join(axes.dims)!r} has {axes.size} ranks")
    return shapes


def default_shapes(x: torch.Tensor, group, d: int, shapes, even: bool) -> tuple[int, ...] | None:
    """``shapes`` as a tuple; ``None``: ``x.shape[d]`` on every rank (``even``) or ``compute_split_shapes``.

    ``None`` for an out-of-range ``d``: the collective itself reports it.
    """
    if shapes is not None:
        return tuple(shapes)
    if not -x.dim() <= d < x.dim():
        return None
    n, size = x.shape[d], group_size(group)
    return (n,) * size if even else tuple(compute_split_shapes(n, size))
