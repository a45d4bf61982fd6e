"""Plan policies: how the planner weighs the candidates it can choose from.

Precedence: ``policy=``, then ``optimize=``, then the innermost
``with es.optimize(mode):`` scope, then ``es.set_default_policy(mode)``,
then ``"training"``.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

from ..errors import EinshardError
from ._torch_compat import compile_in_progress

__all__ = ["PlanPolicy", "optimize", "set_default_policy", "resolve_policy", "MODES", "scope", "scoped"]


@dataclass(frozen=True)
class PlanPolicy:
    """Weights of the planner's cost model.

    A candidate plan costs ``forward * F + backward * B`` where ``F`` and
    ``B`` are ``bytes_weight * bytes + collective_weight * collectives`` of
    that pass, plus ``memory_weight * peak_local_bytes``. Ties are broken by
    total bytes, then collective count, then peak memory. ``metric`` says
    which bytes: ``"sent"`` (each rank's, averaged over the ranks) or
    ``"max_received"`` (the most any rank receives; FFT plans use it).

    >>> PlanPolicy.from_mode("inference").backward
    0.0
    """

    name: str = "training"
    forward: float = 1.0
    backward: float = 1.0
    bytes_weight: float = 1.0
    collective_weight: float = 65536.0
    memory_weight: float = 0.0
    metric: str = "sent"  # or "max_received" (see einshard.plan.cost)

    def __post_init__(self):
        if self.metric not in ("sent", "max_received"):
            raise EinshardError(f"PlanPolicy: metric must be 'sent' or 'max_received', got {self.metric!r}")

    def __hash__(self) -> int:  # policies key every plan cache lookup: hash once
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.name, self.forward, self.backward, self.bytes_weight, self.collective_weight,
                           self.memory_weight, self.metric))
            object.__setattr__(self, "_hash", cached)
        return cached

    @classmethod
    def from_mode(cls, mode: str) -> PlanPolicy:
        """The policy of a named mode: training, inference, memory, communication, latency."""
        try:
            return MODES[mode]
        except (KeyError, TypeError):
            raise EinshardError(f"unknown optimize mode {mode!r}; choose one of {sorted(MODES)}") from None

    def score(self, fwd_bytes, bwd_bytes, fwd_calls, bwd_calls, peak_bytes) -> tuple:
        """The sort key of a candidate (smaller is better)."""
        cost = (
            self.forward * (self.bytes_weight * fwd_bytes + self.collective_weight * fwd_calls)
            + self.backward * (self.bytes_weight * bwd_bytes + self.collective_weight * bwd_calls)
            + self.memory_weight * peak_bytes
        )
        total = self.forward * fwd_bytes + self.backward * bwd_bytes
        calls = self.forward * fwd_calls + self.backward * bwd_calls
        return (cost, total, calls, peak_bytes)


MODES: dict[str, PlanPolicy] = {
    # forward + backward bytes, a collective priced like 64 KiB moved
    "training": PlanPolicy("training"),
    # forward only
    "inference": PlanPolicy("inference", backward=0.0),
    # peak local bytes first; bytes only break ties
    "memory": PlanPolicy("memory", bytes_weight=0.0, collective_weight=0.0, memory_weight=1.0),
    # bytes moved, forward and backward, collective count ignored
    "communication": PlanPolicy("communication", collective_weight=0.0),
    # collective count first, bytes only break ties
    "latency": PlanPolicy("latency", bytes_weight=0.0, collective_weight=1.0),
}

_SCOPE: contextvars.ContextVar[PlanPolicy | None] = contextvars.ContextVar("einshard_policy", default=None)
# the scoped policy mirrored in a plain list that ``torch.compile`` can read (it cannot trace ContextVar.get)
_SCOPE_MIRROR: list[PlanPolicy | None] = [None]
_DEFAULT: list[PlanPolicy | None] = [None]


def _as_policy(mode_or_policy) -> PlanPolicy:
    if isinstance(mode_or_policy, PlanPolicy):
        return mode_or_policy
    return PlanPolicy.from_mode(mode_or_policy)


@contextlib.contextmanager
def optimize(mode):
    """Scope a default plan policy (a mode name or a ``PlanPolicy``).

    >>> with es.optimize("memory"):  # doctest: +SKIP
    ...     y = es.einshard("a b, b c -> a c/tp", x, w, mesh=mesh)
    """
    policy = _as_policy(mode)
    token = None
    try:  # set inside the try, so that no exit path (a compiler splitting the frame) skips the reset
        token = _SCOPE.set(policy)
        _SCOPE_MIRROR[0] = policy
        yield
    finally:
        if token is not None:
            _SCOPE.reset(token)
            _SCOPE_MIRROR[0] = _SCOPE.get()


def scope() -> PlanPolicy | None:
    """The policy of the innermost ``es.optimize`` scope (eager code), ``None`` outside any.

    >>> scope() is None
    True
    """
    return _SCOPE.get()


@contextlib.contextmanager
def scoped(policy: PlanPolicy | None):
    """Make ``policy`` (an earlier :func:`scope`, ``None``: no scope) the scoped policy, e.g. for a recompute.

    >>> with scoped(MODES["memory"]):
    ...     scope().name
    'memory'
    """
    token = None
    try:
        token = _SCOPE.set(policy)
        _SCOPE_MIRROR[0] = policy
        yield
    finally:
        if token is not None:
            _SCOPE.reset(token)
            _SCOPE_MIRROR[0] = _SCOPE.get()


def set_default_policy(mode) -> None:
    """Set the process-wide default policy (a mode name, a ``PlanPolicy`` or ``None``).

    >>> set_default_policy("inference"); set_default_policy(None)
    """
    _DEFAULT[0] = None if mode is None else _as_policy(mode)


def resolve_policy(optimize=None, policy=None) -> PlanPolicy:
    """Apply the precedence rules; ``ValueError`` when both arguments are given."""
    if optimize is not None and policy is not None:
        raise EinshardError("pass either optimize or policy, not both")
    if policy is not None:
        if not isinstance(policy, PlanPolicy):
            raise EinshardError(f"policy= must be a PlanPolicy, got {type(policy).__name__}")
        return policy
    if optimize is not None:
        return PlanPolicy.from_mode(optimize)
    scoped = _SCOPE_MIRROR[0] if compile_in_progress() else _SCOPE.get()
    if scoped is not None:
        return scoped
    return _DEFAULT[0] or MODES["training"]
