"""torch-einshard: sharded PyTorch programs in einsum-like notation.

>>> import torch, einshard as es
>>> es.einshard("i j, j k -> i k", torch.ones(2, 3), torch.ones(3, 4)).shape
torch.Size([2, 4])
"""

from ._version import __version__
from . import collectives, helpers, mappings, testing
from .checks import set_checks
from .comm_stats import CommStats, count_communication
from .mesh import Mesh, current_mesh, use_mesh, wrap_mesh
from .notation import parse_sharding
from .explain import explain, Explanation
from .ops import einconv, einfft, einhalo, einroll, einshard, einwindow
from .policy import PlanPolicy, optimize, set_default_policy
from .visualize import visualize
from .shard_map import shard_map
from .named import (
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
from .tree import tree_gather, tree_shard
from .vma import get_vma

__all__ = [
    "__version__",
    "collectives",
    "helpers",
    "mappings",
    "testing",
    "set_checks",
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
]

# -- parameter metadata (layouts and duties on nn.Parameter objects) --
from . import params
from .params import (
    PARAM_STATE_ATTR,
    ParameterGradComm,
    ParameterInitSync,
    ParameterState,
    get_parameter_state,
    iter_parameter_states,
    register_parameter_state,
    set_parameter_state,
)

__all__ += [
    "params",
    "PARAM_STATE_ATTR",
    "ParameterState",
    "ParameterInitSync",
    "ParameterGradComm",
    "get_parameter_state",
    "set_parameter_state",
    "register_parameter_state",
    "iter_parameter_states",
]
