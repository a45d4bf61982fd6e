"""Parameter metadata: layouts and duties that live on ``nn.Parameter`` objects.

A :class:`ParameterState` (attribute ``einshard_state``) records a parameter's
layout (which axes are sharded over which mesh groups), which groups
broadcast its initial values, and which groups SUM its gradient. Modules:

- ``state``: the dataclasses, reading annotations and layouts, the invariants;
- ``names``: mesh names and groups; ``merge``: merging states; ``store``: attaching them;
- ``register``: explicit registration (layouts, modules, linear/conv/norm);
- ``validate``: finalising pending duties and validating modules;
- ``sync``: initial broadcasts; ``reduce``: gradient reduction (helpers, hooks, DDP);
- ``buckets``: the hooks' engine; ``summed``: gradients a ``shard_map`` body sums;
- ``metadata``: local slices and shapes, global shapes; ``operand``: formula operands (``[param]``);
- ``like``: ``einshard_like`` (record a formula's states without running it);
- ``specs``: spec pytrees of a module's parameters; ``storage``: parameters stored sharded (``store=``);
- ``zero``: their gathers and the gradient hooks that also gather; ``checkpoint``: DCP conversions.

``zero`` and ``checkpoint`` sit above the operations (they run formulas and DTensor conversions), so this
package cannot import them while the operations import it; their public names (``to_dtensor``,
``from_dtensor``, ``load_from_dtensor_``, ``GatheredParameter``, ``register_native_grad_reduction_hooks_``)
join this namespace from the facade, ``einshard/__init__.py``, which every import of ``einshard.params``
runs first.
"""

from .buckets import GradBucketer
from .like import einshard_like
from .metadata import ParamShardMetadata, param_local_shape, param_local_slices, param_shard_dims, param_shard_metadata
from .operand import parameter_operand_state, register_parameter_operand
from .reduce import (
    NativeGradReductionHandle,
    reduce_grad_,
    reduce_module_grads_,
    register_grad_reduction_hook_,
)
from .register import (
    register_conv_parameters_,
    register_linear_parameters_,
    register_module_parameter_layouts_,
    register_norm_parameters_,
    register_parameter_layout,
)
from .specs import ParamSpec, param_specs
from .state import ParameterGradComm, ParameterInitSync, ParameterState, TensorState, gather_formula
from .storage import StoredParameter
from .store import (
    PARAM_STATE_ATTR,
    get_parameter_state,
    iter_parameter_states,
    register_parameter_state,
    set_parameter_state,
)
from .sync import init_param_, init_params_, sync_module_params_, sync_param_
from .validate import (
    finalize_module_parameter_grad_comm_,
    finalize_parameter_grad_comm_,
    validate_module_parameter_states_,
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
    "register_parameter_layout",
    "register_module_parameter_layouts_",
    "register_linear_parameters_",
    "register_conv_parameters_",
    "register_norm_parameters_",
    "finalize_parameter_grad_comm_",
    "finalize_module_parameter_grad_comm_",
    "validate_module_parameter_states_",
    "init_param_",
    "init_params_",
    "sync_param_",
    "sync_module_params_",
    "reduce_grad_",
    "reduce_module_grads_",
    "NativeGradReductionHandle",
    "register_grad_reduction_hook_",
    "ParamShardMetadata",
    "param_shard_dims",
    "param_local_slices",
    "param_local_shape",
    "param_shard_metadata",
    "parameter_operand_state",
    "register_parameter_operand",
    "einshard_like",
    "param_specs",
    "ParamSpec",
    "GradBucketer",
    "StoredParameter",
    "gather_formula",
]
