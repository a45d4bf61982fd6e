"""``launch``: run a function on N ranks from a script, under torchrun or by itself."""

from __future__ import annotations

import os

import torch.distributed as dist

from ..checks import checks_enabled, set_checks
from ..helpers import init_process_group
from ._pool import spawn

__all__ = ["launch"]


def launch(fn, world_size: int = 8, args=(), kwargs=None, *, timeout: float = 300.0, checks: bool = True) -> list | None:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks and collect the results.

    Under ``torchrun`` or ``srun`` (``RANK`` is set) this process is one rank:
    the process group is initialised from the environment
    (:func:`einshard.helpers.init_process_group`, gloo), ``fn`` runs, the
    results are gathered, and rank 0 gets the list while the other ranks get
    ``None``. Otherwise ``world_size`` gloo ranks are started
    (:func:`spawn`) and the calling process gets the list. Either way the
    list holds every rank's result in rank order, so a script prints it once::

        results = launch(simulate, 8)
        if results is not None:
            print(results[0])

    ``fn`` runs with cross-rank checks set to ``checks`` (default on; see
    ``es.set_checks``). ``fn`` must be a module-level function (it is
    pickled by reference).
    """
    kwargs = dict(kwargs or {})
    if "RANK" not in os.environ:
        return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, checks=checks)
    _, rank, world = init_process_group("gloo", use_cuda=False)
    if world != world_size:
        raise ValueError(f"{getattr(fn, '__name__', fn)} needs {world_size} ranks, but the job has {world}")
    before = checks_enabled()
    set_checks(checks)
    try:
        result = fn(*args, **kwargs)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        dist.barrier()
    finally:
        set_checks(before)
        dist.destroy_process_group()
    return gathered if rank == 0 else None
