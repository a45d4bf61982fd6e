"""Where a script's ranks compute: ``--device {auto,cpu,cuda}`` to a device and a process-group backend.

The one place that decides it: :func:`launch` (and through it every example and benchmark) asks
:func:`choose_device`, initialises the rank on the answer (:func:`init_rank`: NCCL and
``torch.cuda.set_device(LOCAL_RANK)``, or gloo), and the rank's code asks :func:`rank_device` where to
put its tensors and builds its meshes with :func:`device_mesh`.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.distributed.device_mesh import init_device_mesh

from ..comm.helpers import init_process_group
from ..errors import EinshardError

__all__ = ["DEVICES", "add_device_argument", "choose_device", "device_mesh", "init_rank", "launched", "local_device",
           "parse_device", "rank_device", "synchronize"]

DEVICES = ("auto", "cpu", "cuda")

# this process's rank device: CPU unless init_rank put it on a GPU
_RANK_DEVICE = [torch.device("cpu")]


def launched() -> bool:
    """Whether this process is one rank of a job started by ``torchrun`` (``RANK``) or ``srun`` (``SLURM_PROCID``)."""
    return any(os.environ.get(name, "") != "" for name in ("RANK", "SLURM_PROCID"))


def _local_rank() -> int:
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        if os.environ.get(name, "") != "":
            return int(os.environ[name])
    return 0


def _local_ranks() -> int | None:
    """How many ranks of the job share this machine, where the launcher says (torchrun, srun)."""
    for name in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def choose_device(requested: str = "auto") -> str:
    """``"cuda"`` or ``"cpu"``: where the ranks of a script run for ``--device requested``.

    ``cpu``: gloo CPU ranks. ``cuda``: one GPU per rank (``LOCAL_RANK``), NCCL; it needs a job started by
    ``torchrun`` or ``srun`` on machines with a GPU for every local rank, and raises
    :class:`~einshard.EinshardError` otherwise. ``auto``: ``cuda`` where that holds, else ``cpu``.
    """
    if requested not in DEVICES:
        raise EinshardError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        return "cpu"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    need = max(_local_ranks() or 0, _local_rank() + 1)
    if launched() and gpus >= need:
        return "cuda"
    if requested == "auto":
        return "cpu"
    if not launched():
        raise EinshardError("--device cuda runs one rank per GPU: start the script with "
                            "`torchrun --nproc-per-node <GPUs> ...` or `srun ...` (without them: --device cpu)")
    raise EinshardError(f"--device cuda: this machine runs {need} ranks (LOCAL_RANK {_local_rank()}) "
                        f"but has {gpus} CUDA device{'s' if gpus != 1 else ''}")


def local_device(requested: str = "auto") -> torch.device:
    """The device of a one-process script for ``--device requested``: ``auto`` is the current CUDA device where
    there is one, else the CPU; ``cuda`` without one raises :class:`~einshard.EinshardError`."""
    if requested not in DEVICES:
        raise EinshardError(f"device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if requested == "cuda":
        raise EinshardError("--device cuda: this machine has no CUDA device (use --device cpu)")
    return torch.device("cpu")


def init_rank(device: str) -> tuple[int, int, int]:
    """Initialise this ``torchrun``/``srun`` rank for ``device`` (:func:`choose_device`'s answer).

    ``cuda``: ``torch.cuda.set_device(LOCAL_RANK)`` and an NCCL process group; ``cpu``: gloo. Afterwards
    :func:`rank_device` is this rank's device. Returns ``(local_rank, rank, world_size)``. In a rank whose
    process group is up already (the harness's ranks) it only selects the GPU and sets :func:`rank_device`.
    """
    cuda = device == "cuda"
    local, rank, world = init_process_group("nccl" if cuda else "gloo", use_cuda=cuda)
    _RANK_DEVICE[0] = torch.device("cuda", local) if cuda else torch.device("cpu")
    return local, rank, world


def rank_device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` in a rank :func:`launch` put on a GPU, else CPU.

    Scripts create their tensors there (the whole tensors of their one-process reference too).
    """
    return _RANK_DEVICE[0]


def synchronize() -> None:
    """Wait for the work queued on this rank's device (CUDA runs asynchronously); nothing on a CPU rank.

    Benchmarks call it before reading a clock.
    """
    if rank_device().type == "cuda":
        torch.cuda.synchronize(rank_device())


def device_mesh(shape, names):
    """``init_device_mesh`` on this rank's device type (:func:`rank_device`) with dimension names ``names``."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    names = (names,) if isinstance(names, str) else tuple(names)
    return init_device_mesh(rank_device().type, shape, mesh_dim_names=names)


def add_device_argument(parser) -> None:
    """Add ``--device {auto,cpu,cuda}`` (default ``auto``) to an ``argparse`` parser, for :func:`launch`."""
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: one GPU per rank over NCCL when started by torchrun/srun on enough GPUs, "
                             "else CPU ranks over gloo (default auto)")


def parse_device(argv=None, description: str | None = None) -> str:
    """The ``--device`` of a script whose only option it is (``argv``: ``sys.argv[1:]`` by default)."""
    parser = argparse.ArgumentParser(description=description)
    add_device_argument(parser)
    return parser.parse_args(argv).device
