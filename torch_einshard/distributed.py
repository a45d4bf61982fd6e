"""``torch_einshard.distributed``: torch-einshard 1.0's ``distributed_1d``, einshard's distributed formula.

>>> y = distributed_1d(parse_sharding("a b/tp, b/tp c -> a c"), x, w, mesh=mesh, shapes=None)  # doctest: +SKIP
"""

from __future__ import annotations

from einshard.ops.einshard import einshard

from .sharding import formula_text
from .symbolic import resolve_plan_policy

__all__ = ["distributed_1d"]


def distributed_1d(shard, *xs, mesh, shapes, policy=None):
    """Run the formula ``shard`` on sharded tensors over ``mesh`` (``es.einshard``, without ``[param]`` bookkeeping).

    ``shard``: text, a parsed formula or ``(input 0, input 1 or None, output)``; ``shapes``:
    the split shapes (``None``: even); ``policy``: a ``PlanPolicy`` or a mode name.
    """
    policy = None if policy is None else resolve_plan_policy(policy=policy)
    return einshard(formula_text(shard, annotations=False), *xs, mesh=mesh, shapes=shapes, policy=policy)
