"""Parameter metadata: layouts and duties that live on ``nn.Parameter`` objects.

A :class:`ParameterState` (attribute ``einshard_state``) records a parameter's
layout (which axes are sharded over which mesh groups), which groups
broadcast its initial values, and which groups SUM its gradient.
"""

from .state import ParameterGradComm, ParameterInitSync, ParameterState, TensorState
from .store import (
    PARAM_STATE_ATTR,
    get_parameter_state,
    iter_parameter_states,
    register_parameter_state,
    set_parameter_state,
)

__all__ = [
    "PARAM_STATE_ATTR",
    "ParameterState",
    "ParameterInitSync",
    "ParameterGradComm",
    "TensorState",
    "get_parameter_state",
    "set_parameter_state",
    "register_parameter_state",
    "iter_parameter_states",
]
