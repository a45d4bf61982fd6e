"""``launch``: run a function on N ranks from a script, under torchrun or by itself."""

from __future__ import annotations

import torch.distributed as dist

from ..comm.checks import checks_enabled, set_checks
from ..errors import EinshardError
from ._device import choose_device, init_rank, launched
from ._pool import spawn

__all__ = ["launch"]


def launch(fn, world_size: int = 8, args=(), kwargs=None, *, timeout: float = 300.0, checks: bool = True,
           device: str = "auto") -> list | None:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and collect the results.

    Under ``torchrun`` or ``srun`` (``RANK`` or ``SLURM_PROCID`` is set) this
    process is one rank: the process group is initialised from the environment
    on ``device`` (``auto``, ``cpu`` or ``cuda``, see
    :func:`einshard.testing.choose_device`: with ``cuda`` each rank uses the GPU
    ``LOCAL_RANK`` over NCCL, with ``cpu`` gloo), ``fn`` runs, the results are
    gathered, the process group is destroyed, and rank 0 gets the list while
    the other ranks get ``None``. Otherwise ``world_size`` gloo CPU ranks are
    started (:func:`spawn`; ``device="cuda"`` raises there) and the calling
    process gets the list. Either way the list holds every rank's result in
    rank order, so a script prints it once::

        results = launch(simulate, 8, device=args.device)
        if results is not None:
            print(results[0])

    Inside ``fn``, :func:`einshard.testing.rank_device` is the rank's device
    and :func:`einshard.testing.device_mesh` builds meshes on it. ``fn`` runs
    with cross-rank checks set to ``checks`` (default on; see
    ``es.set_checks``). ``fn`` must be a module-level function (it is
    pickled by reference).
    """
    kwargs = dict(kwargs or {})
    chosen = choose_device(device)  # refuses --device cuda outside torchrun/srun, before starting anything
    if not launched():
        return spawn(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, checks=checks)
    _, rank, world = init_rank(chosen)
    before = checks_enabled()
    try:
        if world != world_size:
            raise EinshardError(f"{getattr(fn, '__name__', fn)} needs {world_size} ranks, but the job has {world}")
        set_checks(checks)
        result = fn(*args, **kwargs)
        gathered: list = [None] * world
        dist.all_gather_object(gathered, result)
        dist.barrier()
    finally:
        set_checks(before)
        dist.destroy_process_group()
    return gathered if rank == 0 else None
