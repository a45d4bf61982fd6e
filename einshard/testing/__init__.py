"""Run code on several CPU ranks (gloo) from one Python process, or scripts under torchrun on CPUs or GPUs.

``einshard.testing`` starts pools of worker processes with
``torch.distributed`` initialised (backend gloo, CPU) and runs module-level
functions on every rank, returning the per-rank results or raising
:class:`RankError` / :class:`RankTimeout` with each failing rank's remote
traceback. It also backs the pytest plugin
(``einshard.testing.pytest_plugin``: the ``@pytest.mark.ranks(n)`` marker and
the mesh fixtures). See ``docs/testing.md``.

>>> import torch, torch.distributed as dist
>>> from einshard import testing
>>> def rank_sum():                 # module-level, so it pickles by reference
...     t = torch.tensor([dist.get_rank()])
...     dist.all_reduce(t)
...     return t.item()
>>> testing.run_on_ranks(4, rank_sum)      # doctest: +SKIP
[6, 6, 6, 6]
"""

from ._device import (
                      DEVICES,
                      add_device_argument,
                      choose_device,
                      device_mesh,
                      init_rank,
                      local_device,
                      parse_device,
                      rank_device,
                      synchronize,
)
from ._errors import RankError, RankTimeout
from ._launch import launch
from ._mesh import MeshSpec, make_mesh
from ._pool import RankPool, close_all_pools, get_pool, run_on_ranks, spawn
from .reference import local_block

__all__ = [
    "spawn",
    "RankPool",
    "get_pool",
    "run_on_ranks",
    "close_all_pools",
    "RankError",
    "RankTimeout",
    "MeshSpec",
    "make_mesh",
    "local_block",
    "launch",
    "DEVICES",
    "add_device_argument",
    "choose_device",
    "init_rank",
    "rank_device",
    "local_device",
    "synchronize",
    "parse_device",
    "device_mesh",
]
