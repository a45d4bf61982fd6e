"""Where a parameter's state lives: the ``einshard_state`` attribute of the ``nn.Parameter`` object.

Aliases (the same Parameter reached under two names) share it; there is no registry.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from ..errors import EinshardError
from .merge import merge_states
from .state import ParameterState, check_rank, check_state

__all__ = [
    "PARAM_STATE_ATTR",
    "get_parameter_state",
    "set_parameter_state",
    "register_parameter_state",
    "prepare_registration",
    "Registration",
    "iter_parameter_states",
]

PARAM_STATE_ATTR = "einshard_state"


def get_parameter_state(p) -> ParameterState | None:
    """The state attached to ``p``, or ``None``.

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> get_parameter_state(p) is None
    True
    """
    return getattr(p, PARAM_STATE_ATTR, None)


def set_parameter_state(p, state) -> torch.nn.Parameter:
    """Overwrite the attached state without any check (``None`` detaches); returns ``p``.

    >>> p = set_parameter_state(torch.nn.Parameter(torch.zeros(2)), ParameterState.from_layout("c"))
    >>> get_parameter_state(p).layout
    'c'
    """
    if state is None:
        if hasattr(p, PARAM_STATE_ATTR):
            delattr(p, PARAM_STATE_ATTR)
    else:
        setattr(p, PARAM_STATE_ATTR, state)
    return p


def _require_parameter(p, what: str = "p") -> None:
    if not isinstance(p, torch.nn.Parameter):
        raise TypeError(f"{what} must be a torch.nn.Parameter, got {type(p).__name__}")


def prepare_registration(p, state) -> ParameterState:
    """Validate ``state`` and the attached state, check the rank, return their merge (nothing attached)."""
    if not isinstance(state, ParameterState):
        raise TypeError(f"expected a ParameterState, got {type(state).__name__}")
    check_state(state)
    check_rank(state, p.dim())
    base = get_parameter_state(p)
    if base is not None:
        check_state(base)
    merged = merge_states(base, state)
    check_rank(merged, p.dim())
    return merged


class Registration:
    """Atomic registration of several states: merge them all first, then attach them all.

    Several uses of one Parameter merge in order first; the result then merges
    with the Parameter's attached state.
    """

    def __init__(self):
        self._uses: dict[int, ParameterState] = {}
        self._merged: dict[int, tuple[torch.nn.Parameter, ParameterState]] = {}

    def newly_stored(self) -> list:
        """``(p, state)`` for the parameters this registration stores sharded (``store=``) for the first time:
        they hold their compute block now, and are cut to their storage block when attached."""
        out = []
        for p, merged in self._merged.values():
            base = get_parameter_state(p)
            if merged.store is not None and (base is None or base.store is None):
                out.append((p, merged))
        return out

    def add(self, p, state, what: str = "p") -> ParameterState:
        _require_parameter(p, what)
        if not isinstance(state, ParameterState):
            raise TypeError(f"expected a ParameterState, got {type(state).__name__}")
        check_state(state)
        check_rank(state, p.dim())
        prev = self._uses.get(id(p))
        use = state if prev is None else merge_states(prev, state)
        merged = prepare_registration(p, use)
        self._uses[id(p)] = use
        self._merged[id(p)] = (p, merged)
        return merged

    def attach(self) -> None:
        for p, merged in self._merged.values():
            if merged is not get_parameter_state(p):
                set_parameter_state(p, merged)


def register_parameter_state(p, state) -> torch.nn.Parameter:
    """Validate, merge into the attached state and attach; on failure nothing changes. Returns ``p``.

    >>> p = torch.nn.Parameter(torch.zeros(4, 3))
    >>> _ = register_parameter_state(p, ParameterState.from_layout("out/tp in", mesh_dim_names=("dp", "tp")))
    >>> _ = register_parameter_state(p, ParameterState.from_layout("out/tp in", grad="dp"))
    >>> get_parameter_state(p).reduce
    ('dp',)
    """
    _require_parameter(p)
    merged = prepare_registration(p, state)
    if merged is not get_parameter_state(p):
        set_parameter_state(p, merged)
    return p


def per_name(value, names, what: str) -> dict:
    """One value for every name, or a Mapping whose keys must be among ``names`` (absent names get ``None``)."""
    if isinstance(value, Mapping):
        unknown = [k for k in value if k not in names]
        if unknown:
            raise EinshardError(f"{what}: unknown parameter names {unknown!r} (known: {list(names)!r})")
        return {n: value.get(n) for n in names}
    return dict.fromkeys(names, value)


def iter_parameter_states(module) -> Iterator[tuple[str, torch.nn.Parameter, ParameterState]]:
    """``(name, p, state)`` for the deduplicated ``named_parameters()`` that have a state.

    >>> lin = torch.nn.Linear(3, 4)
    >>> _ = register_parameter_state(lin.weight, ParameterState.from_layout("out in"))
    >>> [name for name, _, _ in iter_parameter_states(lin)]
    ['weight']
    """
    for name, p in module.named_parameters():
        state = get_parameter_state(p)
        if state is not None:
            yield name, p, state
