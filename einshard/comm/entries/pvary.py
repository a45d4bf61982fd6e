"""``pvary``: the identity from a value the same on every rank to per-rank ones; its adjoint is ``all_reduce``
(JAX's ``pvary``, Megatron's "copy to the model-parallel region")."""

from __future__ import annotations

import torch

from ..collective import Collective, register
from ..primitives import varying

__all__ = ["PVARY"]


def pvary(x: torch.Tensor, group=None):
    """``x`` itself (detached): no communication; what changes is the layout (per-rank), and so the adjoint.

    >>> pvary(torch.ones(2), group)  # doctest: +SKIP
    tensor([1., 1.])
    """
    return x.detach(), group


def _identity(x: torch.Tensor, group=None) -> torch.Tensor:
    return x.view_as(x)


PVARY = register(Collective(
    name="pvary",
    vary=varying,
    check=pvary,
    eager=_identity,
    traced=_identity,
    forward=_identity,
    adjoint="all_reduce",
))
