"""torch-einshard: sharded PyTorch programs in einsum-like notation.

>>> import torch, einshard as es
>>> es.einshard("i j, j k -> i k", torch.ones(2, 3), torch.ones(3, 4)).shape
torch.Size([2, 4])
"""

from . import attention, testing
from ._version import __version__
from .attention import ring_attention, ulysses_attention
from .comm import collectives, helpers, mappings
from .comm.checks import checks_enabled, set_checks
from .comm.comm_stats import CommStats, count_communication
from .comm.mesh import Mesh, current_mesh, use_mesh, wrap_mesh
from .core.policy import PlanPolicy, optimize, set_default_policy
from .errors import EinshardError, SizeMismatchError
from .notation import parse_sharding
from .ops import einconv, einfft, einhalo, einroll, einshard, einwindow
from .ops.explain import Explanation, explain
from .ops.visualize import visualize
from .runtime.recompute import install as _install_recompute
from .runtime.vma import get_vma
from .spmd.named import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    psum,
    psum_scatter,
    pvary,
)
from .spmd.shard_map import shard_map
from .spmd.tree import tree_gather, tree_shard

# torch.utils.checkpoint recomputes regions in their forward's context (einshard.runtime.recompute)
_install_recompute()

__all__ = [
    "__version__",
    "collectives",
    "helpers",
    "mappings",
    "testing",
    "set_checks",
    "checks_enabled",
    "EinshardError",
    "SizeMismatchError",
    "count_communication",
    "CommStats",
    "Mesh",
    "current_mesh",
    "use_mesh",
    "wrap_mesh",
    "parse_sharding",
    "explain",
    "Explanation",
    "einshard",
    "einfft",
    "einhalo",
    "einwindow",
    "einconv",
    "einroll",
    "PlanPolicy",
    "optimize",
    "set_default_policy",
    "visualize",
    "shard_map",
    "psum",
    "pmean",
    "pmax",
    "pmin",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pvary",
    "axis_index",
    "axis_size",
    "tree_shard",
    "tree_gather",
    "get_vma",
    "attention",
    "ring_attention",
    "ulysses_attention",
]

# -- parameter metadata (layouts and duties on nn.Parameter objects) --
from . import params
from .params import (
    PARAM_STATE_ATTR,
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

__all__ += ["params", "PARAM_STATE_ATTR"] + [n for n in params.__all__ if n not in ("PARAM_STATE_ATTR", "TensorState")]

# -- one source of truth for parameter layouts: spec pytrees, DTensors, checkpoints, bucketed reduction --
from .params.buckets import GradBucketer
from .params.checkpoint import from_dtensor, load_from_dtensor_, to_dtensor
from .params.specs import ParamSpec, param_specs

__all__ += ["param_specs", "ParamSpec", "to_dtensor", "from_dtensor", "load_from_dtensor_", "GradBucketer"]

# -- parameters stored sharded over data parallelism (store=): the hooks also gather them --
from .params.storage import StoredParameter
from .params.zero import GatheredParameter, gather_formula, register_native_grad_reduction_hooks_

__all__ += ["GatheredParameter", "StoredParameter", "gather_formula"]
