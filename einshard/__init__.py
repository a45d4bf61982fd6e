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
from .ops import einconv, einhalo, einroll, einshard, einwindow
from .policy import PlanPolicy, optimize, set_default_policy
from .visualize import visualize

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
    "einhalo",
    "einwindow",
    "einconv",
    "einroll",
    "PlanPolicy",
    "optimize",
    "set_default_policy",
    "visualize",
]
