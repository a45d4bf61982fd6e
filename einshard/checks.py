"""Agreeing on argument errors across ranks before communicating.

An error that only one rank can see (say, its local size disagrees with
``shapes``) would leave the other ranks waiting in the next collective. With
checks on (``es.set_checks(True)`` or ``EINSHARD_CHECKS=1``), operations call
:func:`agree` before their first collective: the ranks exchange one small
flag, and when any rank failed every rank raises the same ``ValueError``.
Checks are off by default: then :func:`agree` only raises the local error and
costs nothing.
"""

from __future__ import annotations

import os
import threading

import torch

__all__ = ["set_checks", "checks_enabled", "agree"]


def _env_default() -> bool:
    return os.environ.get("EINSHARD_CHECKS", "").strip().lower() in ("1", "true", "yes", "on")


_ENABLED: bool = _env_default()

# Inside a planned operation every argument has been checked (and agreed on) once for the
# whole operation, so its collectives skip their own agreement: see :func:`planned`.
_PLANNED = threading.local()


class planned:
    """Context: the collectives inside run a plan whose arguments were already agreed on."""

    __slots__ = ()

    def __enter__(self):
        _PLANNED.depth = getattr(_PLANNED, "depth", 0) + 1

    def __exit__(self, *exc):
        _PLANNED.depth -= 1


def agreement_needed() -> bool:
    """Checks are on and no planned operation has agreed already."""
    return _ENABLED and not getattr(_PLANNED, "depth", 0)


def set_checks(flag: bool) -> None:
    """Turn cross-rank argument checks on or off for this process.

    >>> es.set_checks(True)   # every rank raises the same ValueError  # doctest: +SKIP
    """
    global _ENABLED
    _ENABLED = bool(flag)


def checks_enabled() -> bool:
    """Whether cross-rank checks are on (default: ``EINSHARD_CHECKS=1`` in the environment).

    >>> checks_enabled() in (True, False)
    True
    """
    return _ENABLED


def _flag_device(group) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, error: BaseException | None, fingerprint: int | None = None, what: str = "") -> None:
    """Raise ``error`` here, or (checks on) the lowest failing rank's error on every rank.

    ``fingerprint`` (checks on): an integer that must be equal on every rank
    (e.g. a hash of the global shapes a rank derived); when the ranks
    disagree, every rank raises a ``ValueError`` naming ``what``. It travels
    in the same collective as the error flag.

    With checks off: raises ``error`` if it is not ``None``; no communication.
    With checks on: one all-reduce of a small flag over ``group``; when any
    rank passed an error, every rank raises ``ValueError("rank R: <message>")``
    for the lowest failing group rank (``R`` is its global rank). Fetching the
    message costs a second collective on the error path only.

    >>> err = None if x.shape[0] == shapes[rank] else ValueError("size mismatch")  # doctest: +SKIP
    >>> agree(group, err)  # doctest: +SKIP
    """
    if not _ENABLED:
        if error is not None:
            raise error
        return
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if size == 1:
        if error is not None:
            raise error
        return
    rank = dist.get_rank(group)
    fp = 0 if fingerprint is None else int(fingerprint) % (2**62)
    flag = torch.tensor([rank if error is not None else size, fp, -fp], dtype=torch.int64, device=_flag_device(group))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    from . import comm_stats

    if comm_stats._ACTIVE:
        n = flag.numel() * flag.element_size()
        comm_stats.record("check", group, 2 * (size - 1) * n // size, 2 * (size - 1) * n // size)
    lowest, low_fp, neg_high_fp = (int(v) for v in flag.tolist())
    if lowest >= size:
        if low_fp != -neg_high_fp:
            raise ValueError(
                f"the ranks disagree on {what or 'the arguments'}: each rank derived different global shapes or "
                "split shapes (uneven shards passed without shapes=?)"
            )
        return
    message = None
    if error is not None:
        message = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    gathered: list = [None] * size
    dist.all_gather_object(gathered, message, group=group)
    global_rank = lowest if group is None else dist.get_global_rank(group, lowest)
    agreed = ValueError(f"rank {global_rank}: {gathered[lowest]}")
    if error is not None:
        raise agreed from error
    raise agreed
