"""torch-einshard: sharded PyTorch programs in einsum-like notation.

The facade holds 32 names: the operations, ``shard_map``, the mesh, the pytree helpers, inspection, the
planning policy and checks, the errors, and five namespaces — ``es.spmd`` (the named collectives, as
``jax.lax``), ``es.comm`` (collectives on process groups), ``es.params`` (parameter layouts, duties and
ZeRO storage), ``es.attention`` and ``es.testing``. A name that moved to a namespace says where it went.

>>> import torch, einshard as es
>>> es.einshard("i j, j k -> i k", torch.ones(2, 3), torch.ones(3, 4)).shape
torch.Size([2, 4])
"""

from . import attention, comm, params, spmd, testing
from ._version import __version__
from .comm.checks import checks_enabled, set_checks
from .comm.comm_stats import CommStats, count_communication
from .comm.mesh import Mesh, current_mesh, use_mesh, wrap_mesh
from .core.policy import PlanPolicy, optimize, set_default_policy
from .errors import EinshardError, SizeMismatchError
from .notation import parse_sharding
from .ops import einconv, einfft, einhalo, einroll, einshard, einwindow
from .ops.explain import Explanation, explain
from .ops.visualize import visualize
from .params import checkpoint as _checkpoint
from .params import zero as _zero
from .runtime.recompute import install as _install_recompute
from .spmd.shard_map import shard_map
from .spmd.tree import tree_gather, tree_shard

# torch.utils.checkpoint recomputes regions in their forward's context (einshard.runtime.recompute)
_install_recompute()

__all__ = [
    # operations
    "einshard",
    "einfft",
    "einhalo",
    "einwindow",
    "einconv",
    "einroll",
    "shard_map",
    # the mesh
    "Mesh",
    "wrap_mesh",
    "use_mesh",
    "current_mesh",
    # pytrees
    "tree_shard",
    "tree_gather",
    # inspection
    "explain",
    "Explanation",
    "visualize",
    "count_communication",
    "CommStats",
    "parse_sharding",
    # planning policy and checks
    "PlanPolicy",
    "optimize",
    "set_default_policy",
    "set_checks",
    "checks_enabled",
    # errors
    "EinshardError",
    "SizeMismatchError",
    # namespaces
    "spmd",
    "comm",
    "params",
    "attention",
    "testing",
    "__version__",
]

# The public names of the two parameter modules that sit above the operations (they run formulas and DTensor
# conversions, so einshard.params cannot import them while the operations import it) join es.params here.
_ABOVE_OPERATIONS = {
    "to_dtensor": _checkpoint.to_dtensor,
    "from_dtensor": _checkpoint.from_dtensor,
    "load_from_dtensor_": _checkpoint.load_from_dtensor_,
    "GatheredParameter": _zero.GatheredParameter,
    "register_native_grad_reduction_hooks_": _zero.register_native_grad_reduction_hooks_,
}
vars(params).update(_ABOVE_OPERATIONS)
params.__all__ += [name for name in _ABOVE_OPERATIONS if name not in params.__all__]

# Where each name that left the facade went (the package is unreleased: they moved, no alias is kept).
_MOVED = {
    **{name: "es.spmd" for name in spmd.__all__ if name not in __all__},
    **dict.fromkeys(comm.__all__, "es.comm"),
    **dict.fromkeys(("ring_attention", "ulysses_attention"), "es.attention"),
    **dict.fromkeys(params.__all__, "es.params"),
}


def __getattr__(name: str):
    """A name that moved to a namespace: an ``AttributeError`` that says where (``es.psum`` is ``es.spmd.psum``)."""
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module 'einshard' has no attribute {name!r}")
    raise AttributeError(f"module 'einshard' has no attribute {name!r}: it is {where}.{name}")
