"""The traced form of every collective: its entry's transport through functional collectives.

Under ``torch.compile`` a plan's transitions call these instead of the
in-place ``torch.distributed`` ones: each entry of :mod:`einshard.comm.entries`
builds its ``traced`` transport on ``torch.distributed._functional_collectives``
(a graph node that returns a new tensor), so a whole layer is one graph and
inductor may reorder and overlap its communication. Same signatures and
results as the eager transports (uneven blocks padded to the largest, as
there); arguments were checked when the plan was made, so there is no
validation here. ``order`` (the group rank holding each block, ``None``:
block ``j`` on group rank ``j``) is as in the eager functions.
"""

from __future__ import annotations

from typing import Any

from .entries import COLLECTIVES

_TRACED = {name: entry.traced for name, entry in COLLECTIVES.items() if not entry.transport}
globals().update(_TRACED)


def __getattr__(name: str) -> Any:
    """(Only for type checkers: the forms above are made from the entries, so a checker cannot list them;
    a name that is not one of them is missing, as for any module.)"""
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = list(_TRACED)
