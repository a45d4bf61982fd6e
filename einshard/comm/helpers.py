"""Helpers: split shapes, process-group start-up, plain collectives."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from ..core._split import compute_split_shapes, compute_split_shapes_for_factors, resolve_split_shapes
from ..errors import EinshardError
from .collectives import all_gather, all_reduce, all_to_all, all_to_all_v, broadcast, ppermute, reduce_scatter, split

__all__ = [
    "compute_split_shapes",
    "compute_split_shapes_for_factors",
    "resolve_split_shapes",
    "init_process_group",
    "all_reduce",
    "broadcast",
    "split",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_v",
    "ppermute",
]


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return None


def init_process_group(backend: str | None = None, use_cuda: bool = False) -> tuple[int, int, int]:
    """Initialise ``torch.distributed`` from torchrun or SLURM variables.

    Reads ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (torchrun) or
    ``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID`` (SLURM); with
    ``use_cuda`` it selects the local GPU. ``backend`` defaults to ``nccl``
    with CUDA and ``gloo`` otherwise. ``MASTER_ADDR``/``MASTER_PORT`` default
    to ``127.0.0.1:29500``. Returns ``(local_rank, world_rank, world_size)``;
    calling it again once initialised returns the same triple.

    >>> local_rank, rank, world = init_process_group("gloo", use_cuda=False)  # doctest: +SKIP
    """
    rank = _env_int("RANK", "SLURM_PROCID")
    world_size = _env_int("WORLD_SIZE", "SLURM_NTASKS")
    local_rank = _env_int("LOCAL_RANK", "SLURM_LOCALID")
    if rank is None or world_size is None:
        if dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        else:
            raise EinshardError(
                "init_process_group: set RANK and WORLD_SIZE (torchrun) or SLURM_PROCID and SLURM_NTASKS (srun)"
            )
    if local_rank is None:
        local_rank = rank
        if use_cuda and torch.cuda.is_available():
            local_rank = rank % torch.cuda.device_count()
    if use_cuda:
        if not torch.cuda.is_available():
            raise EinshardError("init_process_group: use_cuda=True but CUDA is not available")
        torch.cuda.set_device(local_rank)
    if backend is None:
        backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        kwargs: dict[str, Any] = {}
        if use_cuda:
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend, rank=rank, world_size=world_size, **kwargs)
    return local_rank, rank, world_size
