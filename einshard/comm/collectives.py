"""Raw collectives on process groups (the plain collectives of ``es.comm.helpers``): the raw form of every
entry of :mod:`einshard.comm.entries`, with the few raw-only functions the entries define beside it.

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
  entry prices them (the planner's numbers).

Blocks are in group-rank order: block ``j`` is group rank ``j``'s. The block
collectives (:func:`split`, :func:`all_gather`, :func:`reduce_scatter`,
:func:`all_to_all`) also take ``order``, the group rank holding each block
(``order[k]``: block ``k``'s), for meshes whose block order (mesh
coordinates) is not the group's rank order (``es.Mesh.order``); ``shapes``
are then in block order too.

Groups of one rank communicate nothing. In code that ``torch.compile``
traces, each function checks (and agrees) as here, then communicates with
its entry's traced transport (:mod:`einshard.comm._traced_collectives`).
"""

from __future__ import annotations

from typing import Any

from .arguments import group_rank, group_size
from .arguments import sizes as _sizes  # noqa: F401 (the name tests/comm/test_collectives.py checks it by)
from .entries import COLLECTIVES
from .entries.all_gather import PendingGather, all_gather_start
from .entries.all_reduce import all_reduce_owned
from .entries.ppermute import check_perm, isend_irecv
from .entries.reduce_scatter import reduce_scatter_rows

_RAW = {name: entry.raw for name, entry in COLLECTIVES.items() if not entry.transport}
globals().update(_RAW)


def __getattr__(name: str) -> Any:
    """(Only for type checkers: the forms above are made from the entries, so a checker cannot list them;
    a name that is not one of them is missing, as for any module.)"""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "group_size",
    "group_rank",
    *_RAW,
    "all_reduce_owned",
    "reduce_scatter_rows",
    "all_gather_start",
    "PendingGather",
    "isend_irecv",
    "check_perm",
]
