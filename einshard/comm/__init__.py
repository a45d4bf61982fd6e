"""Communication: meshes and their groups, every collective (raw, traced, autograd), the exchange, cross-rank
checks, communication accounting and the gradient sums started during backward.

Its public modules: ``es.comm.collectives`` (raw collectives on process groups), ``es.comm.mappings``
(their autograd forms, whose backward is the exact adjoint) and ``es.comm.helpers`` (split shapes,
process-group start-up, plain collectives).
"""

from . import collectives, helpers, mappings

__all__ = ["collectives", "mappings", "helpers"]
