"""Communication: meshes and their groups, every collective (raw, traced, autograd), the exchange, cross-rank
checks, communication accounting and the gradient sums started during backward.

``es.collectives``, ``es.mappings`` and ``es.helpers`` are three of its modules.
"""
