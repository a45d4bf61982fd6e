"""Per-shard programs, as ``jax.lax`` holds JAX's: ``shard_map``, the named collectives (``psum``, ``pmean``,
``pmax``, ``pmin``, ``pvary``, ``all_gather``, ``psum_scatter``, ``all_to_all``, ``ppermute``, ``axis_index``,
``axis_size``: one per collective entry, :mod:`einshard.spmd.named`), ``get_vma``, pytree specs
(``tree_shard``/``tree_gather``) and DTensor conversions (:mod:`einshard.spmd.dtensor`).

>>> import einshard as es
>>> callable(es.spmd.psum) and es.spmd.shard_map is es.shard_map
True
"""

from ..runtime.vma import get_vma
from . import named
from .named import *  # noqa: F403 - every named collective, generated from the collective entries
from .shard_map import shard_map
from .tree import tree_gather, tree_shard

__all__ = ["shard_map", "get_vma", "tree_shard", "tree_gather", *named.__all__]
