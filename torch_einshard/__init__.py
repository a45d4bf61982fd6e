"""``torch_einshard``: the namespace of torch-einshard 1.0, on einshard.

Code written against torch-einshard 1.0 imports this module: every flat name of 1.0 is
here (``__all__``), and so are 1.0's module paths (``torch_einshard.helpers``,
``torch_einshard.mappings``, ``torch_einshard.params``, ...). It is its own module, built from
einshard's modules (never from the ``einshard`` facade's names), so it does not change when
``einshard``'s own namespace does. New code imports ``einshard``.

- The operations, parameter metadata, meshes and policies are einshard's own objects.
- ``einsum``, ``distributed_1d``, ``all_local``, ``local_operation``,
  ``cached_expand_axis_families``, the notation class names (``TensorSpec``, ``Axes``,
  ``AxisGroup``, ``EllipsisAxis``), ``CompoundDeviceMesh``, ``TensorState``, ``ExecutionPlan``,
  ``set_last_plan``, the transition plans and the policy getters are 1.0's names with
  1.0's arguments over einshard's machinery (``docs/migrating.md`` lists what differs).
- ``torch_einshard.helpers`` and ``torch_einshard.mappings`` are 1.0's collectives with 1.0's
  argument names.

>>> import torch, torch_einshard as te
>>> te.einshard("i j, j k -> i k", torch.ones(2, 3), torch.ones(3, 4)).shape
torch.Size([2, 4])
"""

from __future__ import annotations

from einshard._version import __version__ as __version__
from einshard.comm.mesh import wrap_mesh
from einshard.core.policy import PlanPolicy, optimize, set_default_policy
from einshard.notation import parse_sharding
from einshard.ops.conv import einconv
from einshard.ops.einshard import einshard
from einshard.ops.fft import einfft
from einshard.ops.halo import einhalo
from einshard.ops.roll import einroll
from einshard.ops.window import einwindow
from einshard.params import (
    NativeGradReductionHandle,
    ParameterGradComm,
    ParameterInitSync,
    ParameterState,
    ParamShardMetadata,
    einshard_like,
    finalize_module_parameter_grad_comm_,
    finalize_parameter_grad_comm_,
    get_parameter_state,
    init_param_,
    init_params_,
    iter_parameter_states,
    param_local_shape,
    param_local_slices,
    param_shard_dims,
    param_shard_metadata,
    parameter_operand_state,
    reduce_grad_,
    reduce_module_grads_,
    register_conv_parameters_,
    register_grad_reduction_hook_,
    register_linear_parameters_,
    register_module_parameter_layouts_,
    register_norm_parameters_,
    register_parameter_layout,
    register_parameter_operand,
    register_parameter_state,
    set_parameter_state,
    sync_module_params_,
    sync_param_,
    validate_module_parameter_states_,
)
from einshard.params.zero import register_native_grad_reduction_hooks_

from . import _paths
from ._signatures import legacy_names
from .distributed import distributed_1d
from .einsum import einsum
from .families import cached_expand_axis_families
from .locality import all_local, local_operation
from .mesh import CompoundDeviceMesh
from .sharding import Axes, AxisGroup, EllipsisAxis, TensorSpec
from .symbolic import (
    ExecutionPlan,
    TensorState,
    build_binary_transition_plan,
    build_unary_transition_plan,
    get_default_policy,
    get_optimization_policy,
    resolve_plan_policy,
    set_last_plan,
)

_paths.install()

# einshard's functions under 1.0's parameter names (einshard name -> 1.0 name)
einshard = legacy_names(einshard, formula="shard", tensors="xs")
einshard_like = legacy_names(einshard_like, formula="shard", operands="xs")
einconv = legacy_names(einconv, formula="shard")
einfft = legacy_names(einfft, formula="shard")
einhalo = legacy_names(einhalo, spec="shard")
einwindow = legacy_names(einwindow, formula="shard")
einroll = legacy_names(einroll, spec="shard")
parse_sharding = legacy_names(parse_sharding, formula="expression")
wrap_mesh = legacy_names(wrap_mesh, mesh="device_mesh")
optimize = legacy_names(optimize, mode="policy")
set_default_policy = legacy_names(set_default_policy, mode="policy")
finalize_parameter_grad_comm_ = legacy_names(finalize_parameter_grad_comm_, p="param")
get_parameter_state = legacy_names(get_parameter_state, p="param")
init_param_ = legacy_names(init_param_, p="param")
param_local_shape = legacy_names(param_local_shape, p_or_state="param_or_state")
param_local_slices = legacy_names(param_local_slices, p_or_state="param_or_state")
param_shard_dims = legacy_names(param_shard_dims, p_or_state="param_or_state")
param_shard_metadata = legacy_names(param_shard_metadata, p_or_state="param_or_state")
reduce_grad_ = legacy_names(reduce_grad_, p="param")
register_parameter_layout = legacy_names(register_parameter_layout, p="param")
register_parameter_operand = legacy_names(register_parameter_operand, p="param")
register_parameter_state = legacy_names(register_parameter_state, p="param")
parameter_operand_state = legacy_names(parameter_operand_state, p="param")
set_parameter_state = legacy_names(set_parameter_state, p="param")
sync_param_ = legacy_names(sync_param_, p="param")

__all__ = [
    # operations
    "einshard",
    "einshard_like",
    "einsum",
    "einconv",
    "einfft",
    "einhalo",
    "einwindow",
    "einroll",
    "distributed_1d",
    # notation
    "parse_sharding",
    "cached_expand_axis_families",
    "Axes",
    "AxisGroup",
    "EllipsisAxis",
    "TensorSpec",
    "all_local",
    "local_operation",
    # meshes
    "CompoundDeviceMesh",
    "wrap_mesh",
    # plans and policies
    "ExecutionPlan",
    "PlanPolicy",
    "TensorState",
    "build_binary_transition_plan",
    "build_unary_transition_plan",
    "get_default_policy",
    "get_optimization_policy",
    "optimize",
    "resolve_plan_policy",
    "set_default_policy",
    "set_last_plan",
    # parameter metadata
    "ParamShardMetadata",
    "NativeGradReductionHandle",
    "ParameterGradComm",
    "ParameterInitSync",
    "ParameterState",
    "finalize_module_parameter_grad_comm_",
    "finalize_parameter_grad_comm_",
    "get_parameter_state",
    "init_param_",
    "init_params_",
    "iter_parameter_states",
    "param_local_shape",
    "param_local_slices",
    "param_shard_dims",
    "param_shard_metadata",
    "reduce_grad_",
    "reduce_module_grads_",
    "register_conv_parameters_",
    "register_grad_reduction_hook_",
    "register_linear_parameters_",
    "register_module_parameter_layouts_",
    "register_native_grad_reduction_hooks_",
    "register_norm_parameters_",
    "register_parameter_layout",
    "register_parameter_operand",
    "register_parameter_state",
    "parameter_operand_state",
    "set_parameter_state",
    "sync_module_params_",
    "sync_param_",
    "validate_module_parameter_states_",
]
