"""The planner's one cost model: step sequences priced under a policy's metric.

:func:`price` prices a move (its forward steps and the backward steps that
are its adjoint) as a :class:`Cost`; contractions, FFT plans and the
transitions between them all use it, and :meth:`Cost.key` orders costs under
a :class:`~einshard.core.policy.PlanPolicy`. Two metrics, chosen by the policy:

- ``"sent"``: bytes each rank sends, averaged over the ranks (each step's
  primitive's traffic, padded blocks included) and one call per collective;
- ``"max_received"``: the most bytes any rank receives to make the whole
  transition (however its steps move them; layouts that pile data on a few
  ranks lose) and one call per direction that moves anything. It reads only
  the first step's ``src`` and the last one's ``dst``, so a sequence may be
  one unplanned move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm.primitives import PRIMITIVES, moved_numel
from ..core._cache import cached
from ..core.layout import MeshShape
from ..core.policy import PlanPolicy

__all__ = ["Cost", "price"]


@dataclass(frozen=True)
class Cost:
    """Bytes and collective calls forward and backward, and the peak local bytes."""

    fwd_bytes: float = 0.0
    bwd_bytes: float = 0.0
    fwd_calls: int = 0
    bwd_calls: int = 0
    peak_bytes: float = 0.0

    def __add__(self, other: Cost) -> Cost:
        return Cost(
            self.fwd_bytes + other.fwd_bytes,
            self.bwd_bytes + other.bwd_bytes,
            self.fwd_calls + other.fwd_calls,
            self.bwd_calls + other.bwd_calls,
            max(self.peak_bytes, other.peak_bytes),
        )

    def key(self, policy: PlanPolicy) -> tuple:
        return policy.score(self.fwd_bytes, self.bwd_bytes, self.fwd_calls, self.bwd_calls, self.peak_bytes)


def _sent(steps, mesh: MeshShape, itemsize: int) -> tuple[float, int, float]:
    sent = sum(PRIMITIVES[s.kind].sent(s, mesh, itemsize) for s in steps)
    calls = sum(1 for s in steps if PRIMITIVES[s.kind].communicates(s))
    peak = max((s.src.mean_numel(mesh) + s.dst.mean_numel(mesh) for s in steps), default=0.0)
    return sent, calls, peak * itemsize


def _max_received(steps, mesh: MeshShape, itemsize: int) -> tuple[int, int, float]:
    most = _most_received(steps[0].src, steps[-1].dst, mesh) if steps else 0
    return most * itemsize, int(most > 0), 0.0


@cached(65536)
def _most_received(src, dst, mesh: MeshShape) -> int:
    moved = moved_numel(src, dst, mesh)
    return int(np.max(moved)) if moved.size else 0


_METRICS = {"sent": _sent, "max_received": _max_received}


def price(forward, backward, mesh: MeshShape, itemsize: int, metric: str = "sent") -> Cost:
    """The cost of running the steps ``forward`` and, in backward, ``backward``, under ``metric``.

    >>> from einshard.core.layout import Layout
    >>> mesh = MeshShape(("tp",), (4,))
    >>> shard = Layout(("a",), (8,), (("tp",),), ((2, 2, 2, 2),))
    >>> whole = Layout(("a",), (8,), ((),), (None,))
    >>> from einshard.plan.transition import plan_transition
    >>> price(plan_transition(shard, whole, mesh), plan_transition(whole, shard, mesh), mesh, 4)
    Cost(fwd_bytes=24.0, bwd_bytes=0.0, fwd_calls=1, bwd_calls=0, peak_bytes=40.0)
    """
    rule = _METRICS[metric]
    fb, fc, fp = rule(forward, mesh, itemsize)
    bb, bc, bp = rule(backward, mesh, itemsize)
    return Cost(fb, bb, fc, bc, max(fp, bp))
